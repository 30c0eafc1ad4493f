"""MoK's MoELayer against Megatron-Core's own ``alltoall`` dispatcher + its experts, on CPU/gloo.

Both layers are built from the same spec; MoK loads the alltoall layer's state dict (the
checkpoint-compatibility claim), then forward outputs and input / router / expert gradients
must agree to fp32 rounding at EP = 1, 2, 4.
"""

from __future__ import annotations

import pytest
import torch
from routings import ROUTINGS, dense_routing, make_topk

from megatron_mok.config import parse_config
from megatron_mok.testing import build_moe_layer, make_fixed_router, moe_transformer_config, spawn

H, F, E, K = 64, 32, 8, 2
TOL = dict(rtol=1e-5, atol=1e-6)


def _router_for(kind: str):
    if kind == "router":
        return None  # Megatron's own top-k softmax router (portable gating)

    def route(tokens: torch.Tensor, num_experts: int, topk: int):
        g = torch.Generator().manual_seed(int(tokens.shape[0]) * 7 + num_experts)
        idx = make_topk(kind, tokens.shape[0], num_experts, topk, g)
        logits = tokens[:, :num_experts] * 3  # differentiable, so router grads flow to the input
        return dense_routing(idx, logits)

    return make_fixed_router(route)


def _small_ring_config():
    # 16-row minibatches, 2 slots: every rank cycles its ring several times
    return parse_config(
        {
            "model": {
                "name": "t",
                "hidden_size": H,
                "moe_ffn_hidden_size": F,
                "num_moe_experts": E,
                "moe_router_topk": K,
            },
            "kernel": {"comm_sms": 8, "ring_slots": 2, "minibatch_tokens": 16, "minibatch_align": 16},
        },
        "small-ring",
    )


def _compare(rank, ws, kind, swiglu, seq=12, batch=2):
    import megatron_cpu_shim

    megatron_cpu_shim.install()
    router = _router_for(kind)
    torch.manual_seed(1234)
    base = build_moe_layer(moe_transformer_config(ep_size=ws, dispatcher="alltoall", swiglu=swiglu), router)
    cfg = moe_transformer_config(ep_size=ws, dispatcher="mok", swiglu=swiglu)
    cfg.mok_config = _small_ring_config()
    mok = build_moe_layer(cfg, router)
    assert type(mok).__name__ == "MokMoELayer"
    assert mok.token_dispatcher.fused is swiglu
    assert mok.state_dict().keys() == base.state_dict().keys()
    mok.load_state_dict(base.state_dict())
    torch.manual_seed(100 + rank)
    x = torch.randn(seq + rank, batch, H)  # ranks hold different token counts
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_a, _ = base(xa)
    out_b, _ = mok(xb)
    torch.testing.assert_close(out_b, out_a, **TOL, msg=lambda m: f"rank {rank} {kind}: output {m}")
    grad = torch.randn_like(out_a)
    out_a.backward(grad)
    out_b.backward(grad)
    torch.testing.assert_close(xb.grad, xa.grad, **TOL, msg=lambda m: f"rank {rank} {kind}: input grad {m}")
    pa, pb = dict(base.named_parameters()), dict(mok.named_parameters())
    for name, p in pa.items():
        q = pb[name]
        if p.grad is None:
            assert q.grad is None or not q.grad.any(), f"{name}: MoK produced a gradient where alltoall has none"
            continue
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=lambda m, n=name: f"rank {rank} {kind}: {n} grad {m}")
    if swiglu:
        stats = mok.token_dispatcher.last_plan.stats
        assert stats["ring_fills"] == stats["minibatches"]
        return stats["minibatches"]
    return 0


def _worker(rank, ws):
    wraps = 0
    for kind in ("router", *ROUTINGS):
        wraps = max(wraps, _compare(rank, ws, kind, swiglu=True))
    _compare(rank, ws, "random", swiglu=False)  # unfused: MoK dispatch/combine + Megatron's experts
    _dropless_roundtrip(rank, ws)
    if ws > 1 or rank == 0:
        assert wraps > 2, "the ring buffer (2 slots) should have wrapped"


def _dropless_roundtrip(rank, ws):
    """Port of Megatron's dispatcher_dropless_test: permute -> *probs -> unpermute == input."""
    torch.manual_seed(5)
    layer = build_moe_layer(moe_transformer_config(ep_size=ws, dispatcher="mok", swiglu=False))
    disp = layer.token_dispatcher
    assert not disp.fused
    hidden = torch.randn(16, 2, H, requires_grad=True)
    probs, routing_map = layer.router(hidden)
    probs = torch.ones_like(probs) / K
    h, p = disp.dispatch_preprocess(hidden, routing_map, probs)
    h, p = disp.token_dispatch(h, p)
    rows, tokens_per_expert, permuted_probs = disp.dispatch_postprocess(h, p)
    assert int(tokens_per_expert.sum()) == rows.shape[0] and tokens_per_expert.numel() == E // ws
    rows = rows * permuted_probs.unsqueeze(-1)
    out = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(rows)))
    torch.testing.assert_close(out, hidden, rtol=1e-6, atol=1e-6)
    out.backward(hidden)
    torch.testing.assert_close(hidden.grad, hidden, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_mok_layer_equals_megatron_alltoall(ep):
    spawn(_worker, ep)


def _topk_router(dense: bool):
    """A fixed router giving the same routing in Megatron's dense [T, E] form or as top-k ids and probs [T, K]."""

    def route(tokens: torch.Tensor, num_experts: int, topk: int):
        g = torch.Generator().manual_seed(int(tokens.shape[0]))
        idx = make_topk("skewed", tokens.shape[0], num_experts, topk, g)
        logits = tokens[:, :num_experts] * 3
        probs, routing_map = dense_routing(idx, logits)
        return (probs, routing_map) if dense else (probs.gather(1, idx), idx)

    return make_fixed_router(route)


def test_topk_routing_taken_as_given():
    """A router that gives top-k ids and probs ([T, K], Megatron's dense_output form) computes what the dense routing
    map computes, gradients included; a top-k routing of the wrong shape is refused naming both shapes."""
    from megatron_mok.testing import init_one_rank

    init_one_rank("gloo")
    torch.manual_seed(7)
    layers = {}
    for dense in (True, False):
        cfg = moe_transformer_config(dispatcher="mok")
        cfg.mok_config = _small_ring_config()
        layers[dense] = build_moe_layer(cfg, _topk_router(dense))
    layers[False].load_state_dict(layers[True].state_dict())
    x = torch.randn(10, 2, H)
    xs = {d: x.clone().requires_grad_() for d in layers}
    outs = {d: layers[d](xs[d])[0] for d in layers}
    torch.testing.assert_close(outs[False], outs[True], rtol=0, atol=0)
    g = torch.randn_like(outs[True])
    for d in layers:
        outs[d].backward(g)
    torch.testing.assert_close(xs[False].grad, xs[True].grad, rtol=0, atol=0)
    disp = layers[False].token_dispatcher
    ids = torch.zeros(20, K + 1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"top-k routing \(int32 / int64 expert ids\): ids \(20, 3\) and probs "):
        disp.dispatch_preprocess(x, ids, torch.zeros(20, K + 1))


def test_topk_routing_on_the_unfused_path_is_range_checked():
    """Unfused (MoK dispatch and combine around Megatron's experts): the top-k form computes what the dense map does,
    and an expert id out of range is an error naming it, not a row silently left out."""
    from megatron_mok.layout import RoutingError
    from megatron_mok.testing import init_one_rank

    init_one_rank("gloo")
    torch.manual_seed(8)
    layers = {}
    for dense in (True, False):
        cfg = moe_transformer_config(dispatcher="mok", swiglu=False)
        layers[dense] = build_moe_layer(cfg, _topk_router(dense))
    layers[False].load_state_dict(layers[True].state_dict())
    assert not layers[False].token_dispatcher.fused
    x = torch.randn(10, 2, H)
    torch.testing.assert_close(layers[False](x)[0], layers[True](x)[0], rtol=0, atol=0)
    disp = layers[False].token_dispatcher
    hidden = x.reshape(-1, H)
    ids = make_topk("random", hidden.shape[0], E, K, torch.Generator().manual_seed(1))
    ids[3, 1] = E + 5
    h, p = disp.dispatch_preprocess(x, ids, torch.full((hidden.shape[0], K), 0.5))
    with pytest.raises(RoutingError, match=rf"the router's top-k expert ids has expert index {E + 5} out of range"):
        disp.token_dispatch(h, p)


def test_backend_chosen_again_only_when_what_it_reads_changes(monkeypatch):
    """The layer's backend is chosen at its first call and kept while device, dtype, EP size, expert shape and
    MOK_BACKEND stay; a change of MOK_BACKEND between calls is honoured at the next call."""
    import megatron_mok.dispatcher as dispatcher
    from megatron_mok.backend import MokBackendError
    from megatron_mok.testing import init_one_rank

    init_one_rank("gloo")
    chosen = []

    def counting(*args, **kwargs):
        chosen.append(kwargs.get("hidden"))
        return select(*args, **kwargs)

    select = dispatcher.select_backend
    monkeypatch.setattr(dispatcher, "select_backend", counting)
    monkeypatch.delenv("MOK_BACKEND", raising=False)
    cfg = moe_transformer_config(dispatcher="mok")
    cfg.mok_config = _small_ring_config()
    layer = build_moe_layer(cfg)
    x = torch.randn(6, 2, H)
    first = layer(x)[0]
    layer(x)
    assert chosen == [H] and layer.token_dispatcher.last_backend == "reference"
    monkeypatch.setenv("MOK_BACKEND", "kernel")  # refused on CPU: chosen again, and the refusal names it
    with pytest.raises(MokBackendError, match="MOK_BACKEND=kernel"):
        layer(x)
    monkeypatch.setenv("MOK_BACKEND", "reference")
    torch.testing.assert_close(layer(x)[0], first, rtol=0, atol=0)
    assert chosen == [H, H, H]
