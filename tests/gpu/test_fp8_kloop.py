"""GPU: the FP8 kernels' build-time choices give the same bits: the two K loops (MOK_FP8_KLOOP:
csrc/mok/fp8_kloop.cuh) and the issue-order code left out (MOK_FP8_ORDERED=0, which refuses a non-zero
MOK_FP8_ISSUE_ORDER with an error naming both).

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


def _proc(kloop: int, ordered: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MOK_FP8_KLOOP=str(kloop), MOK_FP8_ORDERED=str(ordered))
    env.pop("MOK_FP8_ISSUE_ORDER", None)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(RUNNER), *args], env=env, capture_output=True, text=True, timeout=600)


def _run(kloop: int, path: Path, ordered: int = 1) -> dict:
    res = _proc(kloop, ordered, str(path))
    assert res.returncode == 0, (
        f"MOK_FP8_KLOOP={kloop} MOK_FP8_ORDERED={ordered}: rc {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    )
    return torch.load(path)


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
    _same_bits(a, _run(2, tmp_path / "k2.pt"), "MOK_FP8_KLOOP=2")
    _same_bits(a, _run(0, tmp_path / "o0.pt", ordered=0), "MOK_FP8_ORDERED=0")


def test_fp8_unordered_build_refuses_an_issue_order(kernel):
    res = _proc(0, 0, "-", "refusal")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "REFUSED" in res.stdout and "MOK_FP8_ORDERED=0" in res.stdout, res.stdout[-2000:]
