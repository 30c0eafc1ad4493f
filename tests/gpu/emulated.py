"""Test fixture: R EP ranks on one GPU with the list-of-ranks signature the kernel tests use.

Every rank is a real per-rank launch of the product path (``mok_forward`` / ``mok_backward``): R ranks get their
symmetric-region stand-ins on this GPU (``PeerBuffers.on_one_gpu``), each launches on a stream of its own with
``ctas_per_rank`` SMs (default: an even split), and they meet on their signal pads as on R GPUs; R = 1 is the
layer's own EP-1 launch. Ranks with fewer tokens than the largest are padded with tokens routed nowhere (topk -1),
since per-rank launches need one token count; the padding rows are cut from every result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_mok.kernel import KeptRows, PeerBuffers, errors, mok_backward, mok_forward
from megatron_mok.kernel.backward import weight_grads
from megatron_mok.kernel.quant import Fp8ExpertWeights


@dataclass
class EmulatedKept:
    """The kept rows of R owner ranks: x [R, rows, H] and act [R, rows, F], owner q's KeptRows in parts[q]."""

    x: torch.Tensor
    act: torch.Tensor
    parts: list[KeptRows]


def kept_rows(R: int, owner_rows: int, H: int, F: int, minibatch: int, device) -> EmulatedKept:
    """R owners' kept rows (rows: owner_rows rounded up to the minibatch)."""
    rows = max(1, -(-owner_rows // minibatch)) * minibatch
    x = torch.empty((R, rows, H), dtype=torch.bfloat16, device=device)
    act = torch.empty((R, rows, F), dtype=torch.bfloat16, device=device)
    return EmulatedKept(x, act, [KeptRows(x[q], act[q], minibatch) for q in range(R)])


def _parts(kept, R: int) -> list:
    if isinstance(kept, EmulatedKept):
        if len(kept.parts) != R:
            raise ValueError(f"kept rows of {len(kept.parts)} owners for {R} ranks")
        return kept.parts
    return [kept] * R


def _rank_fp8(fp8, q: int):
    if not isinstance(fp8, Fp8ExpertWeights):  # None, or what the launch is to refuse
        return fp8
    pick = lambda lst: None if lst is None else [lst[q]]  # noqa: E731
    return Fp8ExpertWeights(
        pick(fp8.w1q), pick(fp8.w1s), pick(fp8.w2q), pick(fp8.w2s),
        pick(fp8.w1tq), pick(fp8.w1ts), pick(fp8.w2tq), pick(fp8.w2ts),
    )  # fmt: skip


def _pad(t: torch.Tensor, T: int, value) -> torch.Tensor:
    if t.shape[0] == T:
        return t
    pad = t.new_full((T - t.shape[0], *t.shape[1:]), value)
    return torch.cat([t, pad])


_LOCAL: dict[torch.device, PeerBuffers] = {}
_STREAMS: dict[tuple[torch.device, int], list[torch.cuda.Stream]] = {}


def _ranks(R: int, T: int, H: int, K: int, device, fp8: bool):
    """PeerBuffers and one stream per rank. R = 1: one local handle per device for the whole session, like the
    layer's backend (a launch captured in a CUDA graph keeps writing its error record on every replay)."""
    if R == 1:
        if device not in _LOCAL:
            _LOCAL[device] = PeerBuffers.local(device)
        return [_LOCAL[device]], [torch.cuda.current_stream(device)]
    bufs = PeerBuffers.on_one_gpu(R, max(T, 1), H, K, device, fp8_sources=fp8)
    if (device, R) not in _STREAMS:
        _STREAMS[device, R] = [torch.cuda.Stream(device) for _ in range(R)]
    return bufs, _STREAMS[device, R]


def _run_ranks(streams, launch, R: int):
    """launch(q) on stream q for every rank, ordered after the current stream's work and before its later work."""
    cur = torch.cuda.current_stream()
    for s in streams:
        if s != cur:
            s.wait_stream(cur)
    outs = []
    for q in range(R):
        with torch.cuda.stream(streams[q]):
            outs.append(launch(q))
    for s in streams:
        if s != cur:
            cur.wait_stream(s)
    return outs


def _check(bufs, streams, check, message, backward: bool) -> None:
    """Read every rank's record as ``check`` says; synchronously, the root cause is raised (a rank's own failure
    rather than its peers' waits for it), as the lazy reader does."""
    check = errors.capture_check(check, "emulated launch")
    records = [b.bwd_err if backward else b.err for b in bufs]
    if check and check != "lazy":
        for s in streams:
            s.synchronize()
        found = [r.cpu().tolist() for r in records]
        found = [v for v in found if v[0] != 0]
        if found:
            raise errors.MokKernelError(message(errors.root_cause(found)))
        return
    for err, s in zip(records, streams):
        errors.after_launch(err, s, check, message)


def mok_forward_emulated(
    x,
    topk_idx,
    topk_weight,
    w1,
    w2,
    *,
    comm_sms: int,
    ring_slots: int,
    minibatch_tokens: int,
    timeout_ms: float = 10000.0,
    debug_stall=None,
    ctas_per_rank: int = 0,
    check=True,
    timeline=None,
    saved_h=None,
    fp8=None,
    keep=None,
    gpu_events=None,
    glu=None,
    tuning=None,
):
    """x[r] [T_r, H], topk_idx[r] / topk_weight[r] [T_r, K], w1[q][e] / w2[q][e]; saved_h[q], keep (``kept_rows``),
    fp8 (R ranks' Fp8ExpertWeights). Returns (out[r], combine[r], tokens_per_expert[q])."""
    R = len(x)
    device = x[0].device
    Ts = [int(t.shape[0]) for t in x]
    T, H, K = max(Ts), x[0].shape[1], topk_idx[0].shape[1]
    if (timeline is not None or gpu_events is not None) and R > 1:
        raise ValueError("the fixture records a timeline or GPU events for one rank only")
    bufs, streams = _ranks(R, T, H, K, device, fp8 is not None)
    ctas = ctas_per_rank or (0 if R == 1 else torch.cuda.get_device_properties(device).multi_processor_count // R)
    keeps = _parts(keep, R)
    xp, ip, wp = ([_pad(t, T, v) for t in ts] for ts, v in ((x, 0.0), (topk_idx, -1), (topk_weight, 0.0)))

    def launch(q: int):
        return mok_forward(
            bufs[q], xp[q], ip[q], wp[q], w1[q], w2[q],
            comm_sms=comm_sms, ring_slots=ring_slots, minibatch_tokens=minibatch_tokens, timeout_ms=timeout_ms,
            ctas=ctas, check=False, timeline=timeline, saved_h=None if saved_h is None else saved_h[q],
            fp8=_rank_fp8(fp8, q), keep=keeps[q], glu=glu, tuning=tuning, debug_stall=debug_stall,
            gpu_events=gpu_events,
        )  # fmt: skip

    outs = _run_ranks(streams, launch, R)
    _check(bufs, streams, check, errors.forward_message(R, len(w1[0]), timeout_ms), backward=False)
    out = [o[0][: Ts[r]] for r, o in enumerate(outs)]
    comb = [o[1][: Ts[r]].clone() if R > 1 else o[1] for r, o in enumerate(outs)]
    return out, comb, [o[2] for o in outs]


def mok_backward_emulated(
    grad_out,
    x,
    topk_idx,
    topk_weight,
    combine_buf,
    w1,
    w2,
    *,
    comm_sms: int,
    ring_slots: int,
    minibatch_tokens: int,
    timeout_ms: float = 10000.0,
    wgrad: str = "kernel",
    main_grad_w1=None,
    main_grad_w2=None,
    debug_stall=None,
    ctas_per_rank: int = 0,
    check=True,
    return_buffers: bool = False,
    saved_h=None,
    timeline=None,
    fp8=None,
    kept=None,
    glu=None,
):
    """The backward of R ranks (lists as in :func:`mok_forward_emulated`; main_grad_w1[q] per owner, kept from ``kept_rows``).
    Returns (grad_x[r], grad_topk_weight[r], grad_w1[q], grad_w2[q]) and with return_buffers a dict of per-rank
    lists of the layout-order buffers. The owner capacity is every routed row (sum of the ranks' T x K)."""
    R = len(x)
    device = x[0].device
    Ts = [int(t.shape[0]) for t in x]
    T, H, K = max(Ts), x[0].shape[1], topk_idx[0].shape[1]
    if timeline is not None and R > 1:
        raise ValueError("the fixture records a timeline for one rank only")
    bufs, streams = _ranks(R, T, H, K, device, False)
    ctas = ctas_per_rank or (0 if R == 1 else torch.cuda.get_device_properties(device).multi_processor_count // R)
    kepts = _parts(kept, R)
    cap = max(1, sum(Ts) * K)
    # torch's weight gradients read the row counts on the host: after every rank has launched (its kernel waits
    # for the later ranks)
    host_wgrad = wgrad in ("mm", "grouped") and R > 1
    gp, xp, ip, wp, cp = (
        [_pad(t, T, v) for t in ts]
        for ts, v in ((grad_out, 0.0), (x, 0.0), (topk_idx, -1), (topk_weight, 0.0), (combine_buf, 0.0))
    )

    def launch(q: int):
        return mok_backward(
            bufs[q], gp[q], xp[q], ip[q], wp[q], cp[q], w1[q], w2[q], comm_sms=comm_sms,
            ring_slots=ring_slots, minibatch_tokens=minibatch_tokens, timeout_ms=timeout_ms,
            wgrad="none" if host_wgrad else wgrad,
            main_grad_w1=None if main_grad_w1 is None else main_grad_w1[q],
            main_grad_w2=None if main_grad_w2 is None else main_grad_w2[q],
            saved_h=None if saved_h is None else saved_h[q], owner_rows=cap, ctas=ctas, kept=kepts[q], check=False,
            timeline=timeline, return_buffers=return_buffers or host_wgrad, fp8=_rank_fp8(fp8, q), glu=glu,
            debug_stall=debug_stall,
        )  # fmt: skip

    outs = _run_ranks(streams, launch, R)
    _check(bufs, streams, check, errors.backward_message(R, len(w1[0]), timeout_ms), backward=True)
    gx = [o[0][: Ts[r]] for r, o in enumerate(outs)]
    gw = [o[1][: Ts[r]] for r, o in enumerate(outs)]
    if host_wgrad:
        mg1, mg2 = main_grad_w1 or [None] * R, main_grad_w2 or [None] * R
        grads = [
            weight_grads(*(o[4][n] for n in ("tpe", "xl", "gyl", "dh", "act")), mode=wgrad, main_grad_w1=mg1[q],
                         main_grad_w2=mg2[q])
            for q, o in enumerate(outs)
        ]  # fmt: skip
        outs = [(*o[:2], *g, *o[4:]) for o, g in zip(outs, grads)]
    gw1 = None if wgrad == "none" else [o[2] for o in outs]
    gw2 = None if wgrad == "none" else [o[3] for o in outs]
    if return_buffers:
        names = outs[0][4].keys()
        return gx, gw, gw1, gw2, {n: [o[4][n] for o in outs] for n in names}
    return gx, gw, gw1, gw2
