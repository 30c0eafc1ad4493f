"""CPU: reading the expert weights out of Megatron's expert modules (megatron_mok/experts.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_mok.experts import expert_weights, fused_expert_activation
from megatron_mok.testing import build_moe_layer, init_one_rank, moe_transformer_config


def test_sequential_mlp_weights_are_the_parameters_themselves():
    init_one_rank("gloo")
    layer = build_moe_layer(moe_transformer_config(hidden_size=64, ffn_hidden_size=32, num_experts=4, topk=2))
    w1, w2 = expert_weights(layer.experts)
    local = layer.experts.local_experts
    assert [id(w) for w in w1] == [id(e.linear_fc1.weight) for e in local]
    assert [id(w) for w in w2] == [id(e.linear_fc2.weight) for e in local]


class _NoFc2(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_fc1 = torch.nn.Linear(4, 8, bias=False)


def test_an_expert_without_its_weights_is_a_clear_refusal():
    experts = torch.nn.Module()
    experts.local_experts = torch.nn.ModuleList([_NoFc2()])
    with pytest.raises(TypeError, match="MoK cannot read expert weights from Module; supported: SequentialMLP"):
        expert_weights(experts)
    cfg = moe_transformer_config(hidden_size=64, ffn_hidden_size=32, num_experts=4, topk=2)
    reason = fused_expert_activation(cfg, experts)
    assert isinstance(reason, str) and "cannot read expert weights" in reason  # the layer then runs Megatron's
