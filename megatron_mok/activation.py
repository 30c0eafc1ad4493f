"""The expert activation MoK fuses: SwiGLU with Megatron's optional gate clamp and linear offset.

Megatron's unfused GLU (``MLP`` / ``TEGroupedMLP``, ``bias_activation_fusion=False``) computes, for the fc1
output ``h = [g | u]``::

    act = silu(min(g, c)) * (clamp(u, -c, c) + o)      c = activation_func_clamp_value (None: no clamp)
                                                        o = glu_linear_offset

(the clamped / offset SwiGLU of DeepSeek-V4-style models). :class:`Glu` holds ``(o, c)``; :func:`swiglu`
and :func:`swiglu_backward` are the definition every MoK path follows (reference, FP8 recipe oracle and
the CUDA kernels' epilogues). :func:`expert_glu` decides from a Megatron config what Megatron's own
experts compute and whether the fused path can compute exactly that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Glu:
    """SwiGLU variant: ``silu(min(g, clamp)) * (clamp(u, -clamp, clamp) + offset)``; clamp None = no clamp."""

    offset: float = 0.0
    clamp: float | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.offset):
            raise ValueError(f"glu_linear_offset must be finite, got {self.offset}")
        if self.clamp is not None and not (math.isfinite(self.clamp) and self.clamp > 0):
            raise ValueError(f"activation_func_clamp_value must be a finite value > 0, got {self.clamp}")

    @property
    def plain(self) -> bool:
        """True for Megatron's plain SwiGLU (no clamp, no offset)."""
        return self.offset == 0.0 and self.clamp is None

    def describe(self) -> str:
        parts = [] if self.clamp is None else [f"clamp {self.clamp:g}"]
        if self.offset != 0.0:
            parts.append(f"offset {self.offset:g}")
        return "SwiGLU" + (f" ({', '.join(parts)})" if parts else "")


PLAIN = Glu()


def _clamped(h: torch.Tensor, glu: Glu) -> tuple[torch.Tensor, torch.Tensor]:
    g, u = torch.chunk(h, 2, dim=-1)
    if glu.clamp is not None:
        g = g.clamp(max=glu.clamp)
        u = u.clamp(min=-glu.clamp, max=glu.clamp)
    return g, u


def swiglu(h: torch.Tensor, glu: Glu = PLAIN) -> torch.Tensor:
    """act [.., F] of the fc1 output h = [gate | up] [.., 2F] (gate activated, as Megatron orders them)."""
    g, u = _clamped(h, glu)
    if glu.offset != 0.0:
        u = u + glu.offset
    return F.silu(g) * u


def swiglu_backward(h: torch.Tensor, grad_act: torch.Tensor, glu: Glu = PLAIN) -> torch.Tensor:
    """dH [.., 2F] of :func:`swiglu` at h from d act [.., F] (in h's dtype: the callers pass fp32 / fp64).

    The clamp's gradient passes where the input lies inside the clamp range, bounds included (PyTorch's
    ``clamp`` backward): gate where g <= c, up where -c <= u <= c.
    """
    g0, u0 = torch.chunk(h, 2, dim=-1)
    g, u = _clamped(h, glu)
    if glu.offset != 0.0:
        u = u + glu.offset
    sig = torch.sigmoid(g)
    silu = g * sig
    dsilu = sig * (1 + g * (1 - sig))
    d_gate = grad_act * u * dsilu
    d_up = grad_act * silu
    if glu.clamp is not None:
        c = glu.clamp
        d_gate = torch.where(g0 <= c, d_gate, torch.zeros_like(d_gate))
        d_up = torch.where((u0 >= -c) & (u0 <= c), d_up, torch.zeros_like(d_up))
    return torch.cat([d_gate, d_up], dim=-1)


def _fused_megatron_activation(config: Any, experts: torch.nn.Module) -> str | None:
    """Which of Megatron's fused activation kernels its experts run for SwiGLU, or None (the unfused GLU)."""
    if getattr(experts, "_with_fused_impl", False):
        return "Transformer Engine's op-fuser SwiGLU (use_transformer_engine_op_fuser)"
    if getattr(config, "bias_activation_fusion", False):
        return "Megatron's fused SwiGLU (bias_activation_fusion / --bias-swiglu-fusion)"
    return None


def expert_glu(config: Any, experts: torch.nn.Module) -> Glu | str:
    """The SwiGLU variant Megatron's experts compute under ``config``, or why the fused path cannot
    compute exactly what they compute (the layer then runs Megatron's experts with MoK dispatch/combine).

    Every config field Megatron's ``MLP`` / ``SequentialMLP`` / ``TEGroupedMLP`` read between fc1 and fc2
    is decided here: the activation and GLU, the GLU offset and clamp, interleaved gate/up rows, a
    Transformer Engine activation module, the FP8-stored activation input, and probabilities applied on
    the input. (Per-token router probabilities multiply the fc2 output in MoK's combine instead of the
    activation in Megatron: fc2 is linear, so both compute the same function.)
    """
    if not getattr(config, "gated_linear_unit", False) or getattr(config, "activation_func", None) is not F.silu:
        return "the MoK expert FFN is SwiGLU: set gated_linear_unit=True with activation_func=silu (--swiglu)"
    if getattr(config, "use_te_activation_func", False):
        return "use_te_activation_func: Transformer Engine's activation module is not MoK's fused SwiGLU"
    if getattr(config, "moe_mlp_glu_interleave_size", None) is not None:
        return "moe_mlp_glu_interleave_size: interleaved gate/up rows of fc1 are not read by the fused MoK path"
    if getattr(config, "activation_func_fp8_input_store", False):
        return (
            "activation_func_fp8_input_store: Megatron's backward then differentiates an FP8-rounded "
            "activation input, which the fused MoK path does not reproduce"
        )
    if getattr(config, "moe_apply_probs_on_input", False):
        return "moe_apply_probs_on_input is not supported by the fused MoK path"
    offset = float(getattr(config, "glu_linear_offset", 0.0) or 0.0)
    clamp_value = getattr(config, "activation_func_clamp_value", None)
    fused = _fused_megatron_activation(config, experts)
    if fused is not None and (offset != 0.0 or clamp_value is not None):
        # Megatron's fused SwiGLU kernels take no offset or clamp (0.19 ignores them): leave the choice of
        # what is computed to Megatron's own experts rather than guess it
        return (
            f"{fused} with glu_linear_offset={offset:g} / activation_func_clamp_value={clamp_value}: "
            "Megatron's fused kernel decides how those apply, so MoK runs Megatron's experts"
        )
    try:
        return Glu(offset=offset, clamp=None if clamp_value is None else float(clamp_value))
    except ValueError as exc:
        return str(exc)
