"""CPU: Megatron MoE settings a MoK layer cannot honour are refused when the layer is built through Megatron's own
``build_module`` (one line naming the setting and what to use instead), settings with no effect on MoK build and
compute as without them, and expert sizes the kernel's tiles do not divide send the layer to the reference with
the reason (megatron_mok/compat.py, backend.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from megatron_mok.backend import kernel_unavailable_reason
from megatron_mok.compat import fused_path_refusal, refusal
from megatron_mok.testing import moe_transformer_config, spawn

# name -> (config fields, fields set after the config's own checks, the refusal); Megatron's check wants an fp8
# recipe with the router padding, so it is set afterwards, as a recipe would
REFUSED = {
    "drop_and_pad": (
        dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
        {},
        "moe_pad_expert_input_to_capacity is not supported with moe_token_dispatcher_type='mok'",
    ),
    "padding_for_quantization": (
        {},
        dict(moe_router_padding_for_quantization=True),
        "moe_router_padding_for_quantization is not supported with moe_token_dispatcher_type='mok'",
    ),
    "inference_optimized": (
        {},
        dict(transformer_impl="inference_optimized"),
        "transformer_impl='inference_optimized' is not supported with moe_token_dispatcher_type='mok'",
    ),
    "padding_for_fp8": (
        {},
        dict(moe_router_padding_for_fp8=True),
        "moe_router_padding_for_fp8 is not supported with moe_token_dispatcher_type='mok'",
    ),
}


def _build(overrides: dict, after: dict | None = None):
    """A MoE layer of a stock (local) spec through Megatron's build_module with mok; ``after``: config fields set
    once the config exists (as launchers and recipes do)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    import megatron_mok

    megatron_mok.register()
    config = moe_transformer_config(dispatcher="mok", **overrides)
    for k, v in (after or {}).items():
        setattr(config, k, v)
    mlp = get_gpt_layer_local_submodules(num_experts=config.num_moe_experts, moe_grouped_gemm=False).mlp
    return build_module(ModuleSpec(module=MoELayer, submodules=mlp.keywords["submodules"]), config=config)


def _refusals(rank, world_size):
    for name, (overrides, after, message) in REFUSED.items():
        with pytest.raises(ValueError) as info:
            _build(overrides, after)
        assert message in str(info.value) and "when instantiating MoELayer" in str(info.value), (name, info.value)
    # selective recompute of the activation, set after the config's own checks: the fused path cannot honour it
    with pytest.raises(ValueError, match="recompute_modules 'moe_act' has no effect on MoK's fused expert path"):
        _build({}, after=dict(recompute_granularity="selective", recompute_modules=["moe_act"]))
    # the same setting with experts MoK hands to Megatron (biased: unfused) is Megatron's to honour
    _build(dict(add_bias_linear=True), after=dict(recompute_granularity="selective", recompute_modules=["moe_act"]))


def test_refused_settings_through_build_module():
    spawn(_refusals, 1)


def _permute_fusion_has_no_effect(rank, world_size):
    import megatron_cpu_shim

    megatron_cpu_shim.install()  # Megatron's router and experts on CPU
    torch.manual_seed(0)
    plain = _build({})
    fused = _build({}, after=dict(moe_permute_fusion=True))  # (Megatron refuses it without TE at config time)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(12, 2, 64)
    torch.testing.assert_close(fused(x)[0], plain(x)[0], rtol=0, atol=0)


def test_permute_fusion_has_no_effect():
    spawn(_permute_fusion_has_no_effect, 1)


def test_refusal_is_none_for_a_plain_config():
    cfg = moe_transformer_config(dispatcher="mok")
    assert refusal(cfg) is None and fused_path_refusal(cfg) is None


@pytest.mark.parametrize(
    "dtype, hidden, ffn, reason",
    [
        ("bf16", 100, 64, "hidden size 100 is not a multiple of 64 (bf16 kernel tiles)"),
        ("bf16", 128, 96, "ffn size 96 is not a multiple of 64 (bf16 kernel tiles)"),
        ("fp8", 192, 128, "hidden size 192 is not a multiple of 128 (fp8 kernel tiles)"),
    ],
)
def test_expert_sizes_the_kernel_cannot_tile_are_a_reason(dtype, hidden, ffn, reason):
    got = kernel_unavailable_reason(torch.device("cuda"), 1, dtype, torch.bfloat16, hidden, ffn)
    assert got == reason


def _reference_reason_is_logged(rank, world_size):
    import megatron_cpu_shim

    from megatron_mok.dispatcher import logger

    megatron_cpu_shim.install()
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(f"{record.levelname} {record.getMessage()}")

    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    layer = _build({})
    layer(torch.randn(6, 2, 64))
    layer(torch.randn(6, 2, 64))
    # once per layer and backend, with the reason; on CPU an info line (the reference is the only backend there)
    assert lines == ["INFO MoK layer: reference backend (EP 1, bf16): tensors are on cpu, the kernel needs CUDA"], lines


def test_the_backend_line_says_why_the_reference_runs():
    spawn(_reference_reason_is_logged, 1)
