"""GPU: the two FP8 K loops (MOK_FP8_KLOOP, a build-time choice: csrc/mok/fp8_kloop.cuh) give the same bits.

The pipelined halves promote the same accumulator elements by the same factors and run the same MMAs per
element as the drained m64n256 loop, so the FP8 forward (out, combine rows, saved h) and the FP8 dgrad
(grad_x, router grad, and the weight gradients from its dH) must agree exactly. Each loop is its own library, so each runs in a process of its
own (tests/gpu/fp8_kloop_run.py) and the results are compared here.
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


def _run(kloop: int, path: Path) -> dict:
    env = dict(os.environ, MOK_FP8_KLOOP=str(kloop))
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, str(RUNNER), str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (
        f"MOK_FP8_KLOOP={kloop}: rc {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    )
    return torch.load(path)


def test_fp8_kloops_give_identical_bits(kernel, bk, tmp_path):
    a = _run(0, tmp_path / "k0.pt")
    b = _run(2, tmp_path / "k2.pt")
    assert a.keys() == b.keys() and len(a) > 0
    for case in a:
        for name in a[case]:
            for r, (x, y) in enumerate(zip(a[case][name], b[case][name])):
                assert x.shape == y.shape, (case, name, r)
                assert torch.equal(x, y), f"case {case} {name}[{r}]: max |diff| {(x.float() - y.float()).abs().max()}"
