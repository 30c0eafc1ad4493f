"""The CUDA megakernels behind :class:`~megatron_mok.function.MokMoEFunction`.

Forward: the fused MoK kernel (schedule, pull dispatch, expert FFN, push combine, weighted sum). Backward: the MoK
backward kernel (schedule, pull reverse-combine, fc1 recompute or the saved h, SwiGLU backward, dgrad, push
reverse-dispatch), then the wgrad kernel (fp32 expert weight gradients, or ``+=`` Megatron's main_grad; the router
gradient and the grad_x top-k sum), same stream, no host sync.

Every launch is one rank's launch: at EP 1 over plain tensors (``PeerBuffers.local``), at EP > 1 over torch
symmetric memory, one region per rank, the ranks meeting on signal pads inside the kernels (every EP rank must pass
the same token count). The path a multi-GPU run takes is the path a single GPU runs.

``dtype="fp8"`` (config ``kernel.dtype: fp8``): the FP8 forward kernel (e4m3, 1 x 128 activation / 128 x 128 weight
block scales; the expert weights quantised once per weight version, cached). With the saved fc1 output
(``kernel.save_fc1_output: true``, the default) the backward kernel runs its dgrad in FP8 too and its wgrad in
bf16; with fc1 recompute the backward is the bf16 kernel (recompute has no FP8 variant).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from . import env
from .plan import MokPlan


@dataclass
class KernelState:
    """What the kernel forward leaves its backward."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_w: torch.Tensor  # the router's top-k weights as the layer got them
    combine: torch.Tensor  # [T, K, H] the unweighted expert outputs (a copy at EP > 1: the region is reused)
    saved_h: torch.Tensor | None  # the owner's fc1 output in layout order, or None: the backward recomputes
    kept: object | None  # kernel.KeptRows: the expert input / SwiGLU rows (bf16), or None
    dtype: torch.dtype


pytree.register_dataclass(KernelState)  # its tensors are saved for the backward (function.MokMoEFunction)


class KernelBackend:
    name = "kernel"

    def __init__(
        self,
        comm_sms: int = 20,
        timeout_ms: float = 10000.0,
        check: bool | str | None = None,
        backward_comm_sms: int = 0,
        owner_capacity_factor: float = 0.0,
        dtype: str = "bf16",
        backward_minibatch_tokens: int = 0,
        tuning=None,
    ) -> None:
        if dtype not in ("bf16", "fp8"):
            raise ValueError(f"KernelBackend dtype must be 'bf16' or 'fp8', got {dtype!r}")
        self.dtype = dtype
        self._fp8_cache = None  # kernel.quant.Fp8WeightCache (dtype fp8)
        if comm_sms < 0 or backward_comm_sms < 0 or not (backward_comm_sms or comm_sms):
            raise ValueError(
                f"KernelBackend needs comm_sms >= 0 and backward_comm_sms >= 0, and backward_comm_sms >= 1 when "
                f"comm_sms is 0 (the in-SM pull is forward only), got {comm_sms} / {backward_comm_sms}"
            )
        self.comm_sms = comm_sms
        self.backward_comm_sms = backward_comm_sms or comm_sms  # the config resolves its default
        # the backward kernel's minibatch (config kernel.backward_minibatch_tokens); 0: the forward's ring
        self.backward_minibatch_tokens = backward_minibatch_tokens
        self.timeout_ms = timeout_ms
        self.tuning = tuning  # kernel.tuning.ForwardTuning of the config (None: the defaults)
        self.owner_capacity_factor = owner_capacity_factor  # config kernel.owner_capacity_factor (EP > 1)
        # "lazy" (default): no host sync; a kernel error is raised by the next MoK call.
        # MOK_DEBUG=sync: synchronise after every launch and raise at once (debugging).
        self.check = check if check is not None else (True if env.debug().sync else "lazy")
        self.last_backward: str | None = None
        self._peers = None  # kernel.PeerBuffers (EP 1: local; EP > 1: symmetric memory, per process group)

    @staticmethod
    def can_accumulate_main_grad(main_grads) -> bool:
        """backward(..., main_grads=(fc1 list, fc2 list)) can add the expert weight gradients straight
        into these Megatron main_grads (gradient-accumulation fusion) inside the wgrad kernel."""
        from .kernel.backward import wgrad_output_ok

        return all(m is not None and wgrad_output_ok(m) for m in main_grads)

    def _peer_buffers(self, tp, T: int, H: int, K: int, device):
        """This rank's PeerBuffers: EP 1 a local handle (error records), EP > 1 its symmetric region, reallocated
        (collectively: every rank sees the same T) when the call outgrows it."""
        from .kernel import PeerBuffers

        b = self._peers
        if tp.world_size == 1:
            if b is None or b.world != 1 or b.device != device:
                self._peers = b = PeerBuffers.local(device)
            return b
        srcq = self.dtype == "fp8"  # the FP8 forward pulls each rank's source-quantised copy from its region
        if (
            b is None
            or b.world == 1
            or b.region.tokens_cap < T
            or b.region.hidden != H
            or b.region.topk != K
            or b.region.fp8_sources != srcq
        ):
            group = getattr(tp, "group", None)
            if group is None:
                import torch.distributed as dist

                group = dist.group.WORLD
            cap = max(T, b.region.tokens_cap if b is not None and b.world > 1 else 0)
            self._peers = b = PeerBuffers.symmetric(group, cap, H, K, device, fp8_sources=srcq)
        return b

    def _fp8_weights(self, w1, w2, transposed: bool = False):
        """Fp8ExpertWeights of this rank's experts, or None for the bf16 kernel (``transposed``: with the FP8 dgrad's
        W^T copies, made once per weight version)."""
        if self.dtype != "fp8":
            return None
        from .kernel.errors import capturing
        from .kernel.quant import Fp8WeightCache, quantize_expert_weights

        if capturing():  # quantised inside the graph, so that every replay quantises the weights it reads then
            return quantize_expert_weights([list(w1)], [list(w2)], transposed=transposed)
        if self._fp8_cache is None:
            self._fp8_cache = Fp8WeightCache()
        return self._fp8_cache.experts([list(w1)], [list(w2)], transposed=transposed)

    def owner_rows(self, world: int, T: int, K: int) -> int:
        """Rows of an owner rank's row buffers at EP = world: every routed row (dropless worst case) or
        ceil(owner_capacity_factor * T * K) when that is smaller."""
        worst = max(1, world * T * K)
        if self.owner_capacity_factor <= 0:
            return worst
        return max(1, min(worst, math.ceil(self.owner_capacity_factor * T * K)))

    def forward(self, plan: MokPlan, x, topk_idx, topk_w, w1, w2) -> tuple[torch.Tensor, KernelState]:
        from .kernel import KeptRows, mok_forward

        world = plan.transport.world_size
        T, H = x.shape
        K = topk_idx.shape[1]
        F = w2[0].shape[1]
        bufs = self._peer_buffers(plan.transport, T, H, K, x.device)
        # save-vs-recompute (config kernel.save_fc1_output): the forward kernel keeps h = [gate | up] in layout
        # order and the backward skips fc1; the owner-side row buffers hold owner_rows rows (a routing that sends
        # this rank more is reported by the kernel: kernel.owner_capacity_factor)
        rows = self.owner_rows(world, T, K)
        saved_h = torch.empty((rows, 2 * F), dtype=torch.bfloat16, device=x.device) if plan.save_fc1_output else None
        keep = None
        if plan.save_expert_input and self.dtype == "bf16":  # config kernel.save_expert_input (bf16 kernel)
            keep = KeptRows.allocate(rows, H, F, plan.ring.minibatch_tokens, x.device)
        # the expert weights go as the Parameter objects themselves: the kernels only read their pointers, and the
        # FP8 weight cache is keyed by the objects (a fresh detached copy per call would never hit it)
        out, combine, _tpe = mok_forward(
            bufs,
            x.contiguous(),
            topk_idx,
            topk_w.float().contiguous(),
            list(w1),
            list(w2),
            comm_sms=self.comm_sms,
            ring_slots=plan.ring.ring_slots,
            minibatch_tokens=plan.ring.minibatch_tokens,
            timeout_ms=self.timeout_ms,
            check=self.check,
            saved_h=saved_h,
            fp8=self._fp8_weights(w1, w2),
            keep=keep,
            glu=plan.glu,
            tuning=self.tuning,
        )
        if world > 1:
            combine = combine.clone()  # the symmetric region is reused by the next layer call
        # the layer's own inputs, not views of them (inside the autograd node there is no graph to detach from): a
        # traced state may hold inputs, not intermediates aliasing them
        return out, KernelState(x, topk_idx, topk_w, combine, saved_h, keep, x.dtype)

    def backward(self, plan: MokPlan, state: KernelState, grad_out, w1, w2, main_grads=None):
        """main_grads: (fc1 main_grads, fc2 main_grads) fp32 to add the weight gradients into (then those are
        returned as the weight gradients), or None."""
        from .kernel import check_pending_errors, mok_backward

        # finished launches' error records (forward and earlier backwards), without waiting: the host keeps
        # queueing ahead; a failed launch surfaces at the latest at the next MoK call
        check_pending_errors()
        mg1, mg2 = main_grads if main_grads is not None else (None, None)
        world = plan.transport.world_size
        T, H = state.x.shape
        K = state.topk_idx.shape[1]
        fp8 = self._fp8_weights(w1, w2, transposed=True) if state.saved_h is not None else None
        gx, gw, gw1, gw2 = mok_backward(
            self._peers,
            grad_out.contiguous().to(state.dtype),
            state.x.contiguous(),
            state.topk_idx,
            state.topk_w.float().contiguous(),
            state.combine,
            list(w1),
            list(w2),
            comm_sms=self.backward_comm_sms,
            ring_slots=plan.ring.ring_slots,
            minibatch_tokens=self.backward_minibatch_tokens or plan.ring.minibatch_tokens,
            timeout_ms=self.timeout_ms,
            wgrad="kernel",
            saved_h=state.saved_h,
            owner_rows=self.owner_rows(world, T, K),
            main_grad_w1=None if mg1 is None else list(mg1),
            main_grad_w2=None if mg2 is None else list(mg2),
            check=self.check,
            fp8=fp8,
            kept=state.kept,
            glu=plan.glu,
        )
        if not torch.compiler.is_compiling():  # (a traced backward may not change its backend object)
            self.last_backward = "kernel" + (" (fp8 dgrad)" if fp8 is not None else "")
        return gx, gw, gw1, gw2
