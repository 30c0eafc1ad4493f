"""CPU: the SwiGLU variant MoK computes (megatron_mok.activation) is Megatron's GLU, forward and backward, and
``expert_glu`` reads every activation setting of a Megatron config the way Megatron's experts do."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_mok import fp8
from megatron_mok.activation import PLAIN, Glu, expert_glu, swiglu, swiglu_backward
from megatron_mok.testing import moe_transformer_config

VARIANTS = [PLAIN, Glu(offset=1.0), Glu(clamp=0.7), Glu(offset=-0.5, clamp=0.7)]


def megatron_glu(h: torch.Tensor, offset: float, clamp: float | None) -> torch.Tensor:
    """Megatron-Core's unfused GLU (MLP.forward / TEGroupedMLP, bias_activation_fusion off), written out."""
    x_glu, x_linear = torch.chunk(h, 2, dim=-1)
    if clamp is not None:
        x_glu = x_glu.clamp(min=None, max=clamp)
        x_linear = x_linear.clamp(min=-clamp, max=clamp)
    return F.silu(x_glu) * (x_linear + offset)


@pytest.mark.parametrize("glu", VARIANTS, ids=lambda g: g.describe())
def test_swiglu_forward_and_backward_equal_megatron(glu):
    g = torch.Generator().manual_seed(3)
    h = (torch.randn(64, 2 * 96, generator=g, dtype=torch.float64) * 1.5).requires_grad_()
    # values exactly on the clamp bounds: torch.clamp passes the gradient there
    if glu.clamp is not None:
        h.data[0, :4] = glu.clamp
        h.data[0, 96 : 96 + 4] = glu.clamp
        h.data[1, 96 : 96 + 4] = -glu.clamp
    ref = megatron_glu(h, glu.offset, glu.clamp)
    torch.testing.assert_close(swiglu(h.detach(), glu), ref.detach(), rtol=0, atol=1e-15)
    grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(grad)
    torch.testing.assert_close(swiglu_backward(h.detach(), grad, glu), h.grad, rtol=1e-12, atol=1e-14)
    if glu.clamp is not None:  # the clamp is active on a good share of the inputs, both sides
        assert (h.detach()[:, :96] > glu.clamp).float().mean() > 0.1
        assert (h.detach()[:, 96:].abs() > glu.clamp).float().mean() > 0.1


def test_fp8_recipe_uses_the_variant():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 128, generator=g)
    w1 = torch.randn(256, 128, generator=g) / math.sqrt(128)
    w2 = torch.randn(128, 128, generator=g) / math.sqrt(128)
    glu = Glu(offset=1.0, clamp=0.5)
    plain, variant = fp8.fp8_expert_ffn(x, w1, w2), fp8.fp8_expert_ffn(x, w1, w2, glu)
    exact = megatron_glu(x.double() @ w1.double().t(), 1.0, 0.5) @ w2.double().t()
    assert (variant.double() - exact).norm() / exact.norm() < 0.1  # the FP8 recipe's error, not a different function
    assert (plain.double() - exact).norm() / exact.norm() > 0.3
    dx, dw1, dw2 = fp8.fp8_expert_ffn_backward(x, w1, w2, torch.randn(32, 128, generator=g), glu)
    assert dx.shape == x.shape and dw1.shape == w1.shape and dw2.shape == w2.shape


def test_glu_rejects_bad_values():
    with pytest.raises(ValueError, match="activation_func_clamp_value must be a finite value > 0"):
        Glu(clamp=0.0)
    with pytest.raises(ValueError, match="activation_func_clamp_value"):
        Glu(clamp=math.inf)
    with pytest.raises(ValueError, match="glu_linear_offset must be finite"):
        Glu(offset=math.nan)


def _experts(te_op_fuser: bool = False) -> torch.nn.Module:
    """Stand-in expert module: expert_glu reads only whether TEGroupedMLP runs TE's op fuser."""
    m = torch.nn.Module()
    m._with_fused_impl = te_op_fuser
    return m


@pytest.mark.parametrize(
    "overrides,expected",
    [
        ({}, PLAIN),
        ({"glu_linear_offset": 1.0}, Glu(offset=1.0)),
        ({"activation_func_clamp_value": 7.0}, Glu(clamp=7.0)),
        ({"glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0}, Glu(offset=1.0, clamp=7.0)),
        ({"bias_activation_fusion": True}, PLAIN),  # Megatron's fused SwiGLU computes the plain one
    ],
)
def test_expert_glu_reads_megatron_settings(overrides, expected):
    cfg = moe_transformer_config(dispatcher="alltoall", **overrides)
    assert expert_glu(cfg, _experts()) == expected


@pytest.mark.parametrize(
    "field,value,reason",
    [
        ("activation_func_clamp_value", 7.0, "bias_activation_fusion"),  # fused SwiGLU + clamp: Megatron decides
        ("glu_linear_offset", 1.0, "bias_activation_fusion"),
        ("use_te_activation_func", True, "use_te_activation_func"),
        ("moe_mlp_glu_interleave_size", 32, "moe_mlp_glu_interleave_size"),
        ("activation_func_fp8_input_store", True, "activation_func_fp8_input_store"),
        ("moe_apply_probs_on_input", True, "moe_apply_probs_on_input"),
        ("activation_func_clamp_value", -1.0, "activation_func_clamp_value must be a finite value > 0"),
        ("activation_func", F.gelu, "SwiGLU"),
    ],
)
def test_expert_glu_names_what_the_fused_path_cannot_compute(field, value, reason):
    cfg = moe_transformer_config(dispatcher="alltoall")
    setattr(cfg, field, value)  # after validation, as recipes and launchers do
    if reason == "bias_activation_fusion":
        cfg.bias_activation_fusion = True
    got = expert_glu(cfg, _experts())
    assert isinstance(got, str) and reason in got


def test_expert_glu_te_op_fuser_with_clamp_runs_megatron_experts():
    cfg = moe_transformer_config(dispatcher="alltoall", activation_func_clamp_value=7.0)
    got = expert_glu(cfg, _experts(te_op_fuser=True))
    assert isinstance(got, str) and "use_transformer_engine_op_fuser" in got
    assert expert_glu(moe_transformer_config(dispatcher="alltoall"), _experts(te_op_fuser=True)) == PLAIN


@pytest.mark.parametrize("save_fc1_output", [True, False])
def test_kernel_backend_hands_the_variant_to_every_launch(monkeypatch, save_fc1_output):
    """The kernel backend passes the plan's variant to the forward and backward launches (launches stubbed:
    what reaches them is what a GPU run computes with)."""
    from megatron_mok import kernel
    from megatron_mok.kernel_backend import KernelBackend
    from megatron_mok.plan import MokPlan, RingSpec
    from megatron_mok.transport import EmulatedTransport, _Exchange

    seen: dict[str, object] = {}
    T, H, F, K, L = 6, 8, 4, 2, 2

    def forward(bufs, x, idx, w, w1, w2, **kw):
        seen["forward"] = kw.get("glu")
        return x.clone(), torch.zeros(T, K, H), torch.zeros(L, dtype=torch.int32)

    def backward(bufs, grad_out, x, idx, w, comb, w1, w2, **kw):
        seen["backward"] = kw.get("glu")
        return grad_out.clone(), torch.zeros(T, K), [torch.zeros(2 * F, H)] * L, [torch.zeros(H, F)] * L

    monkeypatch.setattr(kernel, "mok_forward", forward)
    monkeypatch.setattr(kernel, "mok_backward", backward)
    monkeypatch.setattr(kernel, "check_pending_errors", lambda wait=False: None)
    glu = Glu(offset=1.0, clamp=7.0)
    plan = MokPlan(EmulatedTransport(0, _Exchange(1)), L, RingSpec(64, 2), save_fc1_output=save_fc1_output, glu=glu)
    backend = KernelBackend(comm_sms=1, timeout_ms=100.0)
    w1, w2 = [torch.zeros(2 * F, H)] * L, [torch.zeros(H, F)] * L
    _, state = backend.forward(plan, torch.zeros(T, H), torch.zeros(T, K, dtype=torch.long), torch.ones(T, K), w1, w2)
    backend.backward(plan, state, torch.zeros(T, H), w1, w2)
    assert seen == {"forward": glu, "backward": glu}
