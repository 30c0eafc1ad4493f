"""GPU: the device conversion of Megatron's dense routing (``mok::topk_from_routing_map``) against the tensor-op
definition (``layout.topk_from_routing_map``): the same ids (int32) and bit-identical probabilities and gradients,
for full, dropped, empty and padded routings, eager and under ``torch.compile``; over-routed tokens reported by name
through the forward kernel and the host check."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from emulated import mok_forward_emulated  # noqa: E402
from mok_truth import make_experts  # noqa: E402
from routings import dense_routing  # noqa: E402

from megatron_mok.layout import OVER_ROUTED, RoutingError, topk_from_routing_map, validate_routing  # noqa: E402

pytestmark = pytest.mark.gpu


def _routing(T: int, E: int, K: int, dtype: torch.dtype, seed: int, drop: float = 0.0):
    """A dense map with K experts per token (a share ``drop`` of the entries removed) and Megatron-like probs."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand((T, E), generator=g, device="cuda")
    probs, rmap = dense_routing(scores.topk(K, dim=1).indices, scores)
    if drop:
        rmap &= torch.rand((T, E), generator=g, device="cuda") >= drop
    return rmap, (probs * rmap).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("T", "E", "K", "drop"),
    [(8192, 384, 8, 0.0), (1000, 256, 8, 0.3), (333, 8, 2, 0.0), (64, 32, 4, 1.0), (0, 16, 2, 0.0), (50, 4, 6, 0.0),
     (77, 100, 33, 0.5), (77, 100, 33, 0.0)],
)  # fmt: skip
def test_matches_tensor_ops(kernel, T, E, K, drop, dtype):
    from megatron_mok.kernel import routing

    rmap, probs = _routing(T, E, min(K, E), dtype, seed=T + E + K, drop=drop)
    assert routing.runs_on_device(rmap, probs)
    p_dev = probs.clone().requires_grad_()
    p_ref = probs.clone().requires_grad_()
    idx, w = routing.topk_from_routing_map(rmap, p_dev, K)
    idx_ref, w_ref = topk_from_routing_map(rmap, p_ref, K)
    assert idx.dtype == torch.int32 and idx.shape == (T, K) and w.dtype == dtype
    assert torch.equal(idx.long(), idx_ref)
    assert torch.equal(w, w_ref)
    if T:
        grad = torch.randn((T, K), device="cuda").to(dtype)
        w.backward(grad)
        w_ref.backward(grad)
        assert torch.equal(p_dev.grad, p_ref.grad)


def test_compiled_conversion_equals_eager(kernel):
    """The operator's gradient (registered in C++ with its CUDA implementation) traced by torch.compile: one graph,
    the same ids, probabilities and probs' gradient as eager calls, bit for bit; a NaN gradient in a slot without an
    expert adds nothing."""
    import torch._dynamo

    from megatron_mok.kernel import routing

    rmap, probs = _routing(1000, 64, 8, torch.float32, seed=11, drop=0.2)

    def convert(m, p):
        idx, w = routing.topk_from_routing_map(m, p, 10)  # two padded slots per token
        return idx, w * 3.0

    grad = torch.randn((1000, 10), device="cuda")
    grad[:, 8:] = float("nan")  # padded slots: no expert, no gradient

    def step(fn):
        p = probs.clone().requires_grad_()
        idx, w = fn(rmap, p)
        w.backward(grad)
        return idx, w.detach(), p.grad

    want = step(convert)
    torch._dynamo.reset()
    got = step(torch.compile(convert, fullgraph=True))
    assert not torch.isnan(want[2]).any()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # dynamic token counts: one graph for both sizes (the gradient's sizes stay symbolic)
    torch._dynamo.reset()
    compiled = torch.compile(convert, fullgraph=True, dynamic=True)
    step(compiled)
    rmap, probs = _routing(600, 64, 8, torch.float32, seed=12, drop=0.2)
    grad = grad[:600]
    want = step(convert)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = step(compiled)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_over_routed_token_is_marked_and_named(kernel):
    from megatron_mok.kernel import routing

    rmap, probs = _routing(40, 8, 2, torch.float32, seed=3)
    rmap[17, :5] = True  # 5 or more experts for a top-2 token
    idx, _ = routing.topk_from_routing_map(rmap, probs, 2)
    assert int(idx[17, 1]) == OVER_ROUTED and int(idx[17, 0]) == 0
    assert (idx[torch.arange(40, device="cuda") != 17] >= 0).all()
    with pytest.raises(RoutingError, match="routes token 17 to more than moe_router_topk=2 experts"):
        validate_routing(idx, 8)
    wide, wprobs = _routing(40, 64, 33, torch.float32, seed=6)  # the mark past the first 32 columns and slots
    wide[9, :40] = True
    idx_wide, _ = routing.topk_from_routing_map(wide, wprobs, 33)
    assert int(idx_wide[9, 32]) == OVER_ROUTED and idx_wide[9, :32].tolist() == list(range(32))
    assert int((idx_wide == OVER_ROUTED).sum()) == 1
    R, L, H, F = 1, 8, 256, 128
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = [torch.randn((40, H), generator=gen, device="cuda").bfloat16()]
    w1, w2 = make_experts(R, L, H, F, torch.device("cuda"), gen)
    w = torch.rand((40, 2), device="cuda")
    with pytest.raises(kernel.MokKernelError, match="routes token 17 of rank 0 to more than top-k"):
        mok_forward_emulated(x, [idx], [w], w1, w2, comm_sms=2, ring_slots=2, minibatch_tokens=64)


def test_refusals_name_the_argument(kernel):
    rmap, probs = _routing(10, 8, 2, torch.float32, seed=5)
    with pytest.raises(ValueError, match="routing_map must be bool"):
        torch.ops.mok.topk_from_routing_map(rmap.int(), probs, 2)
    with pytest.raises(ValueError, match="probs must be float32 or bfloat16"):
        torch.ops.mok.topk_from_routing_map(rmap, probs.half(), 2)
    with pytest.raises(ValueError, match="probs"):
        torch.ops.mok.topk_from_routing_map(rmap, probs[:, :4].contiguous(), 2)
    with pytest.raises(ValueError, match="topk=0"):
        torch.ops.mok.topk_from_routing_map(rmap, probs, 0)
