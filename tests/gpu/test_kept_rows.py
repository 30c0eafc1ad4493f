"""GPU tests of the forward's kept expert input / SwiGLU rows (``KeptRows``, config
kernel.save_expert_input) against the path that pulls x a second time in the backward.

Keeping replaces the forward's ring by the caller's layout-order buffers: the forward's outputs must not
change by a bit, the kept x rows must be exactly the rows the backward would pull, and the backward's
gradients must be the pulled path's bits (x rows are the same bytes). With saved h the kept act is the
forward's own SwiGLU output (from the fp32 fc1 accumulators) where the pulled path recomputes it from
the bf16 h, so dW2 may differ in the last bits (bounded here) while every other gradient is bitwise equal.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from emulated import kept_rows, mok_backward_emulated, mok_forward_emulated  # noqa: E402
from mok_truth import make_backward_case, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("saved", [False, True], ids=["recompute", "saved_h"])
@pytest.mark.parametrize("mode", ["uniform", "skewed", "minus1"])
@pytest.mark.parametrize("comm", [2, 0], ids=["comm2", "insm"])
def test_kept_rows_give_the_pulled_paths_bits(kernel, bk, R, saved, mode, comm):

    L, H, F, K = 3, 512, 384, 4
    Ts = [333 + 41 * r for r in range(R)]
    cfg = dict(comm_sms=comm, ring_slots=2, minibatch_tokens=192)
    bwd_cfg = dict(cfg, comm_sms=2)  # the backward keeps dedicated comm SMs
    x, idx, wts, w1, w2, go = make_backward_case(R, L, H, F, K, Ts, mode, seed=90 + R)
    rows = sum(Ts) * K
    dev = x[0].device

    def hbufs():
        return [torch.full((rows, 2 * F), float("nan"), dtype=torch.bfloat16, device=dev) for _ in range(R)]

    h_a, h_b = (hbufs(), hbufs()) if saved else (None, None)
    out_a, comb_a, tpe_a = mok_forward_emulated(x, idx, wts, w1, w2, saved_h=h_a, **cfg)
    keep = kept_rows(R, rows, H, F, cfg["minibatch_tokens"], dev)
    keep.x.fill_(float("nan"))
    keep.act.fill_(float("nan"))
    out_b, comb_b, tpe_b = mok_forward_emulated(x, idx, wts, w1, w2, saved_h=h_b, keep=keep, **cfg)
    torch.cuda.synchronize()
    for r in range(R):  # the forward does not change by a bit
        assert torch.equal(out_a[r], out_b[r]) and torch.equal(comb_a[r], comb_b[r]), f"rank {r} forward differs"
        assert torch.equal(tpe_a[r], tpe_b[r])
        if saved:
            assert torch.equal(h_a[r].nan_to_num(7.0), h_b[r].nan_to_num(7.0)), f"owner {r} saved h differs"

    ref = mok_backward_emulated(go, x, idx, wts, comb_a, w1, w2, saved_h=h_a, return_buffers=True, **bwd_cfg)
    got = mok_backward_emulated(go, x, idx, wts, comb_b, w1, w2, saved_h=h_b, kept=keep, return_buffers=True, **bwd_cfg)
    torch.cuda.synchronize()
    bufs_a = ref[4]
    for q in range(R):
        n = int(tpe_a[q].sum())
        # kept x rows are the rows the backward pulls (layout order), every one written
        assert torch.equal(keep.x[q, :n], bufs_a["xl"][q][:n]), f"owner {q}: kept x rows differ from the pulled ones"
        act = keep.act[q, :n]
        assert torch.isfinite(act.float()).all(), f"owner {q}: a kept act row was not written"
        if saved:  # forward's act (fp32 accumulators) vs recomputed from bf16 h: rounding apart
            assert rel_err(act, bufs_a["act"][q][:n]) < 1e-2
        else:  # both from fp32 accumulators of the same tiles
            assert rel_err(act, bufs_a["act"][q][:n]) < 1e-3
    for r in range(R):
        assert torch.equal(got[0][r], ref[0][r]), f"rank {r} grad_x differs"
        assert torch.equal(got[1][r], ref[1][r]), f"rank {r} grad_topk_weight differs"
    for q in range(R):
        for e in range(L):
            assert torch.equal(got[2][q][e], ref[2][q][e]), f"owner {q} expert {e}: dW1 differs"
            if saved:
                assert rel_err(got[3][q][e], ref[3][q][e]) < 1e-2, f"owner {q} expert {e}: dW2"
            else:
                assert torch.equal(got[3][q][e], ref[3][q][e]), f"owner {q} expert {e}: dW2 differs"


def test_kept_rows_bad_inputs_are_clear_errors(kernel, bk):
    from megatron_mok.kernel import MokKernelError
    from megatron_mok.kernel.quant import quantize_expert_weights

    R, L, H, F, K = 2, 2, 256, 128, 2
    Ts = [100, 90]
    cfg = dict(comm_sms=2, ring_slots=2, minibatch_tokens=128)
    x, idx, wts, w1, w2, go = make_backward_case(R, L, H, F, K, Ts, "uniform", seed=5)
    dev = x[0].device
    rows = sum(Ts) * K
    with pytest.raises(MokKernelError, match="owner-side row buffers hold 128"):
        mok_forward_emulated(x, idx, wts, w1, w2, keep=kept_rows(R, 128, H, F, 128, dev), **cfg)
    with pytest.raises(ValueError, match="allocated for minibatch 64"):
        mok_forward_emulated(x, idx, wts, w1, w2, keep=kept_rows(R, rows, H, F, 64, dev), **cfg)
    with pytest.raises(ValueError, match=r"keep_x must be BFloat16 \[384, 256\]"):
        mok_forward_emulated(x, idx, wts, w1, w2, keep=kept_rows(R, rows, H + 64, F, 128, dev), **cfg)
    with pytest.raises(ValueError, match="FP8 kernel keeps none"):
        q8 = quantize_expert_weights(w1, w2)
        mok_forward_emulated(x, idx, wts, w1, w2, fp8=q8, keep=kept_rows(R, rows, H, F, 128, dev), **cfg)
    keep = kept_rows(R, rows, H, F, 128, dev)
    _, comb, _ = mok_forward_emulated(x, idx, wts, w1, w2, keep=keep, **cfg)
    with pytest.raises(ValueError, match=r"kept rows are \(384, 256\) / \(384, 128\), the backward needs \[>= 760"):
        xx = [torch.cat([t, t]) for t in x]
        ii = [torch.cat([t, t]) for t in idx]
        ww = [torch.cat([t, t]) for t in wts]
        cc = [torch.cat([t, t]) for t in comb]
        gg = [torch.cat([t, t]) for t in go]
        mok_backward_emulated(gg, xx, ii, ww, cc, w1, w2, kept=keep, **cfg)
