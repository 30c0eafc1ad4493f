#!/usr/bin/env python3
"""The table of scripts/ab_builds.sh: per build label, every process's interleaved medians as bench_fp8.py printed
them (fp8 and bf16 ms, per call and device, per slice) and the median over the build's processes; the fp8 ratio of
each build to the first one.
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
    for spec in argv[2:]:
        label = spec.split("|", 1)[0]
        if not label:
            continue
        logs = sorted(out.glob(f"ab-{label}-[0-9]*.log"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        runs[label] = [parse(p.read_text()) for p in logs]
    print("\n".join(summarize(runs)))


if __name__ == "__main__":
    main(sys.argv)
