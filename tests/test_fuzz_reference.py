"""CPU fuzz: the PyTorch reference of MoK (the kernels' oracle) against the plain per-token math, forward and every
gradient, in fp64, over seeded random cases (tests/fuzz.py): EP 1, 2, 4 ranks as threads, 1-4 experts per rank, top-k
up to 8, token counts 0-40 per rank, six routing distributions, minibatches of 1-64 rows in 1-4 ring slots.
``--fuzz-cases N`` / ``--fuzz-seed S`` run other cases; every failure names its seed."""

from __future__ import annotations

import torch
from fuzz import draw_case, draw_routing
from moe_math import dense_grads

from megatron_mok.function import mok_moe
from megatron_mok.plan import MokPlan, RingSpec
from megatron_mok.transport import run_emulated

DEFAULT_CASES = 40


def _cases(config) -> list[int]:
    n = config.getoption("--fuzz-cases") or DEFAULT_CASES
    first = config.getoption("--fuzz-seed")
    return list(range(first, first + n))


def pytest_generate_tests(metafunc):
    if "seed" in metafunc.fixturenames:
        metafunc.parametrize("seed", _cases(metafunc.config))


def _run(case, xs, idx, ws, w1, w2):
    ring = RingSpec(case.minibatch, case.ring_slots)

    def rank(tp):
        r, L = tp.rank, case.L
        x, w = xs[r].clone().requires_grad_(), ws[r].clone().requires_grad_()
        a = [w1[r * L + e].clone().requires_grad_() for e in range(L)]
        b = [w2[r * L + e].clone().requires_grad_() for e in range(L)]
        o = mok_moe(x, idx[r], w, a, b, MokPlan(tp, case.R * L, ring))
        ((o * (r + 1)).sum() + (o**2).sum()).backward()  # the loss dense_grads differentiates
        return o.detach(), x.grad, w.grad, [t.grad for t in a], [t.grad for t in b]

    return run_emulated(case.R, rank)


def test_reference_equals_per_token_math(seed):
    case = draw_case(seed)
    g = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)
    E = case.R * case.L
    xs = [torch.randn(T, case.H, generator=g, **f64) for T in case.tokens]
    idx = draw_routing(case, g)
    ws = [torch.rand(T, case.K, generator=g, **f64) for T in case.tokens]
    w1 = [torch.randn(2 * case.F, case.H, generator=g, **f64) / case.H**0.5 for _ in range(E)]
    w2 = [torch.randn(case.H, case.F, generator=g, **f64) / case.F**0.5 for _ in range(E)]
    got = _run(case, xs, idx, ws, w1, w2)
    out, gx, gw, g1, g2 = dense_grads(xs, idx, ws, w1, w2, case.R)
    close = dict(rtol=1e-10, atol=1e-10)
    for r in range(case.R):
        o, dx, dw, d1, d2 = got[r]
        for name, a, b in (("output", o, out[r]), ("grad x", dx, gx[r]), ("grad top-k weights", dw, gw[r])):
            torch.testing.assert_close(a, b, **close, msg=lambda m, n=name, r=r: f"{case}: rank {r} {n}: {m}")
        for e in range(case.L):
            q = r * case.L + e
            torch.testing.assert_close(d1[e], g1[q], **close, msg=lambda m, q=q: f"{case}: expert {q} fc1 grad: {m}")
            torch.testing.assert_close(d2[e], g2[q], **close, msg=lambda m, q=q: f"{case}: expert {q} fc2 grad: {m}")


def test_cases_cover_every_distribution_and_edge():
    """The default cases reach what the campaign claims (no computation)."""
    cases = [draw_case(s) for s in range(DEFAULT_CASES)]
    assert {c.routing for c in cases} == {"uniform", "zipf", "one_expert", "one_rank", "empty_ranks", "holes"}
    assert {c.R for c in cases} == {1, 2, 4}
    assert any(0 in c.tokens for c in cases) and any(any(t % 2 for t in c.tokens) for c in cases)
    assert any(c.K > c.L for c in cases) and any(c.minibatch == 1 for c in cases)
