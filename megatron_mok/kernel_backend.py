"""The CUDA megakernels behind :class:`~megatron_mok.reference.MokMoEFunction`.

Forward: the fused MoK kernel (schedule, pull dispatch, expert FFN, push combine, weighted sum).
Backward: the MoK backward kernel (schedule, pull reverse-combine of output gradients and input rows,
router-weight gradient, fc1 recompute + SwiGLU backward + dgrad, push reverse-dispatch, top-k sum),
then the wgrad kernel (fp32 expert weight gradients from the layout-order buffers it leaves, same
stream, no host sync). Where the backward library cannot be loaded, the reference backward algorithm runs on
the GPU instead.

``dtype="fp8"`` (config ``kernel.dtype: fp8``): the FP8 forward kernel (e4m3, 1 x 128 activation /
128 x 128 weight block scales; the expert weights quantised once per weight version, cached). With the
saved fc1 output (``kernel.save_fc1_output: true``, the default) the backward kernel runs its dgrad in
FP8 too (gy and dH quantised inside it, the cached weights' transposed e4m3 copies) and its wgrad in
bf16; with fc1 recompute the backward is the bf16 kernel (recompute has no FP8 variant).

EP > 1 (one process per GPU, NCCL group): both kernels are launched per rank over torch symmetric
memory (``kernel.peer_ep.mok_forward_rank``, ``kernel.backward.mok_backward_rank``); the ranks meet on
signal pads inside the kernels. Every EP rank must pass the same token count.
"""

from __future__ import annotations

import math

import torch

from . import env
from .layout import compute_layout, num_minibatches
from .reference import MokPlan, mok_backward, pull_into


class KernelBackend:
    name = "kernel"

    @staticmethod
    def can_accumulate_main_grad(main_grads) -> bool:
        """backward(..., main_grads=(fc1 list, fc2 list)) can add the expert weight gradients straight
        into these Megatron main_grads (gradient-accumulation fusion) inside the wgrad kernel."""
        from .kernel.backward import wgrad_output_ok

        return all(m is not None and wgrad_output_ok(m) for m in main_grads)

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
        self.tuning = tuning  # kernel.host.cargs.ForwardTuning of the config (None: the defaults)
        self.owner_capacity_factor = owner_capacity_factor  # config kernel.owner_capacity_factor (EP > 1)
        # "lazy" (default): no host sync; a kernel error is raised by the next MoK call or in backward.
        # MOK_DEBUG=sync: synchronise after every launch and raise at once (debugging).
        self.check = check if check is not None else (True if env.debug().sync else "lazy")
        self.last_backward: str | None = None
        self._peers = None  # kernel.PeerBuffers of EP > 1 (symmetric memory, per process group)

    def _peer_buffers(self, tp, T: int, H: int, K: int, device):
        from .kernel import PeerBuffers

        b = self._peers
        # the FP8 forward pulls each rank's source-quantised copy from its region
        srcq = self.dtype == "fp8"
        if (
            b is None
            or b.region.tokens_cap < T
            or b.region.hidden != H
            or b.region.topk != K
            or b.region.fp8_sources != srcq
        ):
            # collective over the EP group: every rank sees the same T (required) and so re-allocates together
            group = getattr(tp, "group", None)
            if group is None:
                import torch.distributed as dist

                group = dist.group.WORLD
            cap = max(T, b.region.tokens_cap if b is not None else 0)
            self._peers = b = PeerBuffers.symmetric(group, cap, H, K, device, fp8_sources=srcq)
        return b

    def _fp8_weights(self, w1, w2, transposed: bool = False):
        """Fp8ExpertWeights of one owner's experts (as a one-rank list), or None for the bf16 kernel
        (``transposed``: with the FP8 dgrad's W^T copies, made once per weight version)."""
        if self.dtype != "fp8":
            return None
        from .kernel.quant import Fp8WeightCache

        if self._fp8_cache is None:
            self._fp8_cache = Fp8WeightCache()
        return self._fp8_cache.experts([list(w1)], [list(w2)], transposed=transposed)

    def _fp8_dgrad_weights(self, state, w1, w2):
        """The FP8 dgrad's weights when it applies (dtype fp8 and the forward kept h), else None."""
        if state.get("kernel_saved_h") is None:
            return None
        return self._fp8_weights(w1, w2, transposed=True)

    def _kept_rows(self, plan: MokPlan, parts: int, rows: int, H: int, F: int, device):
        """The forward's kept expert input / SwiGLU rows (config kernel.save_expert_input), bf16 kernel
        only; like saved h they live as long as the autograd state."""
        from .kernel import KeptRows

        if not plan.save_expert_input or self.dtype != "bf16":
            return None
        return KeptRows.allocate(parts, rows, H, F, plan.ring.minibatch_tokens, device)

    def owner_rows(self, world: int, T: int, K: int) -> int:
        """Rows of an owner rank's row buffers at EP = world: every routed row (dropless worst case) or
        ceil(owner_capacity_factor * T * K) when that is smaller."""
        worst = max(1, world * T * K)
        if self.owner_capacity_factor <= 0:
            return worst
        return max(1, min(worst, math.ceil(self.owner_capacity_factor * T * K)))

    def _forward_peer(self, plan: MokPlan, x, topk_idx, topk_w, w1, w2):
        from .kernel import mok_forward_rank

        tp = plan.transport
        T, H = x.shape
        K = topk_idx.shape[1]
        bufs = self._peer_buffers(tp, T, H, K, x.device)
        F = w2[0].shape[1]
        # save-vs-recompute as at EP = 1; the owner-side row buffers hold owner_rows rows (a routing that
        # sends this rank more is reported by the kernel: kernel.owner_capacity_factor)
        owner_rows = self.owner_rows(tp.world_size, T, K)
        saved_h = (
            torch.empty((owner_rows, 2 * F), dtype=torch.bfloat16, device=x.device) if plan.save_fc1_output else None
        )
        keep = self._kept_rows(plan, 1, owner_rows, H, F, x.device)
        # the expert weights go as the Parameter objects themselves, not .detach() copies (here and in the
        # other launches): the kernels only read their pointers, and the launches' weight-check memo
        # (kernel/host/weight_memo.py) is keyed by the objects -- a fresh detached copy per call never hit it
        out, combine, _tpe = mok_forward_rank(
            bufs,
            x.detach().contiguous(),
            topk_idx,
            topk_w.detach().float().contiguous(),
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
        state = {
            "x": x.detach(),
            "topk_idx": topk_idx,
            "kernel_kept": keep,
            "all_w": None,  # gathered by the reference fallback
            "combine_buf": combine.clone(),  # the symmetric buffer is reused by the next layer call
            "saved_h": None,  # the reference fallback recomputes
            "kernel_saved_h": saved_h,
            "shape": (T, K, H),
            "dtype": x.dtype,
            "peer": True,
        }
        return out, state

    def _backward_peer(self, plan: MokPlan, state, grad_out, w1, w2, mg1=None, mg2=None):
        """EP > 1: the backward kernel launched per rank over the same symmetric buffers."""
        from .kernel.backward import is_available, mok_backward_rank

        if not is_available():
            gx, gw, gw1, gw2 = self._backward_peer_reference(plan, state, grad_out, w1, w2)
            return _add_into(mg1, mg2, gx, gw, gw1, gw2)
        T, K, H = state["shape"]
        gx, gw, gw1, gw2 = mok_backward_rank(
            self._peers,
            grad_out.contiguous().to(state["dtype"]),
            state["x"].contiguous(),
            state["topk_idx"],
            state["topk_w_f32"],
            state["combine_buf"],
            list(w1),
            list(w2),
            comm_sms=self.backward_comm_sms,
            ring_slots=plan.ring.ring_slots,
            minibatch_tokens=self.backward_minibatch_tokens or plan.ring.minibatch_tokens,
            timeout_ms=self.timeout_ms,
            wgrad="kernel",
            saved_h=state.get("kernel_saved_h"),
            owner_rows=self.owner_rows(self._peers.world, T, K),
            main_grad_w1=mg1,
            main_grad_w2=mg2,
            check=self.check,
            fp8=(f8 := self._fp8_dgrad_weights(state, w1, w2)),
            kept=state.get("kernel_kept"),
            glu=plan.glu,
        )
        self.last_backward = "kernel (EP > 1, per-rank launch" + (", fp8 dgrad)" if f8 is not None else ")")
        return gx, gw, gw1, gw2

    def _backward_peer_reference(self, plan: MokPlan, state, grad_out, w1, w2):
        """Reference backward over the process group, after rebuilding what the kernel forward kept on
        the device (routing of every rank, layout, the pulled x rows)."""
        tp = plan.transport
        all_idx = tp.all_gather(state.pop("topk_idx").long())
        state["all_w"] = tp.all_gather(state.pop("topk_w_f32"))
        layout = compute_layout(all_idx, tp.rank, plan.num_local_experts)
        plan.layout = layout
        n = layout.num_rows
        x = state.pop("x")
        saved_x = torch.empty((n, x.shape[1]), dtype=x.dtype, device=x.device)
        pull_into(tp, x, layout.src_rank, layout.src_token, saved_x)
        state.update(
            layout=layout, saved_x=saved_x, rounds=tp.all_reduce_max(num_minibatches(n, plan.ring.minibatch_tokens))
        )
        self.last_backward = "reference (EP > 1)"
        return mok_backward(plan, state, grad_out, w1, w2)

    def forward(self, plan: MokPlan, x, topk_idx, topk_w, w1, w2):
        from . import kernel

        tp = plan.transport
        if tp.world_size != 1:
            out, state = self._forward_peer(plan, x, topk_idx, topk_w, w1, w2)
            state["topk_w_f32"] = topk_w.detach().float()
            return out, state
        T, H = x.shape
        K = topk_idx.shape[1]
        F = w2[0].shape[1]
        # save-vs-recompute (config kernel.save_fc1_output): the forward kernel keeps h = [gate | up] in
        # layout order (every routed row of this rank: T * K at EP = 1) and the backward skips fc1
        saved_h = (
            [torch.empty((max(1, T * K), 2 * F), dtype=torch.bfloat16, device=x.device)]
            if plan.save_fc1_output
            else None
        )
        keep = self._kept_rows(plan, 1, T * K, H, F, x.device)
        out, combine, _tpe = kernel.mok_forward_emulated(
            [x.detach().contiguous()],
            [topk_idx.to(torch.int32).contiguous()],
            [topk_w.detach().float().contiguous()],
            [list(w1)],
            [list(w2)],
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
        # Nothing here reads device values on the host (errors are checked lazily): the layout the
        # interim backward needs is
        # rebuilt in backward, so the forward stays free of host synchronisation.
        state = {
            "x": x.detach(),
            "topk_idx": topk_idx,
            "all_w": [topk_w.detach().float()],
            "combine_buf": combine[0].view(T, K, H),
            "saved_h": None,  # the reference fallback recomputes
            "kernel_saved_h": saved_h,  # bf16 h kept by the forward kernel, or None: the kernel recomputes
            "kernel_kept": keep,  # expert input / SwiGLU rows kept by the forward kernel (bf16), or None
            "shape": (T, K, H),
            "dtype": x.dtype,
        }
        return out[0], state

    def backward(self, plan, state, grad_out, w1, w2, main_grads=None):
        """main_grads: (fc1 main_grads, fc2 main_grads) fp32 to add the weight gradients into (then
        those are returned as the weight gradients), or None. Every path adds them: the wgrad kernel
        itself, the reference fallbacks through _add_into."""
        from . import kernel

        # finished launches' error records (forward and earlier backwards), without waiting: the host
        # keeps queueing ahead; a failed launch surfaces at the latest at the next MoK call
        kernel.check_pending_errors()
        mg1, mg2 = main_grads if main_grads is not None else (None, None)
        if state.get("peer"):
            return self._backward_peer(plan, state, grad_out, w1, w2, mg1, mg2)
        from .kernel import backward as bwd

        if bwd.is_available():
            T, K, H = state["shape"]
            gx, gw, gw1, gw2 = bwd.mok_backward_emulated(
                [grad_out.contiguous().to(state["dtype"])],
                [state["x"].contiguous()],
                [state["topk_idx"].to(torch.int32).contiguous()],
                [state["all_w"][0].contiguous()],
                [state["combine_buf"]],
                [list(w1)],
                [list(w2)],
                comm_sms=self.backward_comm_sms,
                ring_slots=plan.ring.ring_slots,
                minibatch_tokens=self.backward_minibatch_tokens or plan.ring.minibatch_tokens,
                timeout_ms=self.timeout_ms,
                wgrad="kernel",
                saved_h=state.get("kernel_saved_h"),
                main_grad_w1=None if mg1 is None else [list(mg1)],
                main_grad_w2=None if mg2 is None else [list(mg2)],
                check=self.check,
                fp8=(f8 := self._fp8_dgrad_weights(state, w1, w2)),
                kept=state.get("kernel_kept"),
                glu=plan.glu,
            )
            self.last_backward = "kernel (fp8 dgrad)" if f8 is not None else "kernel"
            return gx[0], gw[0], gw1[0], gw2[0]
        # fallback: the reference backward algorithm on the GPU
        layout = compute_layout([state.pop("topk_idx").long()], 0, plan.num_local_experts)
        plan.layout = layout
        n = layout.num_rows
        plan.stats = {"rows": n, "minibatches": num_minibatches(n, plan.ring.minibatch_tokens)}
        state["layout"] = layout
        state["saved_x"] = state.pop("x")[layout.src_token]
        state["rounds"] = plan.stats["minibatches"]
        self.last_backward = "reference"
        return _add_into(mg1, mg2, *mok_backward(plan, state, grad_out, w1, w2))


def _add_into(mg1, mg2, gx, gw, gw1, gw2):
    """Fallback paths when main_grads were requested: add the returned weight gradients into them."""
    if mg1 is None:
        return gx, gw, gw1, gw2
    for mg, gs in ((mg1, gw1), (mg2, gw2)):
        for m, g in zip(mg, gs):
            m.add_(g.to(m.dtype))
    return gx, gw, list(mg1), list(mg2)
