"""GPU: the FP8 kernels' build-time choices give the same bits: the two K loops (MOK_FP8_KLOOP:
csrc/mok/fp8_kloop.cuh), the issue-order code left out (MOK_FP8_ORDERED=0, which refuses a non-zero
MOK_FP8_ISSUE_ORDER with an error naming both), and each token quantised once at its source instead of every
pulled copy (MOK_FP8_SRC_QUANT=1: the same 1 x 128 blocks of the same rows), in emulated and per-rank launches,
and the activation scales kept K-block-major (MOK_FP8_SCALE_KMAJOR=1: the same scales in another order).

The pipelined halves promote the same accumulator elements by the same factors and run the same MMAs per
element as the drained m64n256 loop, and the issue order only orders issues, so the FP8 forward (out,
combine rows, saved h) and the FP8 dgrad (grad_x, router grad, and the weight gradients from its dH) must
agree exactly. Each choice is a library of its own, so each runs in a process of its own
(tests/gpu/fp8_kloop_run.py) and the results are compared here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

RUNNER = Path(__file__).with_name("fp8_kloop_run.py")


def _proc(kloop: int, ordered: int, *args: str, src_quant: int = 0, kmajor: int = 0) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        MOK_FP8_KLOOP=str(kloop),
        MOK_FP8_ORDERED=str(ordered),
        MOK_FP8_SRC_QUANT=str(src_quant),
        MOK_FP8_SCALE_KMAJOR=str(kmajor),
    )
    env.pop("MOK_FP8_ISSUE_ORDER", None)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(RUNNER), *args], env=env, capture_output=True, text=True, timeout=600)


def _run(kloop: int, path: Path, ordered: int = 1, src_quant: int = 0, kmajor: int = 0) -> dict:
    res = _proc(kloop, ordered, str(path), src_quant=src_quant, kmajor=kmajor)
    what = (
        f"MOK_FP8_KLOOP={kloop} MOK_FP8_ORDERED={ordered} MOK_FP8_SRC_QUANT={src_quant} MOK_FP8_SCALE_KMAJOR={kmajor}"
    )
    assert res.returncode == 0, f"{what}: rc {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    got = torch.load(path)
    # the subprocess ran the library it was asked for (else the comparison below could not fail)
    want = {"MOK_FP8_ORDERED": ordered, "MOK_FP8_SRC_QUANT": src_quant, "MOK_FP8_SCALE_KMAJOR": kmajor}
    assert got["built"] == want, (what, got["built"])
    # a build that pulls source-quantised rows refuses per-rank FP8 launches over regions without the copy
    refusal = got["fp8_sources_refusal"]
    assert ("fp8_sources=True" in refusal) if src_quant else refusal == "", (what, refusal)
    return got["cases"]


def _same_bits(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for case in a:
        assert a[case].keys() == b[case].keys(), (what, case)
        for name in a[case]:
            assert len(a[case][name]) == len(b[case][name]), (what, case, name)
            for r, (x, y) in enumerate(zip(a[case][name], b[case][name])):
                assert x.shape == y.shape, (what, case, name, r)
                if not torch.equal(x, y):
                    d = (x.float() - y.float()).abs().max()  # (x, y not empty: empty tensors are equal)
                    raise AssertionError(f"{what}: case {case} {name}[{r}]: max |diff| {d}")


def test_fp8_build_choices_give_identical_bits(kernel, bk, tmp_path):
    a = _run(0, tmp_path / "k0.pt")  # the build with the issue-order code (order 1, its default)
    _same_bits(a, _run(0, tmp_path / "o0.pt", ordered=0), "MOK_FP8_ORDERED=0")
    _same_bits(a, _run(0, tmp_path / "s1.pt", ordered=0, src_quant=1), "MOK_FP8_SRC_QUANT=1")
    _same_bits(a, _run(0, tmp_path / "m1.pt", ordered=0, kmajor=1), "MOK_FP8_SCALE_KMAJOR=1")
    both = _run(0, tmp_path / "sm1.pt", ordered=0, src_quant=1, kmajor=1)
    _same_bits(a, both, "MOK_FP8_SRC_QUANT=1 MOK_FP8_SCALE_KMAJOR=1")
    _same_bits(a, _run(2, tmp_path / "k2.pt"), "MOK_FP8_KLOOP=2")
    _same_bits(a, _run(2, tmp_path / "k2m1.pt", ordered=0, kmajor=1), "MOK_FP8_KLOOP=2 MOK_FP8_SCALE_KMAJOR=1")


def test_fp8_unordered_build_refuses_an_issue_order(kernel):
    res = _proc(0, 0, "-", "refusal")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "REFUSED" in res.stdout and "MOK_FP8_ORDERED=0" in res.stdout, res.stdout[-2000:]
