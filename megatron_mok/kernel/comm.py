"""Per-rank launches of the MoK forward kernel: real EP over torch symmetric memory.

Each EP rank launches the same device code as the emulated path, with ONE partition (its own rank).
What peers touch lives in one symmetric allocation per rank (:class:`PeerRegion`):

  x        [cap, H]     bf16   home rank's token rows; owners *pull* the rows they need
  topk_idx [cap, K]     int32  home rank's routing; every owner reads it to build its schedule
  combine  [cap, K, H]  bf16   forward: owners *push* expert outputs into the home rank's rows;
                               backward: the same bytes receive the pushed input-row gradients (grad_buf)
  topk_w   [cap, K]     fp32   backward: owners scale the pulled output gradients by it
  grad_out [cap, H]     bf16   backward: home rank's output gradient; owners *pull* the rows they need
  signal   [4, 72]      uint32 start / compute-done / token-count / source-quantised slots, written with
                               the call's epoch
  xq, xs   [cap, H] e4m3, [cap, H / 128] fp32 (``fp8_sources`` regions only): the home rank's tokens
                               quantised once by its FP8 launch; owners pull
                               e4m3 rows from there (half the bytes of the bf16 rows)

Peer pointers come from torch symmetric memory (``symm_mem.empty`` + ``rendezvous``:
``buffer_ptrs[r]``); :meth:`PeerBuffers.on_one_gpu` builds the same regions for several ranks on
one GPU, so tests exercise the per-rank launches (separate launches on separate streams that meet
only through signal pads) without a multi-GPU machine.

Contract: every rank calls :func:`mok_forward_rank` (and, in backward,
:func:`megatron_mok.kernel.backward.mok_backward_rank`) once per layer call, in the same order, with
the same token count (checked in the kernel: a mismatch or a rank that never arrives is a clear
:class:`MokKernelError` naming the rank). No host synchronisation; the epoch counter lives on the host.
Weights stay local: rank q passes only its L experts.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ..activation import Glu
from .forward import (
    MOK_MAX_RANKS,
    _check_tensor,
    _error_message,
    _lazy_checker,
    refuse_capture,
    rejection,
    set_expert_weights,
)
from .host.cargs import ForwardTuning, LaunchArrays, bind_glu, bind_tuning
from .host.errors import MokKernelError, raise_recorded_error
from .host.library import _Args, load_library
from .host.weight_memo import dense_weight_pointers

SIGNAL_KINDS = 4  # start, done, token count, source-quantised (csrc/mok/common.cuh SignalKind)
SCALE_BLOCK = 128  # columns per fp32 scale of the source-quantised rows (1 x 128 blocks)
_ALIGN = 1024


def _align(v: int) -> int:
    return (v + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class PeerRegion:
    """Byte layout of one rank's symmetric allocation (identical on every rank)."""

    tokens_cap: int
    hidden: int
    topk: int
    x_off: int
    idx_off: int
    combine_off: int
    topk_w_off: int
    grad_out_off: int
    signal_off: int
    nbytes: int
    # the FP8 forward's source-quantised copy; offsets -1 in a region without it
    fp8_sources: bool = False
    xq_off: int = -1
    xs_off: int = -1

    @staticmethod
    def plan(tokens_cap: int, hidden: int, topk: int, fp8_sources: bool = False) -> PeerRegion:
        if tokens_cap < 1 or hidden < 1 or topk < 1:
            raise ValueError(f"PeerRegion: tokens_cap={tokens_cap}, hidden={hidden}, topk={topk} must be >= 1")
        if fp8_sources and hidden % SCALE_BLOCK:
            raise ValueError(f"PeerRegion: fp8_sources needs hidden a multiple of {SCALE_BLOCK}, got {hidden}")
        off = 0
        x_off = off
        off = _align(off + tokens_cap * hidden * 2)
        idx_off = off
        off = _align(off + tokens_cap * topk * 4)
        combine_off = off
        off = _align(off + tokens_cap * topk * hidden * 2)
        topk_w_off = off
        off = _align(off + tokens_cap * topk * 4)
        grad_out_off = off
        off = _align(off + tokens_cap * hidden * 2)
        signal_off = off
        off = _align(off + SIGNAL_KINDS * MOK_MAX_RANKS * 4)
        xq_off = xs_off = -1
        if fp8_sources:
            xq_off = off
            off = _align(off + tokens_cap * hidden)
            xs_off = off
            off = _align(off + tokens_cap * (hidden // SCALE_BLOCK) * 4)
        return PeerRegion(
            tokens_cap,
            hidden,
            topk,
            x_off,
            idx_off,
            combine_off,
            topk_w_off,
            grad_out_off,
            signal_off,
            off,
            fp8_sources,
            xq_off,
            xs_off,
        )


class PeerBuffers:
    """One rank's handle on every rank's :class:`PeerRegion` (its own as tensors, peers as pointers)."""

    def __init__(self, rank: int, world: int, region: PeerRegion, local: torch.Tensor, ptrs: list[int]) -> None:
        if not 1 <= world <= MOK_MAX_RANKS:
            raise ValueError(f"EP world size {world} out of [1, {MOK_MAX_RANKS}]")
        if not 0 <= rank < world or len(ptrs) != world:
            raise ValueError(f"rank {rank} / {len(ptrs)} peer pointers do not match world size {world}")
        if local.dtype != torch.uint8 or local.numel() < region.nbytes or not local.is_cuda:
            raise ValueError(f"local region must be a CUDA uint8 tensor of >= {region.nbytes} bytes")
        self.rank, self.world, self.region, self.ptrs = rank, world, region, list(ptrs)
        self._local = local  # keeps the allocation alive
        cap, H, K = region.tokens_cap, region.hidden, region.topk

        def view(off: int, n: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            return local[off : off + n].view(dtype).view(shape)

        self.x = view(region.x_off, cap * H * 2, torch.bfloat16, (cap, H))
        self.idx = view(region.idx_off, cap * K * 4, torch.int32, (cap, K))
        self.combine = view(region.combine_off, cap * K * H * 2, torch.bfloat16, (cap, K, H))
        self.grad_buf = self.combine  # backward: receives the pushed input-row gradients
        self.topk_w = view(region.topk_w_off, cap * K * 4, torch.float32, (cap, K))
        self.grad_out = view(region.grad_out_off, cap * H * 2, torch.bfloat16, (cap, H))
        self.signal = view(region.signal_off, SIGNAL_KINDS * MOK_MAX_RANKS * 4, torch.int32, (SIGNAL_KINDS, -1))
        # the FP8 forward's source-quantised copy of this rank's tokens (written by its launches), or None
        self.xq = self.xs = None
        if region.fp8_sources:
            self.xq = view(region.xq_off, cap * H, torch.uint8, (cap, H))
            self.xs = view(region.xs_off, cap * (H // SCALE_BLOCK) * 4, torch.float32, (cap, H // SCALE_BLOCK))
        self.epoch = 0  # calls made; the kernel's signals carry epoch + 1
        self.workspace: torch.Tensor | None = None
        self.err = torch.zeros((16,), dtype=torch.int32, device=local.device)
        self.bwd_workspace: torch.Tensor | None = None  # the backward launch's own (see mok_backward_rank)
        self.bwd_err = torch.zeros((16,), dtype=torch.int32, device=local.device)

    def peer(self, r: int, off: int) -> int:
        return self.ptrs[r] + off

    @classmethod
    def symmetric(
        cls, group, tokens_cap: int, hidden: int, topk: int, device=None, fp8_sources: bool | None = None
    ) -> PeerBuffers:
        """Allocate this rank's region in torch symmetric memory and exchange peer pointers
        (collective over ``group``; the signal pads start at zero on every rank). ``fp8_sources``: room for
        the FP8 forward's source-quantised copy (None: when H is a multiple of 128, so FP8 can run at all; every
        rank must pass the same)."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        region = PeerRegion.plan(tokens_cap, hidden, topk, _fp8_sources(fp8_sources, hidden))
        local = symm_mem.empty(region.nbytes, dtype=torch.uint8, device=device)
        local[region.signal_off : region.signal_off + SIGNAL_KINDS * MOK_MAX_RANKS * 4].zero_()
        handle = symm_mem.rendezvous(local, group)
        ptrs = [int(p) for p in handle.buffer_ptrs]
        torch.cuda.current_stream(device).synchronize()  # zeroed pads before any peer signals
        dist.barrier(group=group)
        bufs = cls(dist.get_rank(group), dist.get_world_size(group), region, local, ptrs)
        bufs._handle = handle
        return bufs

    @classmethod
    def on_one_gpu(
        cls, world: int, tokens_cap: int, hidden: int, topk: int, device=None, fp8_sources: bool | None = None
    ) -> list[PeerBuffers]:
        """``world`` ranks' regions on one GPU (tests): each rank gets its own PeerBuffers, as in real EP
        (``fp8_sources`` as in :meth:`symmetric`)."""
        device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        region = PeerRegion.plan(tokens_cap, hidden, topk, _fp8_sources(fp8_sources, hidden))
        regions = [torch.zeros((region.nbytes,), dtype=torch.uint8, device=device) for _ in range(world)]
        ptrs = [t.data_ptr() for t in regions]
        return [cls(r, world, region, regions[r], ptrs) for r in range(world)]


def _fp8_sources(asked: bool | None, hidden: int) -> bool:
    """A region's fp8_sources: as asked, or (None) when H allows FP8 at all (a multiple of 128: bf16-only widths
    get no copy); the FP8 forward pulls each token's source-quantised copy."""
    if asked is not None:
        return asked
    return hidden % SCALE_BLOCK == 0


def _fail(msg: str) -> None:
    raise ValueError(f"mok_forward_rank: {msg}")


def _expert_weight_pointers(
    w1, w2, H: int, device, sizes_only: bool = False
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Check this rank's bf16 expert weights w1[e] [2F, H] / w2[e] [H, F] (first failure named); their data
    pointers when all are contiguous and 16-byte aligned (remembered per tensor objects, weight_memo.py:
    the per-expert loop ran on every call), None when some are strided (then set_expert_weights reads
    each one's row stride). sizes_only (FP8 launches, which read only the e4m3 copies): just the lists and
    w2[0], which give L and F; None."""
    if not isinstance(w1, (list, tuple)) or not isinstance(w2, (list, tuple)):
        _fail("w1 and w2 must be lists of this rank's expert weights")
    L = len(w1)
    if L < 1 or len(w2) != L:
        _fail(f"w1 and w2 must hold this rank's experts (got {len(w1)} and {len(w2)})")
    _check_tensor(w2[0], "w2[0]", torch.bfloat16, 2, device)
    if sizes_only:
        return None
    F = w2[0].shape[1]
    # the cheap pass: contiguous [2F, H] / [H, F] with H, F multiples of 8 are exactly the weights the
    # detailed checks below accept with unit inner stride and row strides H / F
    if H % 8 == 0 and F % 8 == 0 and H > 0 and F > 0:
        p1 = dense_weight_pointers([w1], 1, L, torch.bfloat16, (2 * F, H), device)
        p2 = dense_weight_pointers([w2], 1, L, torch.bfloat16, (H, F), device)
        if p1 is not None and p2 is not None:
            return p1, p2
    for e in range(L):
        _check_tensor(w1[e], f"w1[{e}]", torch.bfloat16, 2, device)
        _check_tensor(w2[e], f"w2[{e}]", torch.bfloat16, 2, device)
        if tuple(w1[e].shape) != (2 * F, H) or tuple(w2[e].shape) != (H, F):
            _fail(f"expert {e}: w1 {tuple(w1[e].shape)} / w2 {tuple(w2[e].shape)} must be [{2 * F}, {H}] / [{H}, {F}]")
        for n, t in ((f"w1[{e}]", w1[e]), (f"w2[{e}]", w2[e])):
            if t.stride(1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16:
                _fail(f"{n} needs unit inner stride, a row stride multiple of 8 and a 16-byte aligned start")
    return None


def mok_forward_rank(
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
    keep=None,
    glu: Glu | None = None,
    tuning: ForwardTuning | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoE forward of rank ``bufs.rank`` (one kernel launch; every rank must make the matching call).

    x [T, H] bf16, topk_idx [T, K] (global expert ids in [0, world * L) or -1), topk_weight [T, K] fp32,
    w1[e] [2F, H] / w2[e] [H, F] bf16 for this rank's L experts. ``ctas``: SMs for this launch (0 = all;
    several ranks sharing one GPU in tests split it). Returns (out [T, H] bf16, combine [T, K, H] bf16
    -- a view of the symmetric buffer, overwritten by the next call --, tokens_per_expert [L] int32).
    saved_h [rows, 2F] bf16 (optional): this rank's fc1 output h = [gate | up] lands there in layout
    order, for ``mok_backward_rank(..., saved_h=...)`` (no fc1 recompute in the backward). Its rows are
    the owner capacity: world * T * K never overflows; with fewer, a routing that sends this rank more
    rows is reported by the kernel (every rank sees it and leaves) before any row is written.
    fp8: optional ``Fp8ExpertWeights`` of this rank's experts (one rank: ``w1q[0][e]`` ...): the FP8 kernel.
    keep: optional ``KeptRows`` with one part (rows: the owner capacity, as saved_h's): this rank's expert
    input and SwiGLU output rows stay there, for ``mok_backward_rank(..., kept=keep)`` (bf16 only).
    """
    refuse_capture("mok_forward_rank", "each launch meets its peers under a new epoch, which a replay would repeat")
    R, rank, reg = bufs.world, bufs.rank, bufs.region
    device = bufs.x.device
    H, K = reg.hidden, reg.topk
    _check_tensor(x, "x", torch.bfloat16, 2, device)
    T = x.shape[0]
    if x.shape[1] != H:
        _fail(f"x has hidden size {x.shape[1]}, the peer buffers were built for {H}")
    if T > reg.tokens_cap:
        _fail(f"{T} tokens exceed the peer buffers' capacity of {reg.tokens_cap}: rebuild PeerBuffers larger")
    if tuple(topk_idx.shape) != (T, K) or tuple(topk_weight.shape) != (T, K):
        _fail(f"topk_idx {tuple(topk_idx.shape)} / topk_weight {tuple(topk_weight.shape)} must be ({T}, {K})")
    _check_tensor(topk_weight, "topk_weight", torch.float32, 2, device)
    if topk_idx.dtype not in (torch.int32, torch.int64) or topk_idx.device != device:
        _fail(f"topk_idx must be int32/int64 on {device}, got {topk_idx.dtype} on {topk_idx.device}")
    # (with FP8 weights the kernel reads only the e4m3 copies, checked in set_expert_weights)
    dense = _expert_weight_pointers(w1, w2, H, device, sizes_only=fp8 is not None)
    L, F = len(w1), w2[0].shape[1]
    if not topk_weight.is_contiguous():
        topk_weight = topk_weight.contiguous()

    stream = stream or torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        # publish this call's inputs where peers read them (skipped when the caller wrote them there)
        if x.data_ptr() != bufs.x.data_ptr():
            bufs.x[:T].copy_(x)
        if topk_idx.data_ptr() != bufs.idx.data_ptr() or topk_idx.dtype != torch.int32:
            bufs.idx[:T].copy_(topk_idx)
        out = torch.empty((T, H), dtype=torch.bfloat16, device=device)
        tpe = torch.empty((L,), dtype=torch.int32, device=device)

    lib = load_library()
    arrays = LaunchArrays()  # host arrays the struct points at, alive until the launch returned
    arr, arr_i64 = arrays.u64, arrays.i64

    def own_only(ptr: int) -> list[int]:
        return [ptr if r == rank else 0 for r in range(R)]

    args = _Args()
    args.R, args.L, args.H, args.F, args.K = R, L, H, F, K
    args.comm_sms, args.ring_slots, args.minibatch = comm_sms, ring_slots, minibatch_tokens
    args.ctas_per_rank = ctas
    args.stall_rank, args.stall_slot = -1, -1
    args.device = device.index if device.index is not None else torch.cuda.current_device()
    args.timeout_ms = float(timeout_ms)
    args.T = arr_i64([T] * R)  # equal on every rank (checked in the kernel)
    args.x = arr([bufs.peer(r, reg.x_off) for r in range(R)])
    args.idx = arr([bufs.peer(r, reg.idx_off) for r in range(R)])
    args.w = arr(own_only(topk_weight.data_ptr()))
    args.out = arr(own_only(out.data_ptr()))
    args.combine = arr([bufs.peer(r, reg.combine_off) for r in range(R)])
    args.tpe = arr(own_only(tpe.data_ptr()))
    set_expert_weights(args, arrays, [w1], [w2], fp8, [0], L, H, F, device, dense=dense)
    bind_glu(args, glu)  # the SwiGLU variant (clamp / offset); None: plain
    bind_tuning(args, tuning)  # the config's forward tuning; None: the defaults
    args.signal = arr([bufs.peer(r, reg.signal_off) for r in range(R)])
    if fp8 is not None:  # this rank quantises its tokens once, peers pull them
        if not reg.fp8_sources:
            _fail("the FP8 forward quantises each token at its source: build the PeerBuffers with fp8_sources=True")
        args.xq = arr([bufs.peer(r, reg.xq_off) for r in range(R)])
        args.xs = arr([bufs.peer(r, reg.xs_off) for r in range(R)])
    if saved_h is not None:
        _check_tensor(saved_h, "saved_h", torch.bfloat16, 2, device)
        if saved_h.shape[0] < 1 or saved_h.shape[1] != 2 * F or not saved_h.is_contiguous():
            _fail(
                f"saved_h must be contiguous [rows >= 1, {2 * F}] (rows = owner capacity), got {tuple(saved_h.shape)}"
            )
        args.saved_h = arr(own_only(saved_h.data_ptr()))
        args.saved_h_rows = int(saved_h.shape[0])
    args.rank = rank
    args.epoch = (bufs.epoch + 1) & 0xFFFFFFFF or 1
    if timeline is not None:  # megatron_mok.kernel.timeline.Timeline
        if ctas > 0:
            grid = ctas
        else:
            n, ma, mi = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
            if lib.mok_device_info(args.device, ctypes.byref(n), ctypes.byref(ma), ctypes.byref(mi)) != 0:
                raise MokKernelError("cannot query the CUDA device")
            grid = n.value
        args.timeline, args.timeline_count, args.timeline_cap = timeline.prepare(grid, device)
    if keep is not None:
        keep.bind(args, 1, H, F, minibatch_tokens, device, _fail, fp8)
    nbytes = lib.mok_workspace_bytes(ctypes.byref(args))
    if nbytes < 0:
        _fail(f"invalid launch: {rejection(lib, args)}")
    if bufs.workspace is None or bufs.workspace.numel() < nbytes:
        bufs.workspace = torch.empty((max(nbytes, 1) + 4096,), dtype=torch.uint8, device=device)
    args.workspace = bufs.workspace.data_ptr()
    args.workspace_bytes = bufs.workspace.numel()
    args.err = bufs.err.data_ptr()

    ebuf = ctypes.create_string_buffer(1024)
    rc = lib.mok_forward_rank_launch(ctypes.byref(args), ctypes.c_void_p(stream.cuda_stream), ebuf, 1024)
    if rc != 0:
        raise MokKernelError(f"MoK rank {rank} launch failed: {ebuf.value.decode(errors='replace')}")
    if keep is not None:
        keep.filled = True  # this launch lays the rows out (stream-ordered before any backward)
    bufs.epoch = args.epoch
    if check == "lazy":
        _lazy_checker(args.device).after_launch(bufs.err, stream, R=R, L=L, timeout_ms=timeout_ms)
    elif check:
        check_rank_error(bufs, stream, L=L, timeout_ms=timeout_ms)
    return out, bufs.combine[:T], tpe


def check_rank_error(bufs: PeerBuffers, stream=None, *, L: int, timeout_ms: float) -> None:
    """Wait for the rank's last launch and raise MokKernelError if it recorded an error."""
    raise_rank_error(bufs.err, stream, lambda v: _error_message(v, bufs.world, L, timeout_ms))


def raise_rank_error(err: torch.Tensor, stream, message) -> None:
    """Synchronise ``stream`` (if given), then raise MokKernelError(message(record)) if the per-rank
    error record ``err`` (a launch's device int32[16]) holds an error. Shared by both kernels."""
    if stream is not None:
        stream.synchronize()
    raise_recorded_error({err.device.index: err}, err.device, message)
