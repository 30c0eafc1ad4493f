"""Peer memory of the MoK kernels: the symmetric region every EP rank exposes, and one rank's handle on all of them.

Every launch is one rank's launch (``forward.mok_forward``, ``backward.mok_backward``). At EP 1 the rank reads its
tensors in place and needs no region (:meth:`PeerBuffers.local`). At EP > 1 what peers touch lives in one symmetric
allocation per rank (:class:`PeerRegion`):

  x        [cap, H]     bf16   home rank's token rows; owners *pull* the rows they need
  topk_idx [cap, K]     int32  home rank's routing; every owner reads it to build its schedule
  combine  [cap, K, H]  bf16   forward: owners *push* expert outputs into the home rank's rows;
                               backward: the same bytes receive the pushed input-row gradients (grad_buf)
  topk_w   [cap, K]     fp32   backward: owners scale the pulled output gradients by it
  grad_out [cap, H]     bf16   backward: home rank's output gradient; owners *pull* the rows they need
  signal   [4, 72]      uint32 start / compute-done / token-count / source-quantised slots, written with
                               the call's epoch
  xq, xs   [cap, H] e4m3, [cap, H / 128] fp32 (``fp8_sources`` regions only): the home rank's tokens
                               quantised once by its FP8 launch; owners pull e4m3 rows from there

Peer addresses come from torch symmetric memory (``symm_mem.empty`` + ``rendezvous``: ``buffer_ptrs[r]``) and
enter the operators as integers (``peer_bases`` + the region's offsets); :meth:`PeerBuffers.on_one_gpu` builds the
same regions for several ranks on one GPU, so tests run real per-rank launches (on separate streams, meeting only
through signal pads) without a multi-GPU machine.

Contract at EP > 1: every rank calls the forward (and backward) once per layer call, in the same order, with the
same token count (checked in the kernel: a mismatch or a rank that never arrives is a clear MokKernelError naming
the rank). No host synchronisation; the epoch counter lives on the host. Weights stay local.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import errors
from .ops import MOK_MAX_RANKS

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
    """One rank's handle on every rank's :class:`PeerRegion` (its own as tensors, peers as base addresses), its
    launches' error records and its call counter. At EP 1 (:meth:`local`) there is no region."""

    def __init__(self, rank: int, world: int, region: PeerRegion, local: torch.Tensor, ptrs: list[int]) -> None:
        if not 2 <= world <= MOK_MAX_RANKS:
            raise ValueError(f"EP world size {world} out of [2, {MOK_MAX_RANKS}] (EP 1: PeerBuffers.local)")
        if not 0 <= rank < world or len(ptrs) != world:
            raise ValueError(f"rank {rank} / {len(ptrs)} peer pointers do not match world size {world}")
        if local.dtype != torch.uint8 or local.numel() < region.nbytes or not local.is_cuda:
            raise ValueError(f"local region must be a CUDA uint8 tensor of >= {region.nbytes} bytes")
        self.rank, self.world, self.region, self.ptrs = rank, world, region, list(ptrs)
        self.device = local.device
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
        self.err = errors.new_record(local.device)  # the forward launches' error record
        self.bwd_err = errors.new_record(local.device)  # the backward launches' (dgrad, then wgrad)

    @classmethod
    def local(cls, device=None) -> PeerBuffers:
        """EP 1: no peers and no region (the launch reads its tensors in place); error records and nothing else."""
        self = cls.__new__(cls)
        device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.rank, self.world, self.region, self.ptrs, self.device = 0, 1, None, [], device
        self.epoch = 0
        self.err, self.bwd_err = errors.new_record(device), errors.new_record(device)
        return self

    def next_epoch(self) -> int:
        """The epoch of the next call (EP > 1: the signal value every rank waits for; EP 1: 0, none is waited on)."""
        return 0 if self.world == 1 else (self.epoch + 1) & 0xFFFFFFFF or 1

    def publish(self, who: str, T: int, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """EP > 1: put this call's ``inputs`` (by name: x, grad_out [T, H]; topk_idx, topk_weight [T, K]) where peers
        read them, after checking they fit this region (one ValueError naming the input otherwise); an input the
        caller wrote there already is not copied. Returns the region's views [T, ...] by name."""
        reg = self.region
        if T > reg.tokens_cap:
            raise ValueError(
                f"{who}: {T} tokens exceed the peer buffers' capacity of {reg.tokens_cap}: rebuild PeerBuffers larger"
            )
        fields = {
            "x": (self.x, reg.hidden),
            "grad_out": (self.grad_out, reg.hidden),
            "topk_idx": (self.idx, reg.topk),
            "topk_weight": (self.topk_w, reg.topk),
        }
        views = {}
        for name, t in inputs.items():
            dst, cols = fields[name]
            if tuple(t.shape) != (T, cols):
                raise ValueError(
                    f"{who}: {name} must be [{T}, {cols}] (the peer buffers were built for H={reg.hidden}, "
                    f"K={reg.topk}), got {list(t.shape)}"
                )
            if t.data_ptr() != dst.data_ptr() or t.dtype != dst.dtype:
                dst[:T].copy_(t)
            views[name] = dst[:T]
        return views

    def forward_offsets(self) -> list[int]:
        """The region offsets the forward operator reads peers at (csrc/mok/apis/forward.cpp: ForwardOffset)."""
        r = self.region
        return [r.x_off, r.idx_off, r.combine_off, r.signal_off, r.xq_off, r.xs_off]

    def backward_offsets(self) -> list[int]:
        """The region offsets the backward operator reads peers at (csrc/mok/apis/backward.cpp: BackwardOffset)."""
        r = self.region
        return [r.x_off, r.idx_off, r.topk_w_off, r.grad_out_off, r.combine_off, r.signal_off]

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
        if dist.get_world_size(group) == 1:
            return cls.local(device)
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
        if world == 1:
            return [cls.local(device)]
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
