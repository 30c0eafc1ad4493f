"""CPU: MoK's fused path reads Transformer Engine's grouped experts (``TEGroupedMLP``: ``linear_fc1.weight{i}`` [2F, H]
and ``linear_fc2.weight{i}`` [H, F], one parameter per local expert) in local-expert order. Transformer Engine is not
installed here, so a stand-in with TE's parameter names and layouts holds the weights of a ``SequentialMLP``: the
layer's output and the weight gradients must be those of the ``SequentialMLP`` it was copied from."""

from __future__ import annotations

import torch

from megatron_mok.experts import expert_weights, fused_expert_activation
from megatron_mok.testing import build_moe_layer, moe_transformer_config, spawn


class _GroupedLinear(torch.nn.Module):
    """TE's GroupedLinear as the fused path sees it: parameters weight0 .. weight{n-1}."""

    def __init__(self, weights: list[torch.Tensor], single_grouped_weight: bool = False) -> None:
        super().__init__()
        for i, w in enumerate(weights):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(w.detach().clone()))
        self.single_grouped_weight = single_grouped_weight


class TEGroupedMLPStandIn(torch.nn.Module):
    def __init__(self, w1: list[torch.Tensor], w2: list[torch.Tensor], single_grouped_weight: bool = False) -> None:
        super().__init__()
        self.num_local_experts = len(w1)
        self.linear_fc1 = _GroupedLinear(w1, single_grouped_weight)
        self.linear_fc2 = _GroupedLinear(w2, single_grouped_weight)


def _grouped_equals_sequential(rank, world_size):
    import megatron_cpu_shim

    megatron_cpu_shim.install()
    torch.manual_seed(3)
    config = moe_transformer_config(dispatcher="mok")
    layer = build_moe_layer(config)
    w1, w2 = expert_weights(layer.experts)
    x = torch.randn(10, 2, 64)
    xa = x.clone().requires_grad_()
    out_a, _ = layer(xa)
    out_a.sum().backward()
    grads = [w.grad.clone() for w in (*w1, *w2)]

    standin = TEGroupedMLPStandIn(w1, w2)
    assert list(dict(standin.named_parameters())) == [
        *(f"linear_fc1.weight{i}" for i in range(len(w1))),
        *(f"linear_fc2.weight{i}" for i in range(len(w2))),
    ]
    g1, g2 = expert_weights(standin)
    assert all(a is getattr(standin.linear_fc1, f"weight{i}") for i, a in enumerate(g1))
    layer.experts = standin
    layer.zero_grad()
    xb = x.clone().requires_grad_()
    out_b, _ = layer(xb)
    out_b.sum().backward()
    assert layer.token_dispatcher.fused, "the stand-in should run on the fused path"
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=0)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=0, atol=0)
    for got, want in zip((*g1, *g2), grads):
        torch.testing.assert_close(got.grad, want, rtol=0, atol=0)

    # one grouped weight tensor for all experts is not read yet: the layer runs Megatron's experts instead
    single = TEGroupedMLPStandIn(w1, w2, single_grouped_weight=True)
    reason = fused_expert_activation(config, single)
    assert isinstance(reason, str) and "single grouped weight" in reason


def test_te_grouped_weights_run_the_fused_path():
    spawn(_grouped_equals_sequential, 1)
