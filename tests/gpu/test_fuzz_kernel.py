"""GPU fuzz: the kernels (forward, then the backward with the wgrad kernel) against an oracle over seeded random cases
(tests/fuzz.py), with every output's memory poisoned first.

* bf16 against the PyTorch reference (the CPU oracle, run here on the GPU): EP 1-8 ranks' launches on one GPU, 1-64
  experts per rank, hidden / ffn sizes the kernel tiles, top-k up to 8, 1-16384 tokens per rank drawn log-uniformly
  (odd counts, and ranks without tokens), six routing distributions, minibatches of 64-4096 rows in 1-4 ring slots,
  the in-SM pull and comm SMs.
* FP8 (e4m3, 1 x 128 / 128 x 128 block scales; the FP8 dgrad from the saved fc1 output) against the FP8 recipe
  (tests/gpu/mok_truth.py) at sizes of multiples of 128, 1-16 experts per rank, up to 4096 tokens per rank.

``--fuzz-cases N`` / ``--fuzz-seed S`` run other cases (N of each test); every failure names its seed. Poison: before
each launch the caching allocator is handed NaN-filled blocks of exactly the outputs' sizes on every rank's stream,
which the operators' output allocations then reuse, so an element a kernel leaves unwritten reads NaN and fails the
finite check (best effort: another allocation of the same size can take a block first).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import emulated  # noqa: E402
from emulated import mok_backward_emulated, mok_forward_emulated  # noqa: E402
from fuzz import Case, draw_case, draw_routing  # noqa: E402
from mok_truth import ground_truth_fp8, ground_truth_fp8_backward, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu

DEFAULT_CASES = {"bf16": 200, "fp8": 100}
TOL = {"bf16": 2e-2, "fp8": 3e-2}  # relative Frobenius error: bf16 vs the reference; FP8 vs its recipe, where a
# fast sigmoid can move one e4m3 rounding, a step of 1/16, which weighs more in a case of a few tokens
FP8_SEED_OFFSET = 1_000_000  # the FP8 cases draw from their own seeds


def pytest_generate_tests(metafunc):
    if "seed" in metafunc.fixturenames:
        dtype = "fp8" if "fp8" in metafunc.function.__name__ else "bf16"
        n = metafunc.config.getoption("--fuzz-cases") or DEFAULT_CASES[dtype]
        first = metafunc.config.getoption("--fuzz-seed")
        metafunc.parametrize("seed", range(first, first + n))


def _draw(seed: int, fp8: bool) -> Case:
    if fp8:
        return draw_case(
            seed + FP8_SEED_OFFSET, ranks=(1, 2, 4, 8), experts=(1, 16), hidden=(128, 256, 384, 512),
            ffn=(128, 256, 384), tokens=(1, 4096), log_tokens=True, minibatches=(64, 128, 256, 512, 2048),
        )  # fmt: skip
    return draw_case(
        seed, ranks=(1, 2, 4, 8), experts=(1, 64), hidden=(64, 128, 192, 256, 512), ffn=(64, 128, 192, 256),
        tokens=(1, 16384), log_tokens=True, minibatches=(64, 128, 192, 512, 2048, 4096),
    )  # fmt: skip


def _poison(R: int, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Hand the caching allocator NaN-filled blocks of these sizes (two of each) on every stream the R ranks launch on
    (the allocator reuses a freed block only on the stream it was allocated on): the next allocations of the same
    sizes there reuse them. Best effort: another allocation of the same size can take a block first."""
    dev = torch.device("cuda", torch.cuda.current_device())
    streams = [torch.cuda.current_stream(dev)]
    if R > 1:  # the fixture's rank streams (emulated._ranks makes them the same way on first use)
        streams = emulated._STREAMS.setdefault((dev, R), [torch.cuda.Stream(dev) for _ in range(R)])
    for st in streams:
        with torch.cuda.stream(st):
            blocks = [torch.full(s, float("nan"), dtype=d, device=dev) for s, d in shapes for _ in range(2)]
            del blocks


def _inputs(case: Case, seed: int):
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(seed)
    E, H, F, K = case.R * case.L, case.H, case.F, case.K
    xs = [torch.randn(T, H, generator=g).to(dev, torch.bfloat16) for T in case.tokens]
    idx = [i.to(dev, torch.int32) for i in draw_routing(case, g)]
    ws = [torch.rand(T, K, generator=g).to(dev) for T in case.tokens]
    w1 = [(torch.randn(2 * F, H, generator=g) / H**0.5).to(dev, torch.bfloat16) for _ in range(E)]
    w2 = [(torch.randn(H, F, generator=g) / F**0.5).to(dev, torch.bfloat16) for _ in range(E)]
    gos = [torch.randn(T, H, generator=g).to(dev, torch.bfloat16) for T in case.tokens]
    return xs, idx, ws, w1, w2, gos


def _output_shapes(case: Case) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Every output a launch allocates: the forward's out and the backward's grad_x ([T, H] bf16, T the ranks' largest
    count: the fixture pads the others), grad_w [T, K] fp32 and the weight gradients [L, 2F, H] / [L, H, F] fp32."""
    T, H, F, K, L = max(case.tokens), case.H, case.F, case.K, case.L
    return [
        ((T, H), torch.bfloat16),
        ((T, K), torch.float32),
        ((L, 2 * F, H), torch.float32),
        ((L, H, F), torch.float32),
    ]


def _reference(case: Case, xs, idx, ws, w1, w2, gos):
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


def _assert_close(case: Case, comm: int, r: int, got: dict, want: dict, tol: float) -> None:
    finite = {k: bool(torch.isfinite(v.float()).all()) for k, v in got.items()}
    errs = {k: rel_err(got[k], want[k]) for k in got}
    bad = {k: e for k, e in errs.items() if not e < tol}
    assert all(finite.values()) and not bad, (
        f"{case}, comm SMs {comm}: rank {r}: errors over {tol:g}: {bad}; not finite (unwritten or overflow): "
        f"{[k for k, f in finite.items() if not f]}"
    )


def _per_rank(case: Case, ws: list) -> list[list]:
    return [ws[q * case.L : (q + 1) * case.L] for q in range(case.R)]


def test_bf16_kernels_equal_the_reference(kernel, seed):
    case = _draw(seed, fp8=False)
    xs, idx, ws, w1, w2, gos = _inputs(case, seed)
    cfg = dict(ring_slots=case.ring_slots, minibatch_tokens=case.minibatch, timeout_ms=5000.0)
    comm = seed % 3
    _poison(case.R, _output_shapes(case))
    out, comb, _ = mok_forward_emulated(xs, idx, ws, _per_rank(case, w1), _per_rank(case, w2), comm_sms=comm, **cfg)
    _poison(case.R, _output_shapes(case))
    gx, gw, g1, g2 = mok_backward_emulated(
        gos, xs, idx, ws, comb, _per_rank(case, w1), _per_rank(case, w2), comm_sms=2, **cfg
    )
    torch.cuda.synchronize()
    ref = _reference(case, xs, idx, ws, w1, w2, gos)
    for r in range(case.R):
        want_out, want_gx, want_gw, want_g1, want_g2 = ref[r]
        got = {"out": out[r], "grad_x": gx[r], "grad_topk_weight": gw[r]}
        want = {"out": want_out, "grad_x": want_gx, "grad_topk_weight": want_gw}
        got.update(grad_w1=torch.stack(g1[r]), grad_w2=torch.stack(g2[r]))
        want.update(grad_w1=torch.stack(want_g1), grad_w2=torch.stack(want_g2))
        _assert_close(case, comm, r, got, want, TOL["bf16"])


def test_fp8_kernels_equal_the_recipe(kernel, seed):
    from megatron_mok.kernel.quant import quantize_expert_weights

    case = _draw(seed, fp8=True)
    xs, idx, ws, w1, w2, gos = _inputs(case, seed + FP8_SEED_OFFSET)
    w1r, w2r = _per_rank(case, w1), _per_rank(case, w2)
    q8 = quantize_expert_weights(w1r, w2r, transposed=True)
    rows = max(1, sum(case.tokens) * case.K)
    saved = [torch.full((rows, 2 * case.F), 7.0, dtype=torch.bfloat16, device="cuda") for _ in range(case.R)]
    cfg = dict(ring_slots=case.ring_slots, minibatch_tokens=case.minibatch, timeout_ms=5000.0)
    comm = seed % 3
    _poison(case.R, _output_shapes(case))
    out, comb, tpe = mok_forward_emulated(xs, idx, ws, w1r, w2r, comm_sms=comm, fp8=q8, saved_h=saved, **cfg)
    comb = [c.view(T, case.K, case.H) for c, T in zip(comb, case.tokens)]
    _poison(case.R, _output_shapes(case))
    gx, gw, g1, g2 = mok_backward_emulated(gos, xs, idx, ws, comb, w1r, w2r, comm_sms=2, saved_h=saved, fp8=q8, **cfg)
    torch.cuda.synchronize()
    r_out, _, _ = ground_truth_fp8(xs, idx, ws, w1r, w2r)
    r_gx, r_gw, r_g1, r_g2 = ground_truth_fp8_backward(xs, idx, ws, w1r, w2r, gos, comb, saved)
    for r in range(case.R):
        got = {"out": out[r], "grad_x": gx[r], "grad_topk_weight": gw[r] * (idx[r] >= 0)}
        want = {"out": r_out[r], "grad_x": r_gx[r], "grad_topk_weight": r_gw[r]}
        _assert_close(case, comm, r, got, want, TOL["fp8"])
    for q in range(case.R):
        got = {"grad_w1": torch.stack(g1[q]), "grad_w2": torch.stack(g2[q])}
        want = {"grad_w1": torch.stack(r_g1[q]), "grad_w2": torch.stack(r_g2[q])}
        _assert_close(case, comm, q, got, want, TOL["fp8"])
        n = int(tpe[q].sum())  # the saved fc1 rows past the routed ones are never written
        assert torch.equal(saved[q][n:], torch.full_like(saved[q][n:], 7.0)), f"{case}: saved h written past row {n}"
