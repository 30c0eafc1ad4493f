"""GPU tests of the MoK backward megakernel (emulated EP on one H200) against megatron_mok.reference.

The reference runs per rank through ``megatron_mok.transport.run_emulated`` (mok_forward, then
mok_backward, called directly: autograd backward in several threads would share the CUDA autograd
worker thread and deadlock on the transport barriers). The kernel gets the reference forward's
combine_buf (bf16), so these tests do not depend on the forward kernel; one test chains the forward
kernel into the backward kernel.

Tolerance: relative Frobenius error < 2e-2 (bf16 operands; the kernel rounds w*grad_out, dH and the
pushed dX rows to bf16, the reference keeps them in fp32) on grad_x, grad_topk_weight, grad_w1, grad_w2
(per rank; weight grads stacked over the rank's experts).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from emulated import kept_rows, mok_backward_emulated, mok_forward_emulated  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

TOL = 2e-2


def _rel(a, b):
    a, b = a.float(), b.float()
    nb = b.norm().item()
    if nb == 0.0:
        return a.norm().item()
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------
def _reference(R, E, L, ring, xs, idx, ws, w1, w2, gos, glu=None):
    from megatron_mok.activation import PLAIN
    from megatron_mok.plan import MokPlan
    from megatron_mok.reference import mok_backward, mok_forward
    from megatron_mok.transport import run_emulated

    def body(tp):
        r = tp.rank
        plan = MokPlan(tp, E, ring, glu=glu or PLAIN)
        wr1, wr2 = w1[r * L : (r + 1) * L], w2[r * L : (r + 1) * L]
        out, state = mok_forward(plan, xs[r], idx[r].long(), ws[r], wr1, wr2)
        gx, gw, g1, g2 = mok_backward(plan, state, gos[r], wr1, wr2)
        return out, state.combine_buf.contiguous(), gx, gw, g1, g2

    return run_emulated(R, body)


def _case(
    bk,
    R,
    kind,
    *,
    L=4,
    H=512,
    F=256,
    K=4,
    tokens=None,
    comm_sms=2,
    ring_slots=2,
    minibatch=128,
    seed=0,
    idx_override=None,
    wgrad="kernel",
    chain_forward=False,
    saved_h=False,
    kept=False,
    glu=None,
):
    from routings import make_topk

    from megatron_mok.plan import RingSpec

    g = torch.Generator().manual_seed(seed)
    E = R * L
    if tokens is None:
        tokens = [300 + 37 * r for r in range(R)]
        if R > 1:
            tokens[1] = 0  # a rank with no tokens still serves and receives
    dev = torch.device("cuda")
    xs = [torch.randn(t, H, generator=g).to(dev, torch.bfloat16) for t in tokens]
    if idx_override is not None:
        idx = [i.to(dev) for i in idx_override]
    else:
        idx = [make_topk(kind, t, E, K, g).to(dev) for t in tokens]
    ws = [torch.rand(t, K, generator=g).to(dev) for t in tokens]
    w1 = [(torch.randn(2 * F, H, generator=g) / H**0.5).to(dev, torch.bfloat16) for _ in range(E)]
    w2 = [(torch.randn(H, F, generator=g) / F**0.5).to(dev, torch.bfloat16) for _ in range(E)]
    gos = [torch.randn(t, H, generator=g).to(dev, torch.bfloat16) for t in tokens]
    ring = RingSpec(minibatch_tokens=minibatch, ring_slots=ring_slots)
    ref = _reference(R, E, L, ring, xs, idx, ws, w1, w2, gos, glu)
    comb = [ref[r][1].view(tokens[r], K, H) for r in range(R)]
    hs = None
    if saved_h:  # the forward kernel keeps h (bf16) and the backward reads it instead of recomputing fc1
        chain_forward = True
        hs = [torch.full((sum(tokens) * K, 2 * F), float("nan"), dtype=torch.bfloat16, device=dev) for _ in range(R)]
    keep = None
    if kept:  # the forward keeps xl / act (NaN first: every row the backward reads must be written)
        chain_forward = True

        keep = kept_rows(R, sum(tokens) * K, H, F, minibatch, dev)
        keep.x.fill_(float("nan"))
        keep.act.fill_(float("nan"))
    if chain_forward:
        from megatron_mok import kernel as fk

        if not fk.is_available():
            pytest.skip(f"forward kernel unavailable: {fk.unavailable_reason()}")
        out, comb, _ = mok_forward_emulated(
            xs,
            [i.int().contiguous() for i in idx],
            ws,
            [w1[q * L : (q + 1) * L] for q in range(R)],
            [w2[q * L : (q + 1) * L] for q in range(R)],
            comm_sms=comm_sms,
            ring_slots=ring_slots,
            minibatch_tokens=minibatch,
            saved_h=hs,
            keep=keep,
            glu=glu,
        )
        if glu is not None:  # the forward kernel's variant against the reference's
            for r in range(R):
                err = _rel(out[r], ref[r][0])
                assert err < TOL, f"rank {r}: forward output rel err {err:.3e} ({glu.describe()})"
    gx, gw, g1, g2 = mok_backward_emulated(
        gos,
        xs,
        [i.int().contiguous() for i in idx],
        ws,
        comb,
        [w1[q * L : (q + 1) * L] for q in range(R)],
        [w2[q * L : (q + 1) * L] for q in range(R)],
        comm_sms=comm_sms,
        ring_slots=ring_slots,
        minibatch_tokens=minibatch,
        wgrad=wgrad,
        timeout_ms=4000.0,
        saved_h=hs,
        kept=keep,
        glu=glu,
    )
    torch.cuda.synchronize()
    worst = {}
    for r in range(R):
        _, _, rgx, rgw, rg1, rg2 = ref[r]
        assert gx[r].shape == (tokens[r], H) and gx[r].dtype == torch.bfloat16
        assert gw[r].shape == (tokens[r], K) and gw[r].dtype == torch.float32
        assert torch.isfinite(gx[r].float()).all() and torch.isfinite(gw[r]).all()
        errs = {
            "grad_x": _rel(gx[r], rgx),
            "grad_topk_weight": _rel(gw[r], rgw),
            "grad_w1": _rel(torch.stack(g1[r]), torch.stack(rg1)),
            "grad_w2": _rel(torch.stack(g2[r]), torch.stack(rg2)),
        }
        for k, v in errs.items():
            worst[k] = max(worst.get(k, 0.0), v)
            assert v < TOL, f"rank {r}: {k} rel err {v:.3e} (all: {errs})"
        for e in range(L):
            assert g1[r][e].dtype == torch.float32 and g1[r][e].shape == (2 * F, H)
            assert g2[r][e].dtype == torch.float32 and g2[r][e].shape == (H, F)
    log = os.environ.get("MOK_BWD_ERRLOG")
    if log:
        with open(log, "a") as f:
            f.write(
                f"R={R} kind={kind} H={H} F={F} K={K} L={L} tokens={tokens} M={minibatch} S={ring_slots} "
                f"wgrad={wgrad} chain={chain_forward} saved_h={saved_h} kept={kept}: "
                + " ".join(f"{k}={v:.3e}" for k, v in worst.items())
                + "\n"
            )
    return worst


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["random", "skewed", "empty_experts", "all_to_one"])
def test_backward_equals_reference_emulated_ep(bk, R, kind):
    _case(bk, R, kind, seed=R * 31 + len(kind))


@pytest.mark.gpu
def test_backward_minus1_holes(bk):
    # unused top-k slots (idx == -1): no gradient flows through them; tokens with no valid slot get grad_x 0
    from routings import make_topk

    g = torch.Generator().manual_seed(77)
    R, L, K = 2, 4, 4
    idx = []
    for t in (400, 333):
        i = make_topk("random", t, R * L, K, g)
        drop = torch.rand(t, K, generator=g) < 0.25
        i = torch.where(drop, torch.full_like(i, -1), i)
        i[:20] = -1
        idx.append(i)
    _case(bk, R, "minus1", tokens=[400, 333], idx_override=idx, seed=78)


@pytest.mark.gpu
def test_backward_ring_much_smaller_than_batch(bk):
    # dozens of minibatches through a 2-slot ring of 64 rows, 1 comm SM per rank
    _case(bk, 2, "skewed", tokens=[1500, 1200], comm_sms=1, ring_slots=2, minibatch=64, seed=5)


@pytest.mark.gpu
def test_backward_single_slot_odd_minibatch(bk):
    _case(bk, 2, "random", tokens=[777, 555], comm_sms=3, ring_slots=1, minibatch=200, seed=6)


@pytest.mark.gpu
@pytest.mark.parametrize("wgrad", ["grouped", "mm"])
def test_backward_library_wgrad_modes(bk, wgrad):
    _case(bk, 2, "skewed", tokens=[600, 500], wgrad=wgrad, seed=9)


@pytest.mark.gpu
def test_backward_chained_after_forward_kernel(bk):
    _case(bk, 2, "random", tokens=[640, 512], comm_sms=4, ring_slots=3, minibatch=256, seed=10, chain_forward=True)


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("kind", ["random", "empty_experts", "all_to_one"])
def test_backward_with_saved_fc1_output(bk, R, kind):
    # save instead of recompute: forward kernel writes h (buffers start as NaN: every read row must be
    # written), backward stage 1 skips the fc1 GEMM
    _case(bk, R, kind, comm_sms=2, ring_slots=2, minibatch=128, seed=40 + R, saved_h=True)


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("saved", [False, True], ids=["recompute", "saved_h"])
@pytest.mark.parametrize("kind", ["random", "empty_experts", "all_to_one"])
def test_backward_with_kept_expert_input(bk, R, saved, kind):
    # the forward keeps the layout-order x and act rows (kernel.save_expert_input); the backward pulls
    # only grad_out (and with saved h reads the forward's act), against the reference
    _case(bk, R, kind, comm_sms=2, ring_slots=2, minibatch=128, seed=60 + R, saved_h=saved, kept=True)


_GLU_VARIANTS = {"offset": (1.0, None), "clamp": (0.0, 0.5), "offset+clamp": (-0.5, 0.5)}


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("mode", ["recompute", "saved_h", "kept", "saved_h+kept"])
@pytest.mark.parametrize("variant", sorted(_GLU_VARIANTS))
def test_forward_and_backward_glu_variants(bk, R, mode, variant):
    # Megatron's clamped / offset SwiGLU (activation_func_clamp_value, glu_linear_offset) in the forward
    # epilogue and in each backward path (recompute epilogue, saved-h epilogue, act rows from h, kept act)
    from megatron_mok.activation import Glu

    offset, clamp = _GLU_VARIANTS[variant]
    glu = Glu(offset=offset, clamp=clamp)
    _case(
        bk,
        R,
        "random",
        tokens=[500, 300][:R],
        comm_sms=2,
        minibatch=128,
        seed=70 + R + len(mode) + len(variant),
        chain_forward=True,
        saved_h="saved_h" in mode,
        kept="kept" in mode,
        glu=glu,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("F", [192, 320])
def test_backward_saved_fc1_output_partial_tiles(bk, F):
    # saved h with F not a multiple of the 128-column stage-1 tile (masked columns)
    _case(bk, 2, "skewed", F=F, tokens=[500, 400], comm_sms=2, ring_slots=2, minibatch=128, seed=50 + F, saved_h=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kept", [False, True], ids=["pulled_x", "kept_x"])
def test_backward_kimi_k2_slice_saved_fc1_output(bk, kept):
    _case(
        bk,
        1,
        "random",
        L=8,
        H=7168,
        F=2048,
        K=8,
        tokens=[2048],
        comm_sms=16,
        ring_slots=3,
        minibatch=2560,
        seed=13,
        saved_h=True,
        kept=kept,
    )


@pytest.mark.gpu
def test_backward_kimi_k2_slice(bk):
    # Kimi-K2 per-GPU slice: hidden 7168, expert ffn 2048, top-8, 8 local experts, EP=1, 2048 tokens
    _case(bk, 1, "random", L=8, H=7168, F=2048, K=8, tokens=[2048], comm_sms=16, ring_slots=3, minibatch=2560, seed=12)


@pytest.mark.gpu
def test_backward_stall_times_out_and_recovers(bk):
    from megatron_mok.kernel import MokKernelError

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(3)
    R, L, H, F, K, T = 2, 4, 256, 128, 2, 300
    from routings import make_topk

    xs = [torch.randn(T, H, generator=g).to(dev, torch.bfloat16) for _ in range(R)]
    idx = [make_topk("random", T, R * L, K, g).to(dev).int().contiguous() for _ in range(R)]
    ws = [torch.rand(T, K, generator=g).to(dev) for _ in range(R)]
    comb = [torch.randn(T, K, H, generator=g).to(dev, torch.bfloat16) for _ in range(R)]
    gos = [torch.randn(T, H, generator=g).to(dev, torch.bfloat16) for _ in range(R)]
    w1 = [[(torch.randn(2 * F, H, generator=g) / H**0.5).to(dev, torch.bfloat16) for _ in range(L)] for _ in range(R)]
    w2 = [[(torch.randn(H, F, generator=g) / F**0.5).to(dev, torch.bfloat16) for _ in range(L)] for _ in range(R)]
    inputs = (gos, xs, idx, ws, comb, w1, w2)
    # ring slots >= minibatches: only the stalled slot's consumers wait (deterministic report)
    stall = dict(comm_sms=2, ring_slots=8, minibatch_tokens=128, timeout_ms=300.0, debug_stall=(1, 1))
    with pytest.raises(MokKernelError, match=r"timed out: rank 1 slot 1"):
        mok_backward_emulated(*inputs, **stall)
    # the next normal call works (state is re-zeroed per launch)
    _case(bk, 2, "random", tokens=[300, 200], seed=23)
    # lazy check (the layer's default): the call returns without a host sync, the record is read later
    from megatron_mok import kernel

    kernel.check_pending_errors(wait=True)
    gx, gw, g1, _ = mok_backward_emulated(*inputs, **stall, check="lazy")
    torch.cuda.synchronize()
    # the failed launch's outputs are NaN (the wgrad kernel poisons them, its deferred router grad and
    # grad_x sum too), so a training step stops at the gradient NaN check even before the record is read
    for r in range(R):
        assert torch.isnan(gx[r].float()).all() and torch.isnan(gw[r]).all(), f"rank {r}: grad_x / grad_w not poisoned"
        assert torch.isnan(g1[r][0]).all(), f"rank {r}: weight gradient not poisoned"
    with pytest.raises(MokKernelError, match=r"MoK backward kernel timed out: rank 1 slot 1"):
        kernel.check_pending_errors(wait=True)
    kernel.check_pending_errors(wait=True)  # reported once


@pytest.mark.gpu
def test_backward_repeatable(bk):
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(4)
    R, L, H, F, K, T = 4, 2, 512, 256, 4, 500
    from routings import make_topk

    xs = [torch.randn(T, H, generator=g).to(dev, torch.bfloat16) for _ in range(R)]
    idx = [make_topk("skewed", T, R * L, K, g).to(dev).int().contiguous() for _ in range(R)]
    ws = [torch.rand(T, K, generator=g).to(dev) for _ in range(R)]
    comb = [torch.randn(T, K, H, generator=g).to(dev, torch.bfloat16) for _ in range(R)]
    gos = [torch.randn(T, H, generator=g).to(dev, torch.bfloat16) for _ in range(R)]
    w1 = [[(torch.randn(2 * F, H, generator=g) / H**0.5).to(dev, torch.bfloat16) for _ in range(L)] for _ in range(R)]
    w2 = [[(torch.randn(H, F, generator=g) / F**0.5).to(dev, torch.bfloat16) for _ in range(L)] for _ in range(R)]
    kw = dict(comm_sms=2, ring_slots=2, minibatch_tokens=256)
    a = mok_backward_emulated(gos, xs, idx, ws, comb, w1, w2, **kw)
    b = mok_backward_emulated(gos, xs, idx, ws, comb, w1, w2, **kw)
    for r in range(R):
        assert torch.equal(a[0][r], b[0][r]) and torch.equal(a[1][r], b[1][r])
        for e in range(L):
            assert torch.equal(a[2][r][e], b[2][r][e]) and torch.equal(a[3][r][e], b[3][r][e])
