"""scripts/ab_builds_summary.py: the bench lines it reads (bench_fp8.py's interleaved summaries, taken from a real
H200 log) and the per-build medians and ratios it prints."""

from __future__ import annotations

from types import ModuleType

import pytest
from load_script import SCRIPTS, load_script

LOG = SCRIPTS / "logs" / "h200-2026-12-05j-run4-bench-fp8-backward.log"


def _load() -> ModuleType:
    return load_script("ab_builds_summary")


def test_parses_a_real_bench_log():
    got = _load().parse(LOG.read_text())
    # SUMMARY kimi interleaved ... dense 8.761 bf16 9.426 fp8 6.955 ms / device ... bf16 9.327 fp8 6.746 ms
    assert got["kimi"] == {"bf16": 9.426, "fp8": 6.955, "bf16_dev": 9.327, "fp8_dev": 6.746}
    assert got["dsv3"] == {"bf16": 9.966, "fp8": 7.173, "bf16_dev": 9.837, "fp8_dev": 7.018}


def test_medians_and_ratio_to_the_first_build(tmp_path):
    mod = _load()
    text = LOG.read_text()
    faster = text.replace("fp8 6.955 ms", "fp8 6.816 ms").replace("fp8 6.746 ms", "fp8 6.611 ms")
    for i, t in enumerate((text, text, faster), 1):  # base: 2 runs; new: 1 run, fp8 2 % faster
        (tmp_path / f"ab-base-{i}.log").write_text(t)
    (tmp_path / "ab-new-1.log").write_text(faster)
    (tmp_path / "ab-new-2.log").write_text(faster)
    (tmp_path / "ab-new-3.log").write_text(text)
    runs = {
        label: [mod.parse(p.read_text()) for p in sorted(tmp_path.glob(f"ab-{label}-*.log"))]
        for label in ("base", "new")
    }
    lines = mod.summarize(runs)
    kimi = [ln for ln in lines if ln.startswith("kimi")]
    assert "base         3 runs: fp8 6.955 ms per call / 6.746 device" in kimi[0]
    assert "new          3 runs: fp8 6.816 ms per call / 6.611 device" in kimi[1]
    ratio = 6.816 / 6.955
    assert f"new vs base: fp8 time {ratio:.3f} per call" in kimi[2]


@pytest.mark.parametrize("line", ["", "SUMMARY kimi: bf16 8.967 ms", "SUMMARY kimi backward: bf16 20.350 ms"])
def test_other_lines_are_ignored(line):
    assert _load().parse(line) == {}


def test_a_process_of_the_wrong_build_is_reported():
    mod = _load()
    line = "library build: MOK_ABLATION=0 MOK_FP8_KLOOP=0 MOK_FP8_ORDERED=0 MOK_FP8_SRC_QUANT={0} MOK_FP8_SCALE_KMAJOR={0}\n"
    assert mod.build_of(line.format(0)) == {
        "MOK_ABLATION": 0,
        "MOK_FP8_KLOOP": 0,
        "MOK_FP8_ORDERED": 0,
        "MOK_FP8_SRC_QUANT": 0,
        "MOK_FP8_SCALE_KMAJOR": 0,
    }
    assert mod.build_of("SUMMARY kimi: bf16 8.967 ms") is None
    new, old = line.format(1), line.format(0)  # the defaults (build.py) / the row-major FP8 forward
    spec = "MOK_FP8_SRC_QUANT=0 MOK_FP8_SCALE_KMAJOR=0"
    assert mod.build_warnings("old", spec, [old, old]) == []
    assert mod.build_warnings("base", "", [new]) == []  # the defaults
    bad = mod.build_warnings("old", spec, [old, new, "no build line"])
    assert [w.split(":")[0] for w in bad] == ["WARNING old run 2", "WARNING old run 3"]
    assert mod.build_warnings("base", "", [old])[0].startswith("WARNING base run 1")
