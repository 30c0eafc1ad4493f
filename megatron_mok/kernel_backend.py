"""The CUDA megakernels behind :class:`~megatron_mok.reference.MokMoEFunction`.

Forward: the fused MoK kernel (schedule, pull dispatch, expert FFN, push combine, weighted sum).
Backward: the MoK backward kernel (schedule, pull reverse-combine of output gradients and input rows,
router-weight gradient, fc1 recompute + SwiGLU backward + dgrad, push reverse-dispatch, top-k sum),
then the expert weight gradients as per-expert fp32 GEMMs on the layout-order buffers it leaves.
``MOK_BACKWARD=reference`` runs the reference backward algorithm on the GPU instead.
"""

from __future__ import annotations

import os

import torch

from .layout import compute_layout, num_minibatches
from .reference import MokPlan, mok_backward


class KernelBackend:
    name = "kernel"

    def __init__(self, comm_sms: int = 20, timeout_ms: float = 10000.0, check: bool | str | None = None) -> None:
        self.comm_sms = comm_sms
        self.timeout_ms = timeout_ms
        # "lazy" (default): no host sync; a kernel error is raised by the next MoK call or in backward.
        # MOK_SYNC_CHECK=1: synchronise after every launch and raise at once (debugging).
        self.check = check if check is not None else (True if os.environ.get("MOK_SYNC_CHECK") == "1" else "lazy")
        self.last_backward: str | None = None

    def forward(self, plan: MokPlan, x, topk_idx, topk_w, w1, w2):
        from . import kernel

        tp = plan.transport
        if tp.world_size != 1:
            raise RuntimeError("the MoK kernel backend runs EP=1 per process until symmetric-memory EP is wired")
        T, H = x.shape
        K = topk_idx.shape[1]
        out, combine, _tpe = kernel.mok_forward_emulated(
            [x.detach().contiguous()],
            [topk_idx.to(torch.int32).contiguous()],
            [topk_w.detach().float().contiguous()],
            [[w.detach() for w in w1]],
            [[w.detach() for w in w2]],
            comm_sms=self.comm_sms,
            ring_slots=plan.ring.ring_slots,
            minibatch_tokens=plan.ring.minibatch_tokens,
            timeout_ms=self.timeout_ms,
            check=self.check,
        )
        # Nothing here reads device values on the host (errors are checked lazily): the layout the
        # interim backward needs is
        # rebuilt in backward, so the forward stays free of host synchronisation.
        state = {
            "x": x.detach(),
            "topk_idx": topk_idx,
            "all_w": [topk_w.detach().float()],
            "combine_buf": combine[0].view(T, K, H),
            "saved_h": None,  # recomputed in backward
            "shape": (T, K, H),
            "dtype": x.dtype,
        }
        return out[0], state

    def backward(self, plan, state, grad_out, w1, w2):
        from . import kernel

        kernel.check_pending_errors(wait=True)  # the forward's error record, before using its output
        from .kernel import backward as bwd

        if os.environ.get("MOK_BACKWARD", "kernel") != "reference" and bwd.is_available():
            T, K, H = state["shape"]
            gx, gw, gw1, gw2 = bwd.mok_backward_emulated(
                [grad_out.contiguous().to(state["dtype"])],
                [state["x"].contiguous()],
                [state["topk_idx"].to(torch.int32).contiguous()],
                [state["all_w"][0].contiguous()],
                [state["combine_buf"]],
                [[w.detach() for w in w1]],
                [[w.detach() for w in w2]],
                comm_sms=self.comm_sms,
                ring_slots=plan.ring.ring_slots,
                minibatch_tokens=plan.ring.minibatch_tokens,
                timeout_ms=self.timeout_ms,
                wgrad="mm",
            )
            self.last_backward = "kernel"
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
        return mok_backward(plan, state, grad_out, w1, w2)
