"""``MokMoELayer``: Megatron's ``MoELayer`` with the MoK dispatcher and the fused expert path.

The class only changes how the layer is built (a MoK dispatcher instead of Megatron's
hard-coded choice) and ``routed_experts_compute``; routers, experts, shared experts, state dict
keys and checkpoint layout are Megatron's own.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from .dispatcher import MoKTokenDispatcher
from .experts import fused_unsupported_reason

logger = logging.getLogger(__name__)

#: Placeholder Megatron builds first (its constructor is cheap, host-only and comm-free).
_PLACEHOLDER_DISPATCHER = "allgather"


class MokMoELayer(MoELayer):
    def __init__(
        self,
        config: Any,
        submodules: Any = None,
        layer_number: int | None = None,
        pg_collection: Any = None,
        is_mtp_layer: bool = False,
        name: str | None = None,
    ) -> None:
        requested = config.moe_token_dispatcher_type
        if requested != "mok":
            raise ValueError(f"MokMoELayer needs moe_token_dispatcher_type='mok', got {requested!r}")
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        config.moe_token_dispatcher_type = _PLACEHOLDER_DISPATCHER
        try:
            super().__init__(
                config=config,
                submodules=submodules,
                layer_number=layer_number,
                pg_collection=pg_collection,
                is_mtp_layer=is_mtp_layer,
                name=name,
            )
        finally:
            config.moe_token_dispatcher_type = requested
        self.token_dispatcher = MoKTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config=self.config, pg_collection=pg_collection
        )
        reason = fused_unsupported_reason(config, self.experts)
        self.token_dispatcher.fused = reason is None
        if reason is not None:
            logger.warning(
                "MoK: fused expert path off (%s); using MoK dispatch/combine with Megatron's experts", reason
            )

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if not self.token_dispatcher.fused:
            return super().routed_experts_compute(hidden_states, probs)
        output = self.token_dispatcher.fused_experts(hidden_states, probs, self.experts)
        return output, None
