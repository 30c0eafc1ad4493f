"""``MoKTokenDispatcher``: Megatron-Core token dispatcher for ``moe_token_dispatcher_type="mok"``.

Two modes:

* **fused** (default with SwiGLU experts): the MoK layer calls :meth:`fused_experts`, which runs
  dispatch, the expert FFN on Megatron's own expert weights, and combine as one operation
  (the CUDA megakernel, or the PyTorch reference). ``token_dispatch``/``token_combine`` pass
  tokens through untouched.
* **unfused**: a plain Megatron dispatcher -- MoK's pull dispatch hands rows grouped per local
  expert to any Megatron expert module, and MoK's push combine returns them. Used when the
  experts are not a SwiGLU FFN MoK can fuse.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from .activation import PLAIN, Glu
from .backend import requested_backend, select_backend
from .compat import check_megatron_settings
from .config import MokConfig, resolve_config
from .experts import expert_weights
from .function import MokBackend, mok_moe
from .kernel import routing as kernel_routing
from .layout import ExpertLayout, compute_layout, topk_from_routing_map, validate_routing
from .plan import MokPlan, RingSpec
from .reference import PullRows, PushRows
from .transport import ProcessGroupTransport, Transport

logger = logging.getLogger(__name__)


_CHECKED_GROUPS: set[int] = set()


def _check_topology_once(group) -> None:
    """All EP ranks must share one NVLink domain (a collective, once per group)."""
    from .topology import check_ep_group

    key = id(group)
    if key not in _CHECKED_GROUPS:
        check_ep_group(group)
        _CHECKED_GROUPS.add(key)


class MoKTokenDispatcher(MoETokenDispatcher):
    """Pull-dispatch / push-combine token dispatcher of MoK (see module docstring)."""

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config: Any,
        pg_collection: Any = None,
    ) -> None:
        check_megatron_settings(config)
        super().__init__(config=config, pg_collection=pg_collection)
        if self.tp_size != 1:
            raise ValueError(
                f"MoK needs expert_tensor_parallel_size=1 (got {self.tp_size}): each expert lives whole on one rank"
            )
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        if self.num_experts % self.ep_size:
            raise ValueError(f"num_moe_experts={self.num_experts} is not divisible by EP size {self.ep_size}")
        expected = list(range(self.ep_rank * num_local_experts, (self.ep_rank + 1) * num_local_experts))
        if self.local_expert_indices != expected:
            raise ValueError(
                f"MoK expects EP rank {self.ep_rank} to own experts {expected[0]}..{expected[-1]}, "
                f"got {self.local_expert_indices}"
            )
        self.mok_config: MokConfig = resolve_config(config, self.ep_size)
        if self.ep_size > 1:
            _check_topology_once(self.ep_group)
        self.fused = True
        #: the SwiGLU variant of the fused path (set by the MoK layer from Megatron's config)
        self.glu: Glu | None = PLAIN
        self._transport: Transport | None = None
        self._backend: tuple[tuple, MokBackend] | None = None  # (what the choice read, the backend)
        self.cudagraph_attrs = ["topk_idx"]
        # per-call state
        self.hidden_shape: torch.Size | None = None
        self.topk_idx: torch.Tensor | None = None
        self._topk_form = False  # this call's routing came as top-k ids (not a dense map)
        self.layout: ExpertLayout | None = None
        self.last_plan: MokPlan | None = None
        self.last_backend: str | None = None

    # ---- helpers --------------------------------------------------------------------------
    @property
    def transport(self) -> Transport:
        if self._transport is None:
            self._transport = ProcessGroupTransport(self.ep_group)
        return self._transport

    @transport.setter
    def transport(self, value: Transport) -> None:
        self._transport = value

    def plan(self) -> MokPlan:
        """The plan of this layer's calls: ring, saved tensors, gradient-accumulation fusion, SwiGLU variant."""
        k = self.mok_config.kernel
        return MokPlan(
            transport=self.transport,
            num_experts=self.num_experts,
            ring=RingSpec(k.minibatch_tokens, k.ring_slots),
            save_fc1_output=k.save_fc1_output,
            save_expert_input=k.save_expert_input,
            fuse_wgrad_into_main_grad=bool(getattr(self.config, "gradient_accumulation_fusion", False)),
            glu=self.glu if self.glu is not None else PLAIN,
        )

    # ---- MoETokenDispatcher interface ---------------------------------------------------------
    def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """[S, B, H] tokens + routing -> [T, H] tokens and top-k weights [T, K] (local only).

        The routing is Megatron's dense form (a bool or 0/1 ``routing_map`` and ``probs`` [T, E]), or the top-k form a
        router gives with ``dense_output`` (int32 / int64 expert ids and their probabilities, both [T, K]): taken as
        they are, without the conversion from the dense map."""
        self.hidden_shape = tokens.shape
        if tokens.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"MoK input hidden size {tokens.shape[-1]} != config hidden_size {self.config.hidden_size}"
            )
        hidden = tokens.reshape(-1, tokens.shape[-1])
        num_tokens = hidden.shape[0]
        self._topk_form = routing_map.dtype in (torch.int32, torch.int64)
        if self._topk_form:
            if routing_map.shape != (num_tokens, self.topk) or probs.shape != routing_map.shape:
                raise ValueError(
                    f"top-k routing (int32 / int64 expert ids): ids {tuple(routing_map.shape)} and probs "
                    f"{tuple(probs.shape)} must both be [tokens={num_tokens}, topk={self.topk}]"
                )
            # ids are range-checked where they are used: by the fused backend, and by token_dispatch below
            idx, weights = routing_map, probs
        elif routing_map.shape != (num_tokens, self.num_experts):
            raise ValueError(
                f"routing_map shape {tuple(routing_map.shape)} != [tokens={num_tokens}, experts={self.num_experts}] "
                "(a dense map is bool or 0/1; top-k expert ids are int32 / int64 [tokens, topk])"
            )
        elif self.fused and kernel_routing.runs_on_device(routing_map, probs):  # the unfused path builds no kernel
            idx, weights = kernel_routing.topk_from_routing_map(routing_map, probs, self.topk)
        else:
            idx, weights = topk_from_routing_map(routing_map, probs, self.topk)
        self.topk_idx = idx
        return hidden, weights

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.fused:
            return hidden_states, probs  # the fused op pulls inside the kernel
        tp = self.transport
        assert self.topk_idx is not None, "dispatch_preprocess must run before token_dispatch"
        if self._topk_form:  # a router's own ids: this path lays out only this rank's experts, and would drop others
            validate_routing(self.topk_idx, self.num_experts, "the router's top-k expert ids")
        all_idx = tp.all_gather(self.topk_idx)
        self.layout = compute_layout(all_idx, tp.rank, self.num_local_experts)
        k = self.topk
        rows = PullRows.apply(hidden_states, self.layout, tp, lambda t, _k: t)
        flat_probs = probs.reshape(-1, 1)
        permuted_probs = PullRows.apply(flat_probs, self.layout, tp, lambda t, kk: t * k + kk).reshape(-1)
        self._num_tokens = hidden_states.shape[0]
        return rows, permuted_probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.fused:
            raise RuntimeError("MoKTokenDispatcher is in fused mode: the MoK layer runs the experts itself")
        assert self.layout is not None
        return hidden_states, self.layout.tokens_per_expert.cpu(), probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return hidden_states
        assert self.layout is not None
        dest = PushRows.apply(hidden_states, self.layout, self.transport, self.topk, self._num_tokens)
        # Megatron's experts already scaled each row by its router weight: a plain top-k sum.
        return dest.view(self._num_tokens, self.topk, -1).sum(1)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        assert self.hidden_shape is not None
        return hidden_states.view(self.hidden_shape)

    # ---- the fused path ----------------------------------------------------------------------
    def backend_for(self, hidden_states: torch.Tensor, fc2_weight: torch.Tensor) -> MokBackend:
        """The backend that runs this layer's call: the kernel (one per setting, shared by every MoK layer) where it
        can, else the reference (with its reason). Chosen again only when what the choice reads changes (it runs in
        front of every layer call)."""
        key = (
            hidden_states.device,
            hidden_states.dtype,
            self.transport.world_size,
            tuple(fc2_weight.shape),
            requested_backend(),
        )
        if self._backend is None or self._backend[0] != key:
            self._backend = (key, self._select_backend(hidden_states, fc2_weight))
        return self._backend[1]

    def _select_backend(self, hidden_states: torch.Tensor, fc2_weight: torch.Tensor) -> MokBackend:
        k = self.mok_config.kernel
        return select_backend(
            hidden_states.device,
            self.transport.world_size,
            k.dtype,
            hidden_states.dtype,
            hidden=fc2_weight.shape[0],
            ffn=fc2_weight.shape[1],
            comm_sms=k.comm_sms,
            timeout_ms=k.timeout_ms,
            backward_comm_sms=k.bwd_comm_sms,
            owner_capacity_factor=k.owner_capacity_factor,
            backward_minibatch_tokens=k.bwd_minibatch_tokens,
            tuning=k.forward_tuning,
        )

    def fused_experts(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, experts: torch.nn.Module):
        """Dispatch + expert FFN + combine in one MoK operation; returns [T, H] (combined)."""
        assert self.topk_idx is not None, "dispatch_preprocess must run before fused_experts"
        # routing indices are validated by the backend: on the device by the kernel, on the host by the
        # reference (a host check here would synchronise every layer call)
        w1, w2 = expert_weights(experts)
        plan = self.plan()
        backend = self.backend_for(hidden_states, w2[0])
        out = mok_moe(hidden_states, self.topk_idx, topk_weights, w1, w2, plan, backend)
        self.last_plan = plan
        if backend.name != self.last_backend:  # once per layer and backend change: which path trains
            reason = getattr(backend, "reason", None)
            # a GPU run on the reference is worth a warning (the kernel was expected); on CPU it is the only one
            log = logger.warning if hidden_states.is_cuda and reason is not None else logger.info
            log(
                "MoK layer: %s backend (EP %d, %s)%s", backend.name, self.transport.world_size,
                self.mok_config.kernel.dtype,
                f": {reason}" if reason else "",
            )  # fmt: skip
            warning = self.mok_config.kernel_warning() if backend.name == "kernel" else None
            if warning is not None:
                logger.warning("MoK: %s", warning)
        self.last_backend = backend.name
        return out
