"""GPU tests of per-rank launches (the real-EP code path) of the MoK forward and backward kernels.

On one GPU: R ranks, each with its own PeerBuffers region, its own launch on its own stream and its
own SM share; ranks meet only through signal pads and read/write peers only through peer pointers,
exactly as over torch symmetric memory on R GPUs. Checked against the emulated launch (same device
code, all ranks in one launch) and the fp32 ground truth; several calls in a row exercise the epochs
and buffer reuse. A rank that never launches, or one with another token count, is a clear error.

On >= 2 GPUs (skipped otherwise): the same over torch symmetric memory, one process per GPU.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from emulated import kept_rows, mok_backward_emulated, mok_forward_emulated  # noqa: E402
from mok_truth import ground_truth, make_experts, make_routing, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu

TOL = 1e-2


def _check_forward(bufs, stream, L, timeout_ms):
    """Wait for the rank's last forward launch; MokKernelError if it recorded an error."""
    from megatron_mok.kernel import errors

    errors.after_launch(bufs.err, stream, True, errors.forward_message(bufs.world, L, timeout_ms))


def _check_backward(bufs, stream, L, timeout_ms):
    """Wait for the rank's last backward launch; MokKernelError if it recorded an error."""
    from megatron_mok.kernel import errors

    errors.after_launch(bufs.bwd_err, stream, True, errors.backward_message(bufs.world, L, timeout_ms))


def _inputs(R, L, H, F, K, T, mode, seed):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    x = [torch.randn((T, H), generator=gen, device=dev).bfloat16() for _ in range(R)]
    idx, wts = zip(*[make_routing(T, K, R * L, mode, dev, gen) for _ in range(R)])
    w1, w2 = make_experts(R, L, H, F, dev, gen)
    return x, list(idx), list(wts), w1, w2


def _launch_all(bufs, x, idx, wts, w1, w2, streams, ranks=None, saved_h=None, fp8=None, keep=None, **kw):
    from megatron_mok.kernel import mok_forward

    R = len(bufs)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {}
    for r in ranks if ranks is not None else range(R):
        streams[r].wait_stream(torch.cuda.current_stream())
        res[r] = mok_forward(
            bufs[r],
            x[r],
            idx[r],
            wts[r],
            w1[r],
            w2[r],
            ctas=sms // R,
            stream=streams[r],
            check=False,
            saved_h=None if saved_h is None else saved_h[r],
            fp8=None if fp8 is None else fp8[r],
            keep=None if keep is None else keep[r],
            **kw,
        )
    return res


@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("mode", ["uniform", "skewed", "minus1", "one"])
@pytest.mark.parametrize("comm", [2, 0], ids=["comm2", "insm"])
def test_rank_launches_match_emulated_and_truth(kernel, R, mode, comm):
    from megatron_mok.kernel import PeerBuffers

    L, H, F, K, T = 4, 512, 256, 4, 700
    cfg = dict(comm_sms=comm, ring_slots=2, minibatch_tokens=256)  # ring smaller than the batch
    bufs = PeerBuffers.on_one_gpu(R, T + 100, H, K)
    streams = [torch.cuda.Stream() for _ in range(R)]
    for call in range(3):  # epochs 1..3: buffers and signal pads are reused without re-zeroing
        x, idx, wts, w1, w2 = _inputs(R, L, H, F, K, T, mode, seed=100 * R + call)
        res = _launch_all(bufs, x, idx, wts, w1, w2, streams, timeout_ms=5000.0, **cfg)
        for r in range(R):
            _check_forward(bufs[r], streams[r], L, 5000.0)
        torch.cuda.synchronize()
        emu_out, emu_comb, emu_tpe = mok_forward_emulated(x, idx, wts, w1, w2, **cfg, timeout_ms=5000.0)
        ref_out, ref_comb, ref_tpe = ground_truth(x, idx, wts, w1, w2)
        for r in range(R):
            out, comb, tpe = res[r]
            assert torch.equal(tpe, emu_tpe[r]) and torch.equal(tpe, ref_tpe[r]), (r, tpe, ref_tpe[r])
            # same device code and tile order as the emulated launch: identical bits
            assert torch.equal(comb, emu_comb[r]), f"rank {r} combine differs from emulated EP"
            assert torch.equal(out, emu_out[r]), f"rank {r} out differs from emulated EP"
            assert rel_err(out, ref_out[r]) < TOL and rel_err(comb, ref_comb[r]) < TOL
            assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("R", [1, 2, 4])
def test_fp8_rank_launches_match_emulated(kernel, R):
    """The FP8 kernel per rank (each rank passes its own experts' e4m3 weights): the emulated FP8
    launch's bits, twice in a row."""
    from megatron_mok.kernel import PeerBuffers
    from megatron_mok.kernel.quant import quantize_expert_weights

    L, H, F, K, T = 4, 512, 256, 4, 700
    cfg = dict(comm_sms=2, ring_slots=2, minibatch_tokens=256)
    bufs = PeerBuffers.on_one_gpu(R, T + 100, H, K)
    streams = [torch.cuda.Stream() for _ in range(R)]
    for call in range(2):
        x, idx, wts, w1, w2 = _inputs(R, L, H, F, K, T, "skewed", seed=300 + 10 * R + call)
        q8 = quantize_expert_weights(w1, w2)
        per_rank = [quantize_expert_weights([w1[r]], [w2[r]]) for r in range(R)]  # each rank's own experts
        res = _launch_all(bufs, x, idx, wts, w1, w2, streams, timeout_ms=5000.0, fp8=per_rank, **cfg)
        for r in range(R):
            _check_forward(bufs[r], streams[r], L, 5000.0)
        torch.cuda.synchronize()
        emu_out, emu_comb, emu_tpe = mok_forward_emulated(x, idx, wts, w1, w2, **cfg, fp8=q8)
        for r in range(R):
            out, comb, tpe = res[r]
            assert torch.equal(tpe, emu_tpe[r])
            assert torch.equal(comb, emu_comb[r]), f"rank {r}: fp8 combine differs from the emulated launch"
            assert torch.equal(out, emu_out[r]), f"rank {r}: fp8 out differs from the emulated launch"


def test_missing_rank_times_out_naming_it(kernel):
    from megatron_mok.kernel import MokKernelError, PeerBuffers

    R, L, H, F, K, T = 2, 2, 256, 128, 2, 128
    bufs = PeerBuffers.on_one_gpu(R, T, H, K)
    streams = [torch.cuda.Stream() for _ in range(R)]
    x, idx, wts, w1, w2 = _inputs(R, L, H, F, K, T, "uniform", seed=7)
    _launch_all(
        bufs, x, idx, wts, w1, w2, streams, ranks=[0], comm_sms=1, ring_slots=2, minibatch_tokens=128, timeout_ms=300.0
    )
    with pytest.raises(MokKernelError, match=r"rank 0 waiting for peer start signal.*rank 1 did not signal call 1"):
        _check_forward(bufs[0], streams[0], L, 300.0)


def test_token_count_mismatch_is_an_error(kernel):
    from megatron_mok.kernel import MokKernelError, PeerBuffers

    R, L, H, F, K = 2, 2, 256, 128, 2
    bufs = PeerBuffers.on_one_gpu(R, 256, H, K)
    streams = [torch.cuda.Stream() for _ in range(R)]
    x0, idx0, w0, w1, w2 = _inputs(R, L, H, F, K, 128, "uniform", seed=8)
    x1, idx1, wt1, _, _ = _inputs(R, L, H, F, K, 96, "uniform", seed=9)
    x, idx, wts = [x0[0], x1[1]], [idx0[0], idx1[1]], [w0[0], wt1[1]]
    _launch_all(bufs, x, idx, wts, w1, w2, streams, comm_sms=1, ring_slots=2, minibatch_tokens=128, timeout_ms=500.0)
    errors = []
    for r in range(R):
        try:
            _check_forward(bufs[r], streams[r], L, 500.0)
        except MokKernelError as exc:
            errors.append(str(exc))
    assert errors and all("same number of tokens" in e for e in errors), errors


def test_bad_inputs_are_clear_errors(kernel):
    from megatron_mok.kernel import PeerBuffers, mok_forward

    bufs = PeerBuffers.on_one_gpu(2, 64, 256, 2)
    dev = torch.device("cuda")
    w1 = [torch.zeros((256, 256), dtype=torch.bfloat16, device=dev)]
    w2 = [torch.zeros((256, 128), dtype=torch.bfloat16, device=dev)]
    x = torch.zeros((65, 256), dtype=torch.bfloat16, device=dev)
    idx = torch.zeros((65, 2), dtype=torch.int32, device=dev)
    w = torch.ones((65, 2), dtype=torch.float32, device=dev)
    with pytest.raises(ValueError, match="exceed the peer buffers' capacity"):
        mok_forward(bufs[0], x, idx, w, w1, w2, comm_sms=1, ring_slots=2, minibatch_tokens=64)
    with pytest.raises(ValueError, match="the peer buffers were built for H=256"):
        mok_forward(
            bufs[0], x[:8, :128].contiguous(), idx[:8], w[:8], w1, w2, comm_sms=1, ring_slots=2, minibatch_tokens=64
        )


def _backward_all(bufs, go, x, idx, wts, comb, w1, w2, streams, ranks=None, saved_h=None, wgrad="kernel", **kw):
    """Launch every rank's backward first (each waits for its peers inside the kernel), then the weight
    gradients (the emulated backward's default mode, so results compare bit for bit; the "mm" mode reads
    row counts on the host, which would block the next rank's launch)."""
    from megatron_mok.kernel import mok_backward
    from megatron_mok.kernel.backward import weight_grads

    R = len(bufs)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {}
    for r in ranks if ranks is not None else range(R):
        streams[r].wait_stream(torch.cuda.current_stream())
        res[r] = mok_backward(
            bufs[r],
            go[r],
            x[r],
            idx[r],
            wts[r],
            comb[r],
            w1[r],
            w2[r],
            saved_h=None if saved_h is None else saved_h[r],
            ctas=sms // R,
            stream=streams[r],
            check=False,
            wgrad="none",
            return_buffers=True,
            **kw,
        )
    out = {}
    for r, (gx, gw, _, _, b) in res.items():
        g1 = g2 = None
        if wgrad != "none":
            with torch.cuda.stream(streams[r]):
                g1, g2 = weight_grads(b["tpe"], b["xl"], b["gyl"], b["dh"], b["act"], mode=wgrad)
        out[r] = (gx, gw, g1, g2)
    return out


def _assert_same_backward(res, ref, R, L):
    """Per-rank backward results res[r] = (grad_x, grad_w, dW1 list, dW2 list) equal the emulated
    backward's ref bit for bit."""
    for r in range(R):
        gx, gw, g1, g2 = res[r]
        assert torch.equal(gx, ref[0][r]), f"rank {r} grad_x differs from emulated EP"
        assert torch.equal(gw, ref[1][r]), f"rank {r} grad_topk_weight differs"
        for e in range(L):
            assert torch.equal(g1[e], ref[2][r][e]) and torch.equal(g2[e], ref[3][r][e]), (r, e)
        assert torch.isfinite(gx.float()).all()


@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("mode", ["uniform", "skewed", "minus1"])
@pytest.mark.parametrize("saved", [False, True], ids=["recompute", "saved_h"])
def test_backward_rank_launches_match_emulated(kernel, R, mode, saved):
    """Per-rank backward launches (separate streams, peers met on signal pads, forward and backward
    calls alternating on the same buffers and epochs) give the emulated backward's bits."""
    from megatron_mok.kernel import PeerBuffers

    L, H, F, K, T = 4, 512, 256, 4, 600
    cfg = dict(comm_sms=2, ring_slots=2, minibatch_tokens=256, timeout_ms=5000.0)
    bufs = PeerBuffers.on_one_gpu(R, T + 40, H, K)
    streams = [torch.cuda.Stream() for _ in range(R)]
    dev = torch.device("cuda")
    for call in range(2):
        x, idx, wts, w1, w2 = _inputs(R, L, H, F, K, T, mode, seed=300 * R + call)
        gen = torch.Generator(device=dev).manual_seed(7 + call)
        go = [torch.randn((T, H), generator=gen, device=dev).bfloat16() for _ in range(R)]

        def hbufs():
            return [torch.empty((R * T * K, 2 * F), dtype=torch.bfloat16, device=dev) for _ in range(R)]

        h_rank, h_emu = (hbufs(), hbufs()) if saved else (None, None)
        # forward per rank (epochs advance on the same pads; h kept per owner), then keep the combine rows
        fwd = _launch_all(bufs, x, idx, wts, w1, w2, streams, saved_h=h_rank, **cfg)
        torch.cuda.synchronize()
        comb = [fwd[r][1].clone() for r in range(R)]
        if saved:  # the emulated forward's h, for the emulated backward below
            mok_forward_emulated(x, idx, wts, w1, w2, saved_h=h_emu, **cfg)
        res = _backward_all(bufs, go, x, idx, wts, comb, w1, w2, streams, saved_h=h_rank, **cfg)
        for r in range(R):
            _check_backward(bufs[r], streams[r], L, 5000.0)
        torch.cuda.synchronize()
        ref = mok_backward_emulated(go, x, idx, wts, comb, w1, w2, saved_h=h_emu, **cfg)
        _assert_same_backward(res, ref, R, L)


def test_backward_missing_rank_times_out_naming_it(kernel):
    from megatron_mok.kernel import MokKernelError, PeerBuffers

    R, L, H, F, K, T = 2, 2, 256, 128, 2, 128
    bufs = PeerBuffers.on_one_gpu(R, T, H, K)
    streams = [torch.cuda.Stream() for _ in range(R)]
    x, idx, wts, w1, w2 = _inputs(R, L, H, F, K, T, "uniform", seed=17)
    comb = [torch.zeros((T, K, H), dtype=torch.bfloat16, device="cuda") for _ in range(R)]
    cfg = dict(comm_sms=1, ring_slots=2, minibatch_tokens=128, timeout_ms=300.0)
    _backward_all(bufs, x, x, idx, wts, comb, w1, w2, streams, ranks=[0], wgrad="none", **cfg)
    with pytest.raises(MokKernelError, match=r"rank 0 waiting for peer start signal.*rank 1 did not signal call 1"):
        _check_backward(bufs[0], streams[0], L, 300.0)


def test_backward_rank_bad_inputs_are_clear_errors(kernel):
    from megatron_mok.kernel import PeerBuffers, mok_backward

    bufs = PeerBuffers.on_one_gpu(2, 64, 256, 2)
    dev = torch.device("cuda")
    w1 = [torch.zeros((256, 256), dtype=torch.bfloat16, device=dev)]
    w2 = [torch.zeros((256, 128), dtype=torch.bfloat16, device=dev)]
    T = 32
    x = torch.zeros((T, 256), dtype=torch.bfloat16, device=dev)
    idx = torch.zeros((T, 2), dtype=torch.int32, device=dev)
    w = torch.ones((T, 2), dtype=torch.float32, device=dev)
    comb = torch.zeros((T, 2, 256), dtype=torch.bfloat16, device=dev)
    kw = dict(comm_sms=1, ring_slots=2, minibatch_tokens=64)
    with pytest.raises(ValueError, match=r"mok_backward: grad_out must be \[32, 256\] .*got \[8, 256\]"):
        mok_backward(bufs[0], x[:8], x, idx, w, comb, w1, w2, **kw)
    with pytest.raises(ValueError, match="saved_h must be"):
        mok_backward(
            bufs[0],
            x,
            x,
            idx,
            w,
            comb,
            w1,
            w2,
            saved_h=torch.zeros((10, 256), **dict(dtype=torch.bfloat16, device=dev)),
            **kw,
        )
    x2 = torch.zeros((65, 256), dtype=torch.bfloat16, device=dev)
    with pytest.raises(ValueError, match="exceed the peer buffers' capacity"):
        mok_backward(bufs[0], x2, x2, idx, w, comb, w1, w2, **kw)


def test_owner_capacity_overflow_is_reported_by_every_rank(kernel):
    """Owner-side row buffers smaller than the routing needs (kernel.owner_capacity_factor): every rank's
    forward and backward report the overflowing owner and both counts; nothing waits or writes past."""
    from megatron_mok.kernel import MokKernelError, PeerBuffers

    R, L, H, F, K, T = 2, 2, 256, 128, 2, 128
    bufs = PeerBuffers.on_one_gpu(R, T, H, K)
    streams = [torch.cuda.Stream() for _ in range(R)]
    x, idx, wts, w1, w2 = _inputs(R, L, H, F, K, T, "one", seed=21)  # every slot -> expert 2 (rank 1)
    cap = T * K  # factor 1.0; rank 1 is sent R * T * K rows
    dev = torch.device("cuda")
    # a guard row past the capacity: the kernel must not write it
    hs = [torch.full((cap + 1, 2 * F), 7.0, dtype=torch.bfloat16, device=dev) for _ in range(R)]
    views = [h[:cap] for h in hs]
    cfg = dict(comm_sms=1, ring_slots=2, minibatch_tokens=128, timeout_ms=2000.0)
    _launch_all(bufs, x, idx, wts, w1, w2, streams, saved_h=views, **cfg)
    want = rf"sends {R * T * K} rows to rank 1, but its owner-side row buffers hold {cap}"
    for r in range(R):
        with pytest.raises(MokKernelError, match=want):
            _check_forward(bufs[r], streams[r], L, 2000.0)
    torch.cuda.synchronize()
    assert all(bool((h[cap:] == 7.0).all()) for h in hs), "wrote past the owner capacity"
    comb = [torch.zeros((T, K, H), dtype=torch.bfloat16, device=dev) for _ in range(R)]
    _backward_all(bufs, x, x, idx, wts, comb, w1, w2, streams, wgrad="none", owner_rows=cap, **cfg)
    for r in range(R):
        with pytest.raises(MokKernelError, match=want):
            _check_backward(bufs[r], streams[r], L, 2000.0)


def test_owner_capacity_factor_that_fits_gives_the_same_bits(kernel):
    """Row buffers of 1.5 x the fair share instead of the worst case: same results as the emulated run."""
    from megatron_mok.kernel import PeerBuffers

    R, L, H, F, K, T = 4, 2, 256, 128, 4, 512
    cap = int(1.5 * T * K)
    bufs = PeerBuffers.on_one_gpu(R, T, H, K)
    streams = [torch.cuda.Stream() for _ in range(R)]
    dev = torch.device("cuda")
    x, idx, wts, w1, w2 = _inputs(R, L, H, F, K, T, "uniform", seed=22)
    go = [torch.randn((T, H), device=dev).bfloat16() for _ in range(R)]
    cfg = dict(comm_sms=2, ring_slots=2, minibatch_tokens=256, timeout_ms=5000.0)
    hs = [torch.empty((cap, 2 * F), dtype=torch.bfloat16, device=dev) for _ in range(R)]
    fwd = _launch_all(bufs, x, idx, wts, w1, w2, streams, saved_h=hs, **cfg)
    for r in range(R):
        _check_forward(bufs[r], streams[r], L, 5000.0)
    torch.cuda.synchronize()
    comb = [fwd[r][1].clone() for r in range(R)]
    h_emu = [torch.empty((R * T * K, 2 * F), dtype=torch.bfloat16, device=dev) for _ in range(R)]
    emu_out, _, _ = mok_forward_emulated(x, idx, wts, w1, w2, saved_h=h_emu, **cfg)
    for r in range(R):
        assert torch.equal(fwd[r][0], emu_out[r]), f"rank {r} forward differs with a capacity factor"
    res = _backward_all(bufs, go, x, idx, wts, comb, w1, w2, streams, saved_h=hs, owner_rows=cap, **cfg)
    for r in range(R):
        _check_backward(bufs[r], streams[r], L, 5000.0)
    torch.cuda.synchronize()
    ref = mok_backward_emulated(go, x, idx, wts, comb, w1, w2, saved_h=h_emu, **cfg)
    for r in range(R):
        gx, gw, g1, g2 = res[r]
        assert torch.equal(gx, ref[0][r]) and torch.equal(gw, ref[1][r]), f"rank {r} input / router grads differ"
        for e in range(L):
            torch.testing.assert_close(g1[e], ref[2][r][e], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(g2[e], ref[3][r][e], rtol=1e-5, atol=1e-5)


def mok_forward_emulated_all(x, idx, wts, w1, w2):

    return mok_forward_emulated(x, idx, wts, w1, w2, comm_sms=4, ring_slots=2, minibatch_tokens=256)


def _symm_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from megatron_mok.kernel import PeerBuffers, mok_backward, mok_forward

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        L, H, F, K, T = 4, 512, 256, 4, 600
        # same seed on every rank: every process builds all ranks' tensors, identically, on its GPU
        x, idx, wts, w1, w2 = _inputs(world, L, H, F, K, T, "uniform", seed=11)
        bufs = PeerBuffers.symmetric(dist.group.WORLD, T, H, K)
        for _ in range(3):
            out, comb, tpe = mok_forward(
                bufs, x[rank], idx[rank], wts[rank], w1[rank], w2[rank], comm_sms=4, ring_slots=2, minibatch_tokens=256
            )
        ref_out, ref_comb, ref_tpe = ground_truth(x, idx, wts, w1, w2)
        err = max(rel_err(out, ref_out[rank]), rel_err(comb, ref_comb[rank]))
        ok = bool(torch.equal(tpe, ref_tpe[rank])) and err < TOL
        # backward per rank vs the R ranks on this GPU (identical bits expected)
        gen = torch.Generator(device="cuda").manual_seed(5)
        go = [torch.randn((T, H), generator=gen, device="cuda").bfloat16() for _ in range(world)]
        _, emu_comb, _ = mok_forward_emulated_all(x, idx, wts, w1, w2)
        kw = dict(comm_sms=4, ring_slots=2, minibatch_tokens=256)
        gx, gw, g1, g2 = mok_backward(
            bufs, go[rank], x[rank], idx[rank], wts[rank], emu_comb[rank].clone(), w1[rank], w2[rank], **kw
        )
        ref = mok_backward_emulated(go, x, idx, wts, [c.clone() for c in emu_comb], w1, w2, **kw)
        ok = ok and torch.equal(gx, ref[0][rank]) and torch.equal(gw, ref[1][rank])
        ok = ok and all(torch.equal(a, b) for a, b in zip(g1, ref[2][rank]))
        with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
            f.write(f"{int(ok)} {err}")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 GPUs (real EP over torch symmetric memory)")
def test_symmetric_memory_multi_gpu(kernel, tmp_path):
    import socket

    import torch.multiprocessing as mp

    world = min(torch.cuda.device_count(), 8)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_symm_worker, args=(world, port, str(tmp_path)), nprocs=world)
    for r in range(world):
        ok, err = (tmp_path / f"rank{r}").read_text().split()
        assert ok == "1", f"rank {r}: rel err {err}"


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize(
    "variant", ["bf16_recompute", "bf16_saved_h", "fp8_saved_h", "bf16_recompute_kept", "bf16_saved_h_kept"]
)
def test_backward_rank_launches_with_wgrad_kernel_match_emulated(kernel, R, variant):
    """Per-rank backward with the wgrad kernel inside the call (the layer's default): each rank's dgrad
    leaves its router grad and grad_x sum to its wgrad launch (defer_home), after it met every peer's
    pushes; FP8 dgrad per rank with each rank's own transposed e4m3 weights; "kept": each rank's forward
    keeps its x / act rows (KeptRows) and its backward pulls only grad_out. Same bits as emulated EP."""
    from megatron_mok.kernel import PeerBuffers, mok_backward
    from megatron_mok.kernel.quant import quantize_expert_weights

    fp8, saved, kept = variant.startswith("fp8"), "saved_h" in variant, variant.endswith("kept")
    L, H, F, K, T = 3, 512, 384, 4, 400
    cfg = dict(comm_sms=2, ring_slots=2, minibatch_tokens=256, timeout_ms=5000.0)
    bufs = PeerBuffers.on_one_gpu(R, T, H, K)
    streams = [torch.cuda.Stream() for _ in range(R)]
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x, idx, wts, w1, w2 = _inputs(R, L, H, F, K, T, "minus1", seed=40 + R)
    go = [torch.randn((T, H), device=dev).bfloat16() for _ in range(R)]
    q8 = quantize_expert_weights(w1, w2, transposed=True) if fp8 else None
    per_rank = [quantize_expert_weights([w1[r]], [w2[r]], transposed=True) for r in range(R)] if fp8 else [None] * R

    def hbufs():
        return [torch.empty((R * T * K, 2 * F), dtype=torch.bfloat16, device=dev) for _ in range(R)] if saved else None

    h_rank, h_emu = hbufs(), hbufs()
    M = cfg["minibatch_tokens"]
    k_rank = [kept_rows(1, R * T * K, H, F, M, dev).parts[0] for _ in range(R)] if kept else None
    k_emu = kept_rows(R, R * T * K, H, F, M, dev) if kept else None
    fwd = _launch_all(
        bufs, x, idx, wts, w1, w2, streams, saved_h=h_rank, fp8=per_rank if fp8 else None, keep=k_rank, **cfg
    )
    for r in range(R):
        _check_forward(bufs[r], streams[r], L, 5000.0)
    torch.cuda.synchronize()
    comb = [fwd[r][1].clone() for r in range(R)]
    mok_forward_emulated(x, idx, wts, w1, w2, saved_h=h_emu, fp8=q8, keep=k_emu, **cfg)  # emulated h / kept
    res = {}
    for r in range(R):
        streams[r].wait_stream(torch.cuda.current_stream())
        res[r] = mok_backward(
            bufs[r], go[r], x[r], idx[r], wts[r], comb[r], w1[r], w2[r],
            saved_h=None if h_rank is None else h_rank[r], ctas=sms // R, stream=streams[r], check=False,
            wgrad="kernel", fp8=per_rank[r], kept=None if k_rank is None else k_rank[r], **cfg,
        )  # fmt: skip
    for r in range(R):
        _check_backward(bufs[r], streams[r], L, 5000.0)
    torch.cuda.synchronize()
    ref = mok_backward_emulated(go, x, idx, wts, comb, w1, w2, saved_h=h_emu, fp8=q8, kept=k_emu, **cfg)
    _assert_same_backward(res, ref, R, L)
