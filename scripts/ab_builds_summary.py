#!/usr/bin/env python3
"""The table of scripts/ab_builds.sh: per build label, every process's interleaved medians as bench_fp8.py printed
them (fp8 and bf16 ms, per call and device, per slice) and the median over the build's processes; the fp8 ratio of
each build to the first one. A process whose library (bench_fp8.py's "library build:" line) is not the build its
label asks for -- the defaults, with the label's switches -- is reported first: its numbers are not that build's.
    python scripts/ab_builds_summary.py OUT "label|ENV=VAL" ...   (reads OUT/ab-<label>-<i>.log)
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

# bench_fp8.py's two interleaved summary lines per slice (per call, then device time)
CALL = re.compile(r"^SUMMARY (\w+) interleaved \(.*\| dense [\d.]+ bf16 ([\d.]+) fp8 ([\d.]+) ms")
DEVICE = re.compile(r"^SUMMARY (\w+) interleaved, device time .*\| bf16 ([\d.]+) fp8 ([\d.]+) ms")
BUILD = re.compile(r"^library build: (.*)$", re.M)


def build_of(text: str) -> dict[str, int] | None:
    """The build-time switches a bench_fp8.py log's library was compiled with, or None (no such line)."""
    m = BUILD.search(text)
    return None if m is None else {k: int(v) for k, v in (kv.split("=", 1) for kv in m[1].split())}


def expected_build(envs: str) -> dict[str, int]:
    """The switches of the build a label's "ENV=VAL ..." asks for: the defaults, with its own values."""
    from megatron_mok.kernel import build

    want = {
        "MOK_ABLATION": 0,
        "MOK_FP8_KLOOP": build.FP8_KLOOP_DEFAULT,
        "MOK_FP8_ORDERED": build.FP8_ORDERED_DEFAULT,
        "MOK_FP8_SRC_QUANT": build.FP8_SRC_QUANT_DEFAULT,
        "MOK_FP8_SCALE_KMAJOR": build.FP8_SCALE_KMAJOR_DEFAULT,
    }
    for kv in envs.split():
        k, _, v = kv.partition("=")
        if k in want:
            want[k] = int(v)
    return want


def build_warnings(label: str, envs: str, texts: list[str]) -> list[str]:
    """One line per process of the label whose library is not the build asked for."""
    want = expected_build(envs)
    out = []
    for i, text in enumerate(texts, 1):
        got = build_of(text)
        if got != want:
            out.append(f"WARNING {label} run {i}: library build {got} is not the one asked for {want}")
    return out


def parse(text: str) -> dict[str, dict[str, float]]:
    """slice -> {"bf16", "fp8", "bf16_dev", "fp8_dev"} ms of one bench_fp8.py log."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = CALL.match(line)
        if m:
            out.setdefault(m[1], {}).update(bf16=float(m[2]), fp8=float(m[3]))
        m = DEVICE.match(line)
        if m:
            out.setdefault(m[1], {}).update(bf16_dev=float(m[2]), fp8_dev=float(m[3]))
    return out


def summarize(runs: dict[str, list[dict[str, dict[str, float]]]]) -> list[str]:
    """Lines of the table: per slice and build, the median over its processes, and fp8 time vs the first build."""
    lines: list[str] = []
    labels = list(runs)
    slices = sorted({s for rs in runs.values() for r in rs for s in r})
    for s in slices:
        med: dict[str, dict[str, float]] = {}
        for label in labels:
            got = [r[s] for r in runs[label] if s in r and len(r[s]) == 4]
            if not got:
                lines.append(f"{s:6s} {label:12s} no complete run")
                continue
            med[label] = {k: statistics.median(g[k] for g in got) for k in got[0]}
            m = med[label]
            lines.append(
                f"{s:6s} {label:12s} {len(got)} runs: fp8 {m['fp8']:.3f} ms per call / {m['fp8_dev']:.3f} device, "
                f"bf16 {m['bf16']:.3f} / {m['bf16_dev']:.3f}, fp8 -> {m['bf16'] / m['fp8']:.3f}x / "
                f"{m['bf16_dev'] / m['fp8_dev']:.3f}x bf16"
            )
        base = labels[0]
        for label in labels[1:]:
            if base in med and label in med:
                a, b = med[label], med[base]
                lines.append(
                    f"{s:6s} {label} vs {base}: fp8 time {a['fp8'] / b['fp8']:.3f} per call, "
                    f"{a['fp8_dev'] / b['fp8_dev']:.3f} device (medians of processes)"
                )
    return lines


def main(argv: list[str]) -> None:
    out = Path(argv[1])
    runs: dict[str, list[dict[str, dict[str, float]]]] = {}
    warnings: list[str] = []
    for spec in argv[2:]:
        label, _, envs = spec.partition("|")
        if not label:
            continue
        logs = sorted(out.glob(f"ab-{label}-[0-9]*.log"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        texts = [p.read_text() for p in logs]
        warnings += build_warnings(label, envs, texts)
        runs[label] = [parse(t) for t in texts]
    print("\n".join(warnings + summarize(runs)))


if __name__ == "__main__":
    main(sys.argv)
