"""``MokMoELayer``: Megatron's ``MoELayer`` with the MoK dispatcher and the fused expert path.

The class only changes how the layer is built (a MoK dispatcher instead of Megatron's
hard-coded choice) and ``routed_experts_compute``; routers, experts, shared experts, state dict
keys and checkpoint layout are Megatron's own.

Two settings are re-read at every forward, since configs are mutable (recipes and launchers set
fields after the layer is built): the expert activation (:func:`~megatron_mok.experts.fused_expert_activation`
picks the fused path, and the SwiGLU variant it computes, or Megatron's experts) and
``moe_shared_expert_overlap``. The shared experts always run in the layer: Megatron's overlap hands
them to the dispatcher it builds first, which MoK replaces, so the flag is refused.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from .activation import Glu
from .compat import fused_path_refusal
from .dispatcher import MoKTokenDispatcher
from .experts import fused_expert_activation

logger = logging.getLogger(__name__)

#: Placeholder Megatron builds first (its constructor is cheap, host-only and comm-free).
_PLACEHOLDER_DISPATCHER = "allgather"


def _overlap_error() -> ValueError:
    return ValueError(
        "moe_shared_expert_overlap is not supported with moe_token_dispatcher_type='mok': MoK's kernel runs "
        "dispatch and combine inside the expert GEMMs, so there is no communication phase to overlap the shared "
        "experts with; unset moe_shared_expert_overlap (--moe-shared-expert-overlap)"
    )


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
        if config.moe_shared_expert_overlap and config.moe_shared_expert_intermediate_size is not None:
            raise _overlap_error()
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
        self._expert_path: Glu | str | None = None
        self._resolve_expert_path()

    # Megatron assigns this from the config in its constructor (and, with an inference dispatcher, at every
    # forward); the layer keeps its shared experts whatever is assigned: True is refused while there are
    # shared experts, and reads are always False, so shared_experts_compute runs them.
    @property
    def shared_expert_overlap(self) -> bool:
        return False

    @shared_expert_overlap.setter
    def shared_expert_overlap(self, value: bool) -> None:
        if value and getattr(self, "use_shared_expert", False):
            raise _overlap_error()

    def _resolve_expert_path(self) -> None:
        """Fused (with the SwiGLU variant Megatron's experts compute) or Megatron's experts, from the config
        as it is now; logged when it is decided or changes."""
        path = fused_expert_activation(self.config, self.experts)
        if isinstance(path, Glu) and (reason := fused_path_refusal(self.config)) is not None:
            raise ValueError(reason)
        if path != self._expert_path:
            if isinstance(path, str):
                logger.warning(
                    "MoK: fused expert path off (%s); using MoK dispatch/combine with Megatron's experts", path
                )
            elif self._expert_path is not None or not path.plain:
                logger.info("MoK: fused expert path computes %s", path.describe())
            self._expert_path = path
        self.token_dispatcher.fused = isinstance(path, Glu)
        self.token_dispatcher.glu = path if isinstance(path, Glu) else None

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        self._resolve_expert_path()
        return super().forward(hidden_states, *args, **kwargs)

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if not self.token_dispatcher.fused:
            return super().routed_experts_compute(hidden_states, probs)
        output = self.token_dispatcher.fused_experts(hidden_states, probs, self.experts)
        return output, None
