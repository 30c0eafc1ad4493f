"""GPU tests of the MoK wgrad kernel (csrc/mok/backward/wgrad.cuh) on synthetic layout-order buffers.

dW1_e = dH_e^T @ x_e and dW2_e = gy_e^T @ act_e over each expert's rows, compared with fp64 per-expert
matmuls of the same bf16 operands. The buffers' rows past the last expert are NaN, so a kernel that
lets rows past an expert's end (or the buffer's used part) into a sum fails; expert row counts that
are not multiples of 64, empty experts and tile-partial H / F are covered.
"""

from __future__ import annotations

import pytest
import torch


def _buffers(counts, H, F, cap_extra, seed):
    """One partition: tpe and layout-order buffers; rows >= sum(counts) are NaN."""
    g = torch.Generator().manual_seed(seed)
    n = sum(counts)
    cap = n + cap_extra
    dev = torch.device("cuda")

    def buf(cols):
        t = torch.full((cap, cols), float("nan"), dtype=torch.bfloat16)
        t[:n] = torch.randn(n, cols, generator=g).to(torch.bfloat16)
        return t.to(dev)

    tpe = torch.tensor(counts, dtype=torch.int32, device=dev)
    return tpe, buf(H), buf(H), buf(2 * F), buf(F)


def _expected(tpe, xl, gyl, dh, act):
    g1, g2 = [], []
    a = 0
    for c in tpe.tolist():
        b = a + c
        g1.append((dh[a:b].double().t() @ xl[a:b].double()).float())
        g2.append((gyl[a:b].double().t() @ act[a:b].double()).float())
        a = b
    return g1, g2


def _close(got, want, what):
    for e, (a, b) in enumerate(zip(got, want)):
        assert torch.isfinite(a).all(), f"{what}[{e}]: non-finite values (rows past an expert's end leaked in?)"
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * scale, msg=lambda m, e=e: f"{what}[{e}]: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("cap_extra", [0, 100])  # 0: the last expert's tail block runs past the buffer (TMA zero fill)
@pytest.mark.parametrize(
    "counts,H,F",
    [
        ([300, 0, 1, 129, 64, 1000], 512, 256),  # empty expert, single row, 64-aligned and ragged ends
        ([77, 200, 0, 513], 320, 192),  # H and F not multiples of the 256-column tile
        ([0, 0, 0], 256, 128),  # no rows at all: zeros
    ],
)
def test_wgrad_kernel_matches_fp64(bk, counts, H, F, cap_extra):
    if sum(counts) + cap_extra == 0:
        pytest.skip("empty buffers")
    parts = [_buffers(counts, H, F, cap_extra, seed=3), _buffers(counts[::-1], H, F, cap_extra, seed=4)]
    for q, p in enumerate(parts):  # two owners' buffers, one launch each
        gw1, gw2 = bk.weight_grads_kernel(*p)
        torch.cuda.synchronize()
        w1, w2 = _expected(*p)
        assert len(gw1) == len(counts) and gw1[0].dtype == torch.float32
        _close(gw1, w1, f"part {q} dW1")
        _close(gw2, w2, f"part {q} dW2")


@pytest.mark.gpu
def test_wgrad_kernel_accumulates_into_main_grad(bk):
    counts, H, F = [150, 0, 64, 333], 384, 128
    tpe, xl, gyl, dh, act = _buffers(counts, H, F, cap_extra=64, seed=5)
    L = len(counts)
    # main_grad views with a row stride larger than the row (Megatron buffers are views of one big buffer)
    big1 = torch.randn(L, 2 * F, H + 64, device="cuda")
    big2 = torch.randn(L, H, F + 32, device="cuda")
    mg1 = [big1[e, :, :H] for e in range(L)]
    mg2 = [big2[e, :, :F] for e in range(L)]
    before1 = [m.clone() for m in mg1]
    before2 = [m.clone() for m in mg2]
    pad1, pad2 = big1[:, :, H:].clone(), big2[:, :, F:].clone()
    gw1, gw2 = bk.weight_grads_kernel(tpe, xl, gyl, dh, act, main_grad_w1=mg1, main_grad_w2=mg2)
    torch.cuda.synchronize()
    assert gw1[0].data_ptr() == mg1[0].data_ptr()
    w1, w2 = _expected(tpe, xl, gyl, dh, act)
    _close(mg1, [b + w for b, w in zip(before1, w1)], "main_grad dW1")
    _close(mg2, [b + w for b, w in zip(before2, w2)], "main_grad dW2")
    assert torch.equal(big1[:, :, H:], pad1) and torch.equal(big2[:, :, F:], pad2), "wrote outside the views"


@pytest.mark.gpu
def test_wgrad_kernel_rejects_counts_past_the_buffer(bk):
    from megatron_mok.kernel import errors
    from megatron_mok.kernel.errors import MokKernelError

    tpe, xl, gyl, dh, act = _buffers([100, 50], 256, 128, cap_extra=0, seed=6)
    tpe[1] = 10_000  # as if the dgrad launch had not finished: more rows than the buffers hold
    err = torch.zeros(16, dtype=torch.int32, device="cuda")
    bk.weight_grads_kernel(tpe, xl, gyl, dh, act, err=err)
    torch.cuda.synchronize()
    code, part, expert, phase = err[:4].tolist()
    assert (code, part, expert, phase) == (4, 0, 1, 11), err.tolist()  # kErrBadShape, kPhaseWgrad
    # read as every launch's record is read: the message names the wgrad
    with pytest.raises(MokKernelError, match="wgrad"):
        errors.after_launch(err, torch.cuda.current_stream(), True, errors.backward_message(1, 2, 10000.0))


@pytest.mark.gpu
def test_wgrad_kernel_bad_inputs_are_clear_errors(bk):
    tpe, xl, gyl, dh, act = _buffers([10], 256, 128, cap_extra=0, seed=7)
    with pytest.raises(ValueError, match=r"mok.wgrad: act must be a 2-D BFloat16 tensor"):
        bk.weight_grads_kernel(tpe, xl, gyl, dh, act.float())
    with pytest.raises(ValueError, match="give both main_grad_w1 and main_grad_w2"):
        bk.weight_grads_kernel(tpe, xl, gyl, dh, act, main_grad_w1=[torch.zeros(256, 256, device="cuda")])
    mg1 = [torch.zeros(256, 256, device="cuda")]  # dW1 is [2F, H] = [256, 256]: right
    with pytest.raises(ValueError, match=r"grad_w2\[0\] must be Float \[256, 128\]"):
        bk.weight_grads_kernel(
            tpe, xl, gyl, dh, act, main_grad_w1=mg1, main_grad_w2=[torch.zeros(128, 256, device="cuda")]
        )
    with pytest.raises(ValueError, match=r"grad_w2\[0\] must be a 2-D Float tensor .*got BFloat16"):
        bk.weight_grads_kernel(
            tpe, xl, gyl, dh, act, main_grad_w1=mg1, main_grad_w2=[torch.zeros(256, 128, device="cuda").bfloat16()]
        )


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", [False, True])
def test_wgrad_after_a_failed_dgrad_launch_poisons_every_output(bk, accumulate):
    """The preceding dgrad launch recorded an error (its buffers are garbage): every weight gradient,
    main_grad included, becomes NaN so a training step cannot apply it, whenever the record is read."""
    counts, H, F = [40, 0, 90], 256, 128
    tpe, xl, gyl, dh, act = _buffers(counts, H, F, cap_extra=0, seed=8)
    err = torch.zeros(16, dtype=torch.int32, device="cuda")
    err[0] = 1  # as a timed-out dgrad launch leaves it
    kw = {}
    if accumulate:
        kw = dict(
            main_grad_w1=[torch.zeros(2 * F, H, device="cuda") for _ in counts],
            main_grad_w2=[torch.zeros(H, F, device="cuda") for _ in counts],
        )
    gw1, gw2 = bk.weight_grads_kernel(tpe, xl, gyl, dh, act, err=err, **kw)
    torch.cuda.synchronize()
    for g in (*gw1, *gw2):
        assert torch.isnan(g).all()
    assert err[0].item() == 1  # the cause stays recorded
