"""The forward megakernel: one rank's launch of the fused MoE forward (``mok::forward``: schedule, pull dispatch,
expert FFN, push combine, top-k sum), at EP 1 over plain tensors and at EP > 1 over the ranks' symmetric regions
(``comm.PeerBuffers``). Every argument is checked by the operator (``csrc/mok/apis/forward.cpp``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from ..activation import Glu
from . import errors, ops
from .comm import PeerBuffers
from .quant import Fp8ExpertWeights
from .tuning import ForwardTuning, glu_args


@dataclass
class KeptRows:
    """The expert input and SwiGLU output rows a bf16 forward launch keeps for the backward.

    x [rows, H] and act [rows, F] bf16 stand in for the forward's ring: minibatch i lands at rows [i*M, (i+1)*M),
    i.e. in layout order, so the backward reads xl / act there instead of pulling x again and recomputing act from
    h (the rows Megatron's grouped GEMM keeps for its wgrad too). ``rows`` is a multiple of the forward's minibatch
    and the owner capacity: a routing that sends the owner more rows is a kernel error.
    """

    x: torch.Tensor
    act: torch.Tensor
    minibatch: int
    #: set by the forward launch that lays the rows out (the backward refuses rows never written)
    filled: bool = False

    @staticmethod
    def allocate(owner_rows: int, H: int, F: int, minibatch: int, device) -> KeptRows:
        rows = max(1, -(-owner_rows // minibatch)) * minibatch
        bf = dict(dtype=torch.bfloat16, device=device)
        return KeptRows(torch.empty((rows, H), **bf), torch.empty((rows, F), **bf), minibatch)

    @property
    def rows(self) -> int:
        return int(self.x.shape[0])


# the layer's state holds the kept rows: their tensors are saved for the backward with it (function.py)
pytree.register_dataclass(KeptRows)


def _fail(msg: str) -> None:
    raise ValueError(f"mok_forward: {msg}")


def mok_forward(
    bufs: PeerBuffers,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    w1: list[torch.Tensor],
    w2: list[torch.Tensor],
    *,
    comm_sms: int,
    ring_slots: int,
    minibatch_tokens: int,
    timeout_ms: float = 10000.0,
    ctas: int = 0,
    stream: torch.cuda.Stream | None = None,
    check: bool | str = True,
    timeline=None,
    saved_h: torch.Tensor | None = None,
    fp8=None,
    keep: KeptRows | None = None,
    glu: Glu | None = None,
    tuning: ForwardTuning | None = None,
    debug_stall: tuple[int, int] | None = None,
    gpu_events=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoE forward of rank ``bufs.rank`` (one kernel launch; at EP > 1 every rank makes the matching call).

    x [T, H] bf16, topk_idx [T, K] (global expert ids in [0, world * L) or -1; int32, or int64 converted),
    topk_weight [T, K] fp32, w1[e] [2F, H] / w2[e] [H, F] bf16 for this rank's L experts. ``ctas``: SMs for this
    launch (0 = all; ranks sharing one GPU in tests split it). Returns (out [T, H] bf16, combine [T, K, H] bf16 --
    the unweighted expert outputs, at EP > 1 a view of the symmetric region that the next call overwrites --,
    tokens_per_expert [L] int32).

    saved_h [rows, 2F] bf16: this rank's fc1 output h = [gate | up] lands there in layout order, for the backward
    (no fc1 recompute); its rows are the owner capacity (EP * T * K never overflows; with fewer, a routing that sends
    this rank more rows is reported by the kernel before any row is written). fp8: this rank's
    ``Fp8ExpertWeights`` (``quant.py``; one rank): the FP8 kernel, w1 / w2 then only give the sizes. keep: a
    ``KeptRows`` (rows: the owner capacity) for the bf16 backward. glu: the SwiGLU variant (None: plain). tuning:
    the config's ``ForwardTuning``. check: how the launch's error record is read (``errors``). gpu_events: a
    ``(start, end)`` pair of ``torch.cuda.Event`` recorded on the launch stream just around the operator, so their
    elapsed time is the layer's device time without this call's host preparation.
    """
    world, rank = bufs.world, bufs.rank
    if world > 1:
        errors.refuse_capture(
            "an EP > 1 forward", "each launch meets its peers under a new epoch, which a replay repeats"
        )
    if timeline is not None:
        errors.refuse_capture("a timeline launch", "its event buffer is read back after each launch")
    check = errors.capture_check(check, "mok_forward")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        _fail(f"x must be a [tokens, hidden] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(w1, (list, tuple)) or not isinstance(w2, (list, tuple)) or not w1 or len(w1) != len(w2):
        _fail("w1 and w2 must be non-empty lists of this rank's expert weights, one per expert")
    if fp8 is not None and not isinstance(fp8, Fp8ExpertWeights):
        _fail(f"fp8 must be an Fp8ExpertWeights (megatron_mok.kernel.quant), got {type(fp8).__name__}")
    if keep is not None and keep.minibatch != minibatch_tokens:
        _fail(f"kept rows were allocated for minibatch {keep.minibatch}, this launch uses {minibatch_tokens}")
    T, H = x.shape
    K = topk_idx.shape[1] if topk_idx.dim() == 2 else 0
    L = len(w1)
    ops.load()
    device = x.device
    epoch = bufs.next_epoch()
    with on_stream(stream):
        if world > 1:
            v = bufs.publish("mok_forward", T, x=x, topk_idx=topk_idx)
            x, topk_idx, combine = v["x"], v["topk_idx"], bufs.combine[:T]
            peer_bases, peer_offsets = bufs.ptrs, bufs.forward_offsets()
        else:
            if topk_idx.dtype == torch.int64:
                topk_idx = topk_idx.to(torch.int32)
            combine = torch.empty((T, K, H), dtype=torch.bfloat16, device=device)
            peer_bases, peer_offsets = [], []
        if fp8 is not None:
            wq1, wq2, ws1, ws2 = fp8.w1q[0], fp8.w2q[0], fp8.w1s[0], fp8.w2s[0]
        else:
            wq1, wq2, ws1, ws2 = list(w1), list(w2), [], []
        tl = tc = None
        if timeline is not None:  # kernel.timeline.Timeline
            tl, tc = timeline.prepare(ctas or torch.cuda.get_device_properties(device).multi_processor_count, device)
        t = tuning or ForwardTuning()
        stall = debug_stall if debug_stall is not None else (-1, -1)
        if gpu_events is not None:
            gpu_events[0].record()
        out, tpe = torch.ops.mok.forward(
            x, topk_idx, topk_weight, wq1, wq2, ws1, ws2, combine, bufs.err, peer_bases, peer_offsets,
            saved_h, None if keep is None else keep.x, None if keep is None else keep.act, tl, tc,
            rank, epoch, comm_sms, ring_slots, minibatch_tokens, ctas, float(timeout_ms), *glu_args(glu),
            -1 if t.tile_raster is None else t.tile_raster, t.debug_bits(), *stall,
        )  # fmt: skip
        if gpu_events is not None:
            gpu_events[1].record()
    if keep is not None:
        keep.filled = True  # this launch lays the rows out (stream-ordered before any backward)
    if bufs.epoch != epoch:  # EP 1 stays at 0: no state changes, which a traced autograd node may not make
        bufs.epoch = epoch
    errors.after_launch(bufs.err, stream, check, errors.forward_message(world, L, timeout_ms))
    return out, combine, tpe


def on_stream(stream: torch.cuda.Stream | None):
    """The launch's stream as the current one (None: the current stream as it is)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
