"""Reading expert weights out of Megatron's own expert modules.

MoK runs the expert FFN inside its kernel but leaves the weights where Megatron keeps them
(``SequentialMLP.local_experts[i].linear_fc{1,2}.weight`` or ``TEGroupedMLP.linear_fc{1,2}.weight{i}``),
so state dicts and checkpoints are exactly those of the ``alltoall`` dispatcher.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .activation import Glu, expert_glu


def fused_expert_activation(config: Any, experts: torch.nn.Module) -> Glu | str:
    """The SwiGLU variant the fused MoK path computes for these experts, or why it cannot run them."""
    if getattr(config, "add_bias_linear", False):
        return "the MoK expert FFN has no biases: set add_bias_linear=False (--disable-bias-linear)"
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        return "Megatron fp8/fp4 recipes are not used by MoK; select the MoK fp8 path with kernel.dtype: fp8"
    if getattr(config, "moe_latent_size", None):
        return "latent MoE projections are not supported by the fused MoK path"
    glu = expert_glu(config, experts)
    if isinstance(glu, str):
        return glu
    reason = _unreadable_reason(experts)
    return glu if reason is None else reason


#: expert module -> why MoK cannot read its weights (None: it can)
_READABLE: weakref.WeakKeyDictionary[torch.nn.Module, str | None] = weakref.WeakKeyDictionary()


def _unreadable_reason(experts: torch.nn.Module) -> str | None:
    """Why MoK cannot read these experts' weights, or None: decided once per expert module, whose structure is fixed
    once built (the layer decides its expert path at every forward; the weights themselves are read at every call,
    and a module whose weights disappear later is a TypeError of ``expert_weights`` there, not a fallback)."""
    if experts not in _READABLE:
        try:
            expert_weights(experts)
            _READABLE[experts] = None
        except TypeError as exc:
            _READABLE[experts] = str(exc)
    return _READABLE[experts]


def _attr(module: Any, name: str) -> Any:
    """``module.<name>`` (a submodule, a parameter or a plain attribute), or None. This runs at every layer call, for
    every expert: a submodule or parameter is read from the module's own tables, without ``nn.Module.__getattr__``'s
    walk (~1 us a read, ~30 us per call for 8 experts)."""
    if module is None:
        return None
    own = module.__dict__
    for table in ("_modules", "_parameters"):
        found = own.get(table, {}).get(name)
        if found is not None:
            return found
    return getattr(module, name, None)


def expert_weights(experts: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(fc1 weights [2F, H], fc2 weights [H, F]) of the local experts, in local order."""
    local = _attr(experts, "local_experts")
    w1 = w2 = None
    if local is not None:  # SequentialMLP
        try:  # the usual layout, read straight from the module tables
            mods = [e._modules for e in local._modules.values()]
            w1 = [m["linear_fc1"]._parameters["weight"] for m in mods]
            w2 = [m["linear_fc2"]._parameters["weight"] for m in mods]
        except (AttributeError, KeyError):
            w1 = [_attr(_attr(e, "linear_fc1"), "weight") for e in local]
            w2 = [_attr(_attr(e, "linear_fc2"), "weight") for e in local]
    else:
        fc1, fc2 = _attr(experts, "linear_fc1"), _attr(experts, "linear_fc2")
        n = getattr(experts, "num_local_experts", None)
        if fc1 is not None and fc2 is not None and n is not None:  # TEGroupedMLP
            if getattr(fc1, "single_grouped_weight", False):
                raise TypeError("TEGroupedMLP with a single grouped weight tensor is not supported yet by MoK")
            w1 = [_attr(fc1, f"weight{i}") for i in range(n)]
            w2 = [_attr(fc2, f"weight{i}") for i in range(n)]
    if w1 is not None and w2 is not None and all(isinstance(w, torch.Tensor) for w in (*w1, *w2)):
        return w1, w2
    raise TypeError(
        f"MoK cannot read expert weights from {type(experts).__name__}; supported: SequentialMLP, TEGroupedMLP"
    )
