"""GPU fuzz: the bf16 kernels (forward, then the backward with the wgrad kernel) against the PyTorch reference over
seeded random cases (tests/fuzz.py): EP 1-8 ranks' launches on one GPU, 1-8 experts per rank, hidden / ffn sizes the
kernel tiles, top-k up to 8, 0-2048 tokens per rank (odd counts included), six routing distributions, the in-SM pull
and comm SMs. ``--fuzz-cases N`` / ``--fuzz-seed S`` run other cases; every failure names its seed."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from emulated import mok_backward_emulated, mok_forward_emulated  # noqa: E402
from fuzz import draw_case, draw_routing  # noqa: E402

pytestmark = pytest.mark.gpu

DEFAULT_CASES = 60
TOL = 2e-2  # relative Frobenius error, bf16 data with fp32 accumulation (as the other kernel tests)


def pytest_generate_tests(metafunc):
    if "seed" in metafunc.fixturenames:
        n = metafunc.config.getoption("--fuzz-cases") or DEFAULT_CASES
        first = metafunc.config.getoption("--fuzz-seed")
        metafunc.parametrize("seed", range(first, first + n))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    nb = b.norm().item()
    return a.norm().item() if nb == 0.0 else ((a - b).norm() / nb).item()


def _reference(case, xs, idx, ws, w1, w2, gos):
    from megatron_mok.plan import MokPlan, RingSpec
    from megatron_mok.reference import mok_backward, mok_forward
    from megatron_mok.transport import run_emulated

    L = case.L

    def body(tp):
        r = tp.rank
        plan = MokPlan(tp, case.R * L, RingSpec(case.minibatch, case.ring_slots))
        a, b = w1[r * L : (r + 1) * L], w2[r * L : (r + 1) * L]
        out, state = mok_forward(plan, xs[r], idx[r].long(), ws[r], a, b)
        return (out, *mok_backward(plan, state, gos[r], a, b))

    return run_emulated(case.R, body)


def test_kernels_equal_the_reference(kernel, seed):
    case = draw_case(
        seed, ranks=(1, 2, 4, 8), experts=(1, 8), hidden=(64, 128, 192, 256, 512), ffn=(64, 128, 192, 256),
        tokens=(1, 2048), minibatches=(64, 128, 192, 512, 2048),
    )  # fmt: skip
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(seed)
    E, H, F, K = case.R * case.L, case.H, case.F, case.K
    xs = [torch.randn(T, H, generator=g).to(dev, torch.bfloat16) for T in case.tokens]
    idx = [i.to(dev, torch.int32) for i in draw_routing(case, g)]
    ws = [torch.rand(T, K, generator=g).to(dev) for T in case.tokens]
    w1 = [(torch.randn(2 * F, H, generator=g) / H**0.5).to(dev, torch.bfloat16) for _ in range(E)]
    w2 = [(torch.randn(H, F, generator=g) / F**0.5).to(dev, torch.bfloat16) for _ in range(E)]
    gos = [torch.randn(T, H, generator=g).to(dev, torch.bfloat16) for T in case.tokens]
    per_rank = lambda ws_: [ws_[q * case.L : (q + 1) * case.L] for q in range(case.R)]  # noqa: E731
    cfg = dict(ring_slots=case.ring_slots, minibatch_tokens=case.minibatch, timeout_ms=5000.0)
    out, comb, _ = mok_forward_emulated(xs, idx, ws, per_rank(w1), per_rank(w2), comm_sms=seed % 3, **cfg)
    gx, gw, g1, g2 = mok_backward_emulated(gos, xs, idx, ws, comb, per_rank(w1), per_rank(w2), comm_sms=2, **cfg)
    torch.cuda.synchronize()
    ref = _reference(case, xs, idx, ws, w1, w2, gos)
    for r in range(case.R):
        want_out, want_gx, want_gw, want_g1, want_g2 = ref[r]
        errs = {
            "out": _rel(out[r], want_out),
            "grad_x": _rel(gx[r], want_gx),
            "grad_topk_weight": _rel(gw[r], want_gw),
            "grad_w1": _rel(torch.stack(g1[r]), torch.stack(want_g1)),
            "grad_w2": _rel(torch.stack(g2[r]), torch.stack(want_g2)),
        }
        finite = all(torch.isfinite(t.float()).all() for t in (out[r], gx[r], gw[r], *g1[r], *g2[r]))
        assert finite and max(errs.values()) < TOL, f"{case}, comm SMs {seed % 3}: rank {r}: {errs} (finite: {finite})"
