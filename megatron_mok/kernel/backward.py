"""The backward megakernel: one rank's launch of the fused MoE backward (``mok::backward``), then the wgrad kernel
(``mok::wgrad``) on the same stream, no host sync.

* The backward launch (``csrc/mok/host/backward.cu``) mirrors the forward: the schedule (the forward's layout,
  recomputed from the routing), the pull reverse-combine (x rows and ``w * grad_out`` rows pulled from the home ranks
  into layout order), the dgrad GEMMs (stage 1: fc1 recompute or the saved h, fc2 dgrad, SwiGLU backward -> dH, act;
  stage 2: dX = dH @ W1) with WGMMA + TMA, and the push reverse-dispatch of dX rows into the home ranks'
  ``grad_buf[t, k]``.
* The wgrad launch (``csrc/mok/backward/wgrad.cuh``) reduces the layout-order rows the backward left into the expert
  weight gradients (fp32, added straight into ``main_grad`` when given), and with its otherwise idle producer warps
  the router-weight gradient ``grad_w[t, k] = <grad_out[t], combine[t, k]>`` and the top-k sum
  ``grad_x[t] = sum_k grad_buf[t, k]`` (the backward launch leaves them to it: ``defer_home``).
* ``wgrad="mm"`` / ``"grouped"`` compute the weight gradients with torch instead (the benchmarks' baselines; then the
  backward launch does the home reductions itself); ``"none"`` skips them.
* W1 and W2 are read as stored; only the recompute path's stage 1 reads a W2^T copy made per call.
"""

from __future__ import annotations

import torch

from ..activation import Glu
from . import errors, ops
from .comm import PeerBuffers
from .forward import KeptRows, on_stream
from .tuning import glu_args

WGRAD_MODES = ("kernel", "mm", "grouped", "none")


def _fail(msg: str) -> None:
    raise ValueError(f"mok_backward: {msg}")


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with bf16 operands, fp32 accumulation and fp32 output."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # older torch: no mm.dtype overload
        return a.float() @ b.float()


def weight_grads(tpe, xl, gyl, dh, act, *, mode: str = "mm", main_grad_w1=None, main_grad_w2=None):
    """Expert weight gradients of one owner rank from the kernel's layout-order buffers: ``mode`` "kernel" (the wgrad
    kernel), "mm" (one cuBLAS mm per expert after one host sync) or "grouped" (``torch._grouped_mm``, bf16-rounded),
    the benchmarks' baselines.

    dW2_e = gy_e^T @ act_e [H, F], dW1_e = dH_e^T @ x_e [2F, H] (fp32). With main_grad_* (lists of
    fp32 tensors) the results are added into them and those are returned.
    """
    L = tpe.numel()
    H, F = gyl.shape[1], act.shape[1]
    dev = gyl.device
    if mode == "kernel":
        err = errors.new_record(dev)
        gw1, gw2 = weight_grads_kernel(
            tpe, xl, gyl, dh, act, main_grad_w1=main_grad_w1, main_grad_w2=main_grad_w2, err=err
        )
        check = errors.capture_check("lazy", "weight_grads")  # no event query while a CUDA graph captures
        errors.after_launch(err, None, check, errors.backward_message(1, L, 10000.0))  # the current stream
        return gw1, gw2
    if mode == "grouped":
        offs = torch.cumsum(tpe, 0, dtype=torch.int32)
        nonempty = (tpe > 0).view(L, 1, 1)
        g2 = torch._grouped_mm(gyl.t(), act, offs=offs)  # [L, H, F] (bf16 output)
        g1 = torch._grouped_mm(dh.t(), xl, offs=offs)  # [L, 2F, H]
        g2 = torch.where(nonempty, g2.float(), torch.zeros((), device=dev))
        g1 = torch.where(nonempty, g1.float(), torch.zeros((), device=dev))
        gw2, gw1 = list(g2.unbind(0)), list(g1.unbind(0))
    elif mode == "mm":
        counts = tpe.tolist()  # one host sync per call
        gw1, gw2 = [], []
        a = 0
        for e in range(L):
            b = a + counts[e]
            if b > a:
                gw2.append(_mm_fp32(gyl[a:b].t(), act[a:b]))
                gw1.append(_mm_fp32(dh[a:b].t(), xl[a:b]))
            else:
                gw2.append(torch.zeros((H, F), dtype=torch.float32, device=dev))
                gw1.append(torch.zeros((2 * F, H), dtype=torch.float32, device=dev))
            a = b
    else:
        raise ValueError(f"wgrad mode must be one of {WGRAD_MODES[:3]}, got {mode!r}")
    if main_grad_w1 is not None:
        for m, g in zip(main_grad_w1, gw1):
            m.add_(g)
        gw1 = list(main_grad_w1)
    if main_grad_w2 is not None:
        for m, g in zip(main_grad_w2, gw2):
            m.add_(g)
        gw2 = list(main_grad_w2)
    return gw1, gw2


def wgrad_output_ok(t: torch.Tensor) -> bool:
    """A tensor the wgrad kernel can write (or add into) in place: fp32 2-D, unit inner stride, even row
    stride, 8-byte aligned (its epilogue stores fp32 pairs)."""
    return (
        t.dtype == torch.float32
        and t.dim() == 2
        and t.stride(1) == 1
        and t.stride(0) % 2 == 0
        and t.data_ptr() % 8 == 0
    )


def weight_grads_kernel(
    tpe,
    xl,
    gyl,
    dh,
    act,
    *,
    main_grad_w1=None,
    main_grad_w2=None,
    err=None,
    rank: int = 0,
    timeout_ms: float = 10000.0,
    home=None,
):
    """Expert weight gradients of one owner rank in one launch of the wgrad kernel.

    tpe int32 [L] (rows per local expert, device), xl / gyl [cap, H], dh [cap, 2F], act [cap, F] bf16 in layout
    order (experts back to back from row 0). Returns (grad_w1[e] fp32 [2F, H], grad_w2[e] fp32 [H, F]); with
    main_grad_w1 / main_grad_w2 (lists of L fp32 tensors, ``wgrad_output_ok``) the results are added into them and
    those are returned. err: the preceding backward launch's error record (if that launch failed, every output is
    set to NaN, so a training step stops at Megatron's gradient NaN check even when the record is read lazily).
    home: (grad_out, combine, grad_buf, idx, grad_w, grad_x) of the home reductions the backward launch deferred."""
    L = tpe.numel()
    H, F = xl.shape[1], act.shape[1]
    device = xl.device
    if (main_grad_w1 is None) != (main_grad_w2 is None):
        raise ValueError("wgrad: give both main_grad_w1 and main_grad_w2, or neither")
    accumulate = main_grad_w1 is not None
    if accumulate:
        gw1, gw2 = list(main_grad_w1), list(main_grad_w2)
    else:
        gw1 = list(torch.empty((L, 2 * F, H), dtype=torch.float32, device=device).unbind(0))
        gw2 = list(torch.empty((L, H, F), dtype=torch.float32, device=device).unbind(0))
    ops.load()
    torch.ops.mok.wgrad(
        tpe, xl, gyl, dh, act, gw1, gw2, err if err is not None else errors.new_record(device), accumulate, rank,
        float(timeout_ms), *(home if home is not None else (None,) * 6),
    )  # fmt: skip
    return gw1, gw2


def _kept_or_new(kept: KeptRows | None, cap: int, H: int, F: int, saved: bool, device):
    """Owner-side xl / act buffers [cap, H] / [cap, F]: views of the forward's kept rows (act only with saved h: the
    recompute path writes its own), or new ones."""
    bf = dict(dtype=torch.bfloat16, device=device)
    if kept is None:
        return torch.empty((cap, H), **bf), torch.empty((cap, F), **bf)
    if not kept.filled:
        _fail("kept rows were never laid out by a forward launch (mok_forward(..., keep=...))")
    if kept.rows < cap or kept.x.shape[1] != H or kept.act.shape[1] != F:
        _fail(
            f"kept rows are {tuple(kept.x.shape)} / {tuple(kept.act.shape)}, the backward needs [>= {cap}, {H}] / [>= {cap}, {F}]"
        )
    return kept.x[:cap], kept.act[:cap] if saved else torch.empty((cap, F), **bf)


def _fp8_buffers(cap: int, H: int, F: int, device) -> list[torch.Tensor]:
    """The owner's e4m3 gy / dH rows (layout order) with their 1 x 128 block scales: [gy, gy scales, dH, dH scales]."""
    f32 = dict(dtype=torch.float32, device=device)
    e4 = dict(dtype=torch.float8_e4m3fn, device=device)
    return [
        torch.empty((cap, H), **e4),
        torch.empty((cap, H // 128), **f32),
        torch.empty((cap, 2 * F), **e4),
        torch.empty((cap, 2 * F // 128), **f32),
    ]


def mok_backward(
    bufs: PeerBuffers,
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    combine_buf: torch.Tensor,
    w1: list[torch.Tensor],
    w2: list[torch.Tensor],
    *,
    comm_sms: int,
    ring_slots: int,
    minibatch_tokens: int,
    timeout_ms: float = 10000.0,
    wgrad: str = "kernel",
    main_grad_w1=None,
    main_grad_w2=None,
    saved_h: torch.Tensor | None = None,
    owner_rows: int = 0,
    ctas: int = 0,
    stream: torch.cuda.Stream | None = None,
    kept: KeptRows | None = None,
    check: bool | str = True,
    timeline=None,
    return_buffers: bool = False,
    fp8=None,
    glu: Glu | None = None,
    debug_stall: tuple[int, int] | None = None,
):
    """MoE layer backward of rank ``bufs.rank`` (at EP > 1 every rank makes the matching call, in the same epoch
    sequence as the forward calls on these buffers, with the same token count).

    grad_out / x [T, H] bf16, topk_idx [T, K] int32/int64, topk_weight [T, K] fp32, combine_buf [T, K, H] bf16 (this
    rank's forward output rows before the weighted sum: the forward's combine; at EP > 1 a copy when a later
    forward may have reused the symmetric region -- a view of it is copied here, because the backward receives
    gradients in those bytes), w1[e] [2F, H] / w2[e] [H, F] this rank's L experts. saved_h: this rank's
    forward-kept fc1 output in layout order, or None to recompute. Returns (grad_x [T, H] bf16, grad_topk_weight
    [T, K] fp32, grad_w1 [L] fp32, grad_w2 [L] fp32; None with wgrad="none").

    Memory: the owner-side layout-order buffers (x rows, scaled output-gradient rows, dH, act) hold ``owner_rows``
    rows; 0 = EP * T * K, the worst case of every routed row landing on this rank (no host sync to learn the real
    count). With fewer, a routing that sends this rank more rows is reported by the kernel (MokKernelError naming the
    rank and both counts) before any row is written.

    fp8: this rank's ``Fp8ExpertWeights`` with transposes (``with_transposes()``) selects the FP8 dgrad (needs saved_h;
    the wgrad stays bf16). kept: the ``KeptRows`` of the matching forward: xl (and with saved_h act) are read there,
    only grad_out is pulled. ``wgrad="mm"`` reads the per-expert row counts on the host (one sync after the launch).
    """
    world, rank = bufs.world, bufs.rank
    if world > 1:
        errors.refuse_capture(
            "an EP > 1 backward", "each launch meets its peers under a new epoch, which a replay repeats"
        )
    if timeline is not None:
        errors.refuse_capture("a timeline launch", "its event buffer is read back after each launch")
    if wgrad == "mm":
        errors.refuse_capture("mok_backward(wgrad='mm')", "it reads the per-expert row counts on the host")
    check = errors.capture_check(check, "mok_backward")
    if wgrad not in WGRAD_MODES:
        _fail(f"wgrad must be one of {WGRAD_MODES}, got {wgrad!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        _fail(f"x must be a [tokens, hidden] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(w1, (list, tuple)) or not isinstance(w2, (list, tuple)) or not w1 or len(w1) != len(w2):
        _fail("w1 and w2 must be non-empty lists of this rank's expert weights, one per expert")
    if not isinstance(owner_rows, int) or owner_rows < 0:
        _fail(f"owner_rows must be an int >= 0 (0: EP * T * K), got {owner_rows!r}")
    T, H = x.shape
    K = topk_idx.shape[1] if topk_idx.dim() == 2 else 0
    L, F = len(w1), w2[0].shape[1]
    cap = owner_rows or max(1, world * T * K)
    ops.load()
    device = x.device
    epoch = bufs.next_epoch()
    bf = dict(dtype=torch.bfloat16, device=device)
    with on_stream(stream):
        combine_buf = combine_buf.contiguous()
        if world > 1:
            # the backward receives gradients in the combine bytes: keep the forward's rows apart first
            lo, hi = bufs.grad_buf.data_ptr(), bufs.grad_buf.data_ptr() + bufs.grad_buf.numel() * 2
            if lo <= combine_buf.data_ptr() < hi:
                combine_buf = combine_buf.clone()
            v = bufs.publish("mok_backward", T, x=x, grad_out=grad_out, topk_weight=topk_weight, topk_idx=topk_idx)
            x, grad_out, topk_weight, topk_idx = v["x"], v["grad_out"], v["topk_weight"], v["topk_idx"]
            grad_buf = bufs.grad_buf[:T]
            peer_bases, peer_offsets = bufs.ptrs, bufs.backward_offsets()
        else:
            if topk_idx.dtype == torch.int64:
                topk_idx = topk_idx.to(torch.int32)
            grad_buf = torch.empty((T, K, H), **bf)
            peer_bases, peer_offsets = [], []
        xl, act = _kept_or_new(kept, cap, H, F, saved_h is not None, device)
        gyl = torch.empty((cap, H), **bf)
        dh = torch.empty((cap, 2 * F), **bf)
        w2t = [w.t().contiguous() for w in w2] if saved_h is None else []  # recompute path only
        if fp8 is not None and fp8.w1tq is None:
            _fail("the FP8 dgrad needs the weights' transposed copies (Fp8ExpertWeights.with_transposes())")
        f8w = [*fp8.w2tq[0], *fp8.w2ts[0], *fp8.w1tq[0], *fp8.w1ts[0]] if fp8 is not None else []
        f8b = _fp8_buffers(cap, H, F, device) if fp8 is not None else []
        tl = tc = None
        if timeline is not None:
            tl, tc = timeline.prepare(ctas or torch.cuda.get_device_properties(device).multi_processor_count, device)
        stall = debug_stall if debug_stall is not None else (-1, -1)
        defer_home = wgrad == "kernel"  # the wgrad launch takes the router grad and the grad_x sum
        grad_x, grad_w, tpe = torch.ops.mok.backward(
            grad_out, x, topk_idx, topk_weight, combine_buf, list(w1), list(w2), w2t, grad_buf, xl, gyl, dh, act,
            bufs.bwd_err, peer_bases, peer_offsets, saved_h, f8w, f8b, tl, tc, rank, epoch, comm_sms, ring_slots,
            minibatch_tokens, ctas, float(timeout_ms), *glu_args(glu), defer_home, kept is not None,
            kept is not None and saved_h is not None, *stall,
        )  # fmt: skip
        gw1 = gw2 = None
        if wgrad == "kernel":  # same stream, no host sync; NaN outputs if the backward launch failed
            home = (grad_out, combine_buf, grad_buf, topk_idx, grad_w, grad_x)
            gw1, gw2 = weight_grads_kernel(
                tpe, xl, gyl, dh, act, main_grad_w1=main_grad_w1, main_grad_w2=main_grad_w2, err=bufs.bwd_err,
                rank=rank, timeout_ms=timeout_ms, home=home,
            )  # fmt: skip
    if bufs.epoch != epoch:  # EP 1 stays at 0: no state changes, which a traced autograd node may not make
        bufs.epoch = epoch
    errors.after_launch(bufs.bwd_err, stream, check, errors.backward_message(world, L, timeout_ms))
    if wgrad in ("mm", "grouped"):
        with on_stream(stream):
            gw1, gw2 = weight_grads(
                tpe, xl, gyl, dh, act, mode=wgrad, main_grad_w1=main_grad_w1, main_grad_w2=main_grad_w2
            )
    if return_buffers:
        extra = dict(zip(("gyl8", "gys", "dh8", "dhs"), f8b))
        return grad_x, grad_w, gw1, gw2, dict(tpe=tpe, xl=xl, gyl=gyl, dh=dh, act=act, grad_buf=grad_buf, **extra)
    return grad_x, grad_w, gw1, gw2
