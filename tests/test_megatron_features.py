"""CPU, gloo, EP 1 and 2: Megatron MoE features a user turns on give the same outputs and every gradient through a
``mok`` layer as through Megatron's own ``alltoall`` dispatcher (same spec, same weights, Megatron's own router):
token dropping, router losses, the aux-loss-free expert bias, group-limited routing, shared experts (gated too), and the experts
MoK hands to Megatron (GeGLU, ReLU). Biased SequentialMLP experts fail in Megatron-Core 0.19 itself on this path
(an in-place add on a view of its TP-1 reduction, with ``alltoall`` too), so they are not in the matrix.
Refusals: tests/test_megatron_settings.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_mok.testing import build_moe_layer, moe_transformer_config, spawn

H, E = 64, 8
TOL = dict(rtol=1e-5, atol=1e-6)

FEATURES = {
    "token_dropping_probs": dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs"),
    "token_dropping_position": dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy="position"),
    "aux_loss": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2),
    "seq_aux_loss": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2),
    "z_loss": dict(moe_z_loss_coeff=1e-3),
    "expert_bias": dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"),
    "group_limited": dict(moe_router_num_groups=4, moe_router_group_topk=2, moe_router_score_function="sigmoid"),
    "topk_scaling": dict(moe_router_topk_scaling_factor=2.5),
    "shared_experts": dict(moe_shared_expert_intermediate_size=64),
    "shared_experts_gated": dict(moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True),
    "geglu_unfused": dict(activation_func=F.gelu),
    "relu_unfused": dict(swiglu=False, activation_func=F.relu),
}


def _compare(rank: int, ws: int, name: str) -> None:
    import megatron_cpu_shim

    megatron_cpu_shim.install()
    over = dict(FEATURES[name])
    swiglu = over.pop("swiglu", True)
    torch.manual_seed(1234)
    base = build_moe_layer(moe_transformer_config(ep_size=ws, dispatcher="alltoall", swiglu=swiglu, **over))
    mok = build_moe_layer(moe_transformer_config(ep_size=ws, dispatcher="mok", swiglu=swiglu, **over))
    assert type(mok).__name__ == "MokMoELayer"
    mok.load_state_dict(base.state_dict())
    torch.manual_seed(100 + rank)
    x = torch.randn(10, 2, H)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_a, _ = base(xa)
    out_b, _ = mok(xb)
    torch.testing.assert_close(out_b, out_a, **TOL, msg=lambda m: f"rank {rank} {name}: output {m}")
    grad = torch.randn_like(out_a)
    out_a.backward(grad)
    out_b.backward(grad)
    torch.testing.assert_close(xb.grad, xa.grad, **TOL, msg=lambda m: f"rank {rank} {name}: input grad {m}")
    pa, pb = dict(base.named_parameters()), dict(mok.named_parameters())
    assert pa.keys() == pb.keys()
    for pname, p in pa.items():
        q = pb[pname]
        if p.grad is None:
            assert q.grad is None or not q.grad.any(), f"{name}: {pname}: MoK has a gradient where alltoall has none"
            continue
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=lambda m, n=pname: f"rank {rank} {name}: {n} grad {m}")
    buffers = dict(mok.named_buffers())  # e.g. the expert bias and its token counts
    for bname, want in base.named_buffers():
        torch.testing.assert_close(buffers[bname], want, **TOL, msg=lambda m, n=bname: f"rank {rank} {name}: {n} {m}")


def _worker(rank: int, ws: int) -> None:
    for name in FEATURES:
        _compare(rank, ws, name)


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
def test_features_equal_megatron_alltoall(ep):
    spawn(_worker, ep)
