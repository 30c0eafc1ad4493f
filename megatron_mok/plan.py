"""What one MoK layer call is told besides its tensors: the ring (minibatch, slots), the transport of the EP group,
the expert count, the save / keep choices and the SwiGLU variant. Both backends read it (``function.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .activation import PLAIN, Glu
from .layout import ExpertLayout
from .transport import Transport


@dataclass(frozen=True)
class RingSpec:
    minibatch_tokens: int
    ring_slots: int

    def __post_init__(self) -> None:
        if self.minibatch_tokens <= 0 or self.ring_slots < 1:
            raise ValueError(f"bad ring spec {self}")


@dataclass
class MokPlan:
    """Everything about one MoK layer call that is not a tensor."""

    transport: Transport
    num_experts: int
    ring: RingSpec
    save_fc1_output: bool = True
    #: kernel backend (bf16): keep the expert input / SwiGLU rows for the backward (config
    #: kernel.save_expert_input); the reference keeps its dispatched rows anyway
    save_expert_input: bool = True
    #: Megatron's gradient_accumulation_fusion: add expert wgrads straight into ``param.main_grad``
    fuse_wgrad_into_main_grad: bool = False
    #: the SwiGLU variant (Megatron's glu_linear_offset / activation_func_clamp_value)
    glu: Glu = PLAIN
    # filled by forward, for tests and introspection
    layout: ExpertLayout | None = None
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.transport.world_size
