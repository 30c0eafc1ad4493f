"""The PyTorch reference of MoK against the plain per-token math, forward and backward."""

from __future__ import annotations

import pytest
import torch
from moe_math import dense_grads
from routings import ROUTINGS, make_topk

from megatron_mok.function import mok_moe
from megatron_mok.plan import MokPlan, RingSpec
from megatron_mok.reference import RingBuffer, dense_moe_reference
from megatron_mok.testing import spawn
from megatron_mok.transport import ProcessGroupTransport, run_emulated


def _problem(R, L, H, F, K, tokens, kind, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    E = R * L
    xs = [torch.randn(t, H, generator=g, dtype=torch.float64).to(dtype) for t in tokens]
    idx = [make_topk(kind, t, E, K, g) for t in tokens]
    ws = [torch.rand(t, K, generator=g, dtype=torch.float64).to(dtype) for t in tokens]
    w1 = [(torch.randn(2 * F, H, generator=g, dtype=torch.float64) / H**0.5).to(dtype) for _ in range(E)]
    w2 = [(torch.randn(H, F, generator=g, dtype=torch.float64) / F**0.5).to(dtype) for _ in range(E)]
    return xs, idx, ws, w1, w2


def _mok_rank(tp, xs, idx, ws, w1, w2, ring, L):
    r = tp.rank
    x = xs[r].clone().requires_grad_()
    w = ws[r].clone().requires_grad_()
    a = [w1[r * L + e].clone().requires_grad_() for e in range(L)]
    b = [w2[r * L + e].clone().requires_grad_() for e in range(L)]
    plan = MokPlan(tp, len(w1), ring)
    o = mok_moe(x, idx[r], w, a, b, plan)
    ((o * (r + 1)).sum() + (o**2).sum()).backward()
    return o.detach(), x.grad, w.grad, [t.grad for t in a], [t.grad for t in b], plan.stats


@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("kind", ROUTINGS)
def test_reference_equals_per_token_math(R, kind):
    L, H, F, K = (4 if R == 1 else 2), 16, 8, 3
    tokens = [9, 0, 13, 6][:R] if R > 1 else [11]
    xs, idx, ws, w1, w2 = _problem(R, L, H, F, K, tokens, kind, seed=R)
    if R > 2:
        idx[3][1, 2] = -1  # an unused top-k slot contributes nothing
    ring = RingSpec(minibatch_tokens=4, ring_slots=2)  # far smaller than the batch: many cycles
    got = run_emulated(R, lambda tp: _mok_rank(tp, xs, idx, ws, w1, w2, ring, L))
    want = dense_grads(xs, idx, ws, w1, w2, R)
    for r in range(R):
        o, gx, gw, ga, gb, stats = got[r]
        torch.testing.assert_close(o, want[0][r], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gx, want[1][r], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gw, want[2][r], rtol=1e-12, atol=1e-12)
        for e in range(L):
            torch.testing.assert_close(ga[e], want[3][r * L + e], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(gb[e], want[4][r * L + e], rtol=1e-12, atol=1e-12)
        assert stats["ring_fills"] == stats["minibatches"] == -(-stats["rows"] // 4)
    assert max(s[-1]["minibatches"] for s in got) > ring.ring_slots  # the ring really wrapped


def test_bf16_numerics_match_the_kernel_definition():
    R, L, H, F, K = 2, 2, 32, 16, 2
    xs, idx, ws, w1, w2 = _problem(R, L, H, F, K, [20, 17], "random", dtype=torch.bfloat16)
    ws = [w.float() for w in ws]
    ring = RingSpec(8, 2)

    def fwd(tp):
        r = tp.rank
        return mok_moe(xs[r], idx[r], ws[r], w1[r * L : (r + 1) * L], w2[r * L : (r + 1) * L], MokPlan(tp, R * L, ring))

    got = run_emulated(R, fwd)
    for r in range(R):
        want = dense_moe_reference(xs[r], idx[r], ws[r], w1, w2)
        assert got[r].dtype == torch.bfloat16
        torch.testing.assert_close(got[r], want, rtol=1e-2, atol=1e-2)
        assert (got[r].float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()


def _gloo_rank(rank, world_size, problem, out_path):
    xs, idx, ws, w1, w2 = problem
    L = len(w1) // world_size
    res = _mok_rank(ProcessGroupTransport(), xs, idx, ws, w1, w2, RingSpec(3, 2), L)
    torch.save(res[:5], f"{out_path}.{rank}")


@pytest.mark.slow
def test_process_group_transport_equals_emulated(tmp_path):
    R, L = 4, 2
    problem = _problem(R, L, 16, 8, 2, [5, 9, 0, 7], "skewed", seed=7)
    spawn(_gloo_rank, R, problem, str(tmp_path / "res"))
    emu = run_emulated(R, lambda tp: _mok_rank(tp, *problem, RingSpec(3, 2), L))
    for r in range(R):
        got = torch.load(f"{tmp_path / 'res'}.{r}")
        for a, b in zip(got[:3], emu[r][:3]):
            assert torch.equal(a, b)
        for la, lb in zip(got[3:], emu[r][3:5]):
            assert all(torch.equal(a, b) for a, b in zip(la, lb))


def test_ring_buffer_refuses_to_overwrite_a_busy_slot():
    ring = RingBuffer(RingSpec(4, 2), 8, torch.float32, torch.device("cpu"))
    ring.fill(0, 4)
    with pytest.raises(RuntimeError, match="ring slot 0 is FILLED, expected FREE"):
        ring.fill(0, 4)
    ring.computed(0)
    with pytest.raises(RuntimeError, match="COMPUTED"):
        ring.fill(0, 2)
    ring.release(0)
    ring.fill(0, 2)


def test_bad_input_is_a_clear_error():
    xs, idx, ws, w1, w2 = _problem(1, 4, 16, 8, 2, [5], "random")

    def call(**kw):
        args = dict(x=xs[0], topk_idx=idx[0], topk_w=ws[0], w1=w1, w2=w2)
        args.update(kw)
        return run_emulated(1, lambda tp: mok_moe(**args, plan=MokPlan(tp, 4, RingSpec(4, 2))))

    with pytest.raises(RuntimeError, match="expert index 4 out of range"):
        call(topk_idx=idx[0].clamp(max=3) + 1)
    with pytest.raises(RuntimeError, match=r"must be \[tokens, hidden\]"):
        call(x=xs[0][None])
    with pytest.raises(RuntimeError, match="topk_idx has 5 tokens but the input has 4"):
        call(x=xs[0][:4])
    with pytest.raises(RuntimeError, match=r"fc1 weight of local expert 1 must be \[2\*ffn, hidden=16\]"):
        call(w1=[w1[0], w1[1][:, :8], w1[2], w1[3]])
    with pytest.raises(RuntimeError, match="expected 4 local experts"):
        call(w1=w1[:3])
    with pytest.raises(RuntimeError, match="dtype"):
        call(x=xs[0].to(torch.int32))
    with pytest.raises(RuntimeError, match="not divisible by EP size 3"):
        run_emulated(3, lambda tp: mok_moe(xs[0], idx[0], ws[0], w1[:1], w2[:1], MokPlan(tp, 4, RingSpec(4, 2))))


@pytest.mark.parametrize("save_fc1_output", [True, False])
def test_recompute_choice_and_main_grad_fusion(save_fc1_output):
    """fc1 output saved or recomputed gives the same gradients; with Megatron's gradient-accumulation
    fusion the expert wgrads land in fp32 ``main_grad`` and autograd gets Megatron's dummy tensor."""
    R, L = 2, 2
    xs, idx, ws, w1, w2 = _problem(R, L, 16, 8, 2, [9, 6], "skewed", seed=11, dtype=torch.float32)
    ring = RingSpec(4, 2)

    def run(tp, fuse, save=save_fc1_output):
        r = tp.rank
        a = [w1[r * L + e].clone().requires_grad_() for e in range(L)]
        b = [w2[r * L + e].clone().requires_grad_() for e in range(L)]
        for p in (*a, *b):
            p.main_grad = torch.full_like(p, 0.5)  # accumulates on top of what is there
            p.grad_added_to_main_grad = False
        plan = MokPlan(tp, R * L, ring, save_fc1_output=save, fuse_wgrad_into_main_grad=fuse)
        o = mok_moe(xs[r].clone().requires_grad_(), idx[r], ws[r], a, b, plan)
        (o**2).sum().backward()
        return [(p.grad, p.main_grad, p.grad_added_to_main_grad) for p in (*a, *b)]

    plain = run_emulated(R, lambda tp: run(tp, False))
    fused = run_emulated(R, lambda tp: run(tp, True))
    baseline = run_emulated(R, lambda tp: run(tp, False, True))  # default: fc1 output saved
    for r in range(R):
        for (g, mg, added), (_, fmg, fadded), want in zip(plain[r], fused[r], [g for g, _, _ in baseline[r]]):
            assert not added and torch.equal(mg, torch.full_like(mg, 0.5))
            assert fadded
            torch.testing.assert_close(fmg - 0.5, g, rtol=1e-5, atol=1e-6)
            # saved or recomputed fc1 output: the same weight gradients as the default (saved) path
            torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-7)


class _AccumulatingBackend:
    """A backend that, like the kernel backend, adds the weight gradients into main_grad itself."""

    name = "accumulating"

    @staticmethod
    def can_accumulate_main_grad(main_grads):  # the kernel backend's own rule (layout the kernel can write)
        from megatron_mok.kernel_backend import KernelBackend

        return KernelBackend.can_accumulate_main_grad(main_grads)

    def __init__(self):
        from megatron_mok.reference import ReferenceBackend

        self.inner = ReferenceBackend()
        self.calls: list[bool] = []

    def forward(self, plan, x, topk_idx, topk_w, w1, w2):
        return self.inner.forward(plan, x, topk_idx, topk_w, w1, w2)

    def backward(self, plan, state, grad_out, w1, w2, main_grads=None):
        self.calls.append(main_grads is not None)
        gx, gw, g1, g2 = self.inner.backward(plan, state, grad_out, w1, w2)
        if main_grads is None:
            return gx, gw, g1, g2
        for mg, gs in zip(main_grads, (g1, g2)):
            for m, g in zip(mg, gs):
                m.add_(g)
        return gx, gw, list(main_grads[0]), list(main_grads[1])


@pytest.mark.parametrize("layout_ok", [True, False])
def test_backend_side_main_grad_accumulation(layout_ok):
    """With gradient-accumulation fusion and a backend that accumulates into main_grad, the autograd node
    hands it every main_grad (and adds nothing itself); a main_grad layout the kernel cannot write (here a
    transposed view) falls back to the node's own add. Either way main_grad = before + the gradient."""
    R, L = 1, 2
    xs, idx, ws, w1, w2 = _problem(R, L, 16, 8, 2, [11], "random", seed=12, dtype=torch.float32)
    ring = RingSpec(4, 2)

    def run(tp, fuse, backend):
        a = [w1[e].clone().requires_grad_() for e in range(L)]
        b = [w2[e].clone().requires_grad_() for e in range(L)]
        for p in (*a, *b):
            if layout_ok:
                p.main_grad = torch.full_like(p, 0.25)
            else:  # same values, but a transposed (non-unit inner stride) view
                p.main_grad = torch.full((p.shape[1], p.shape[0]), 0.25).t()
            p.grad_added_to_main_grad = False
        plan = MokPlan(tp, L, ring, fuse_wgrad_into_main_grad=fuse)
        o = mok_moe(xs[0].clone().requires_grad_(), idx[0], ws[0], a, b, plan, backend)
        (o**2).sum().backward()
        return [(p.grad, p.main_grad.clone(), p.grad_added_to_main_grad) for p in (*a, *b)]

    acc = _AccumulatingBackend()
    plain = run_emulated(1, lambda tp: run(tp, False, acc))[0]
    fused = run_emulated(1, lambda tp: run(tp, True, acc))[0]
    assert acc.calls == [False, layout_ok]
    for (g, _, _), (_, mg, added) in zip(plain, fused):
        assert added
        torch.testing.assert_close(mg - 0.25, g, rtol=1e-5, atol=1e-6)
