"""Megatron MoE settings the MoK layer cannot honour, refused when the layer is built: each refusal names the setting
and what to use instead, so no failure waits for a routing that happens to trip it. Settings that have no effect on
MoK are logged once (README, "Using it in Megatron", lists what works)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def refusal(config: Any) -> str | None:
    """Why a MoK layer cannot be built with this Megatron config (the first reason), or None."""
    if getattr(config, "moe_pad_expert_input_to_capacity", False):
        return (
            "moe_pad_expert_input_to_capacity is not supported with moe_token_dispatcher_type='mok': MoK lays out "
            "exactly the routed rows (no padding rows), and the padded routing map can send a token to more than "
            "top-k experts; drop tokens without padding (moe_expert_capacity_factor alone) or use the alltoall "
            "dispatcher"
        )
    if getattr(config, "transformer_impl", None) == "inference_optimized":
        return (
            "transformer_impl='inference_optimized' is not supported with moe_token_dispatcher_type='mok': its MoE "
            "layers swap in Megatron's inference dispatchers around MoK's; use transformer_impl 'local' or "
            "'transformer_engine'"
        )
    for key in ("moe_router_padding_for_quantization", "moe_router_padding_for_fp8"):
        if getattr(config, key, False):
            return (
                f"{key} is not supported with moe_token_dispatcher_type='mok': MoK hands its experts exactly the "
                "routed rows (its FP8 kernel quantises 1 x 128 blocks per row and needs no padded row counts); "
                f"unset {key}"
            )
    return None


def fused_path_refusal(config: Any) -> str | None:
    """Why the fused expert path cannot honour this config (it would silently do something else), or None."""
    modules = getattr(config, "recompute_modules", None) or []
    if getattr(config, "recompute_granularity", None) == "selective" and "moe_act" in modules:
        return (
            "recompute_modules 'moe_act' has no effect on MoK's fused expert path (the kernel computes the SwiGLU "
            "inside the expert GEMMs): remove it; MoK's own memory settings are kernel.save_fc1_output and "
            "kernel.save_expert_input in the MoK config (false: the backward recomputes)"
        )
    return None


def check_megatron_settings(config: Any) -> None:
    """Raise ValueError naming a setting MoK refuses; log the ones that have no effect on it."""
    reason = refusal(config)
    if reason is not None:
        raise ValueError(reason)
    if getattr(config, "moe_permute_fusion", False):
        logger.info("MoK: moe_permute_fusion has no effect (MoK pulls and pushes rows; it permutes no tokens)")
