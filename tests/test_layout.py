from __future__ import annotations

import pytest
import torch
from routings import ROUTINGS, make_topk

from megatron_mok.layout import (
    RoutingError,
    compute_layout,
    minibatches,
    topk_from_routing_map,
    validate_routing,
)


@pytest.mark.parametrize("kind", ROUTINGS)
def test_layout_matches_brute_force(kind):
    g = torch.Generator().manual_seed(3)
    R, L, K = 4, 3, 3
    tokens = [7, 0, 12, 5]
    idx = [make_topk(kind, t, R * L, K, g) for t in tokens]
    idx[3][0, 1] = -1  # an unused slot is skipped
    for q in range(R):
        lay = compute_layout(idx, q, L)
        want = sorted(
            (int(e) - q * L, r, t, k)
            for r in range(R)
            for t in range(tokens[r])
            for k in range(K)
            if q * L <= int(e := idx[r][t, k]) < (q + 1) * L
        )
        got = list(zip(lay.local_expert.tolist(), lay.src_rank.tolist(), lay.src_token.tolist(), lay.src_k.tolist()))
        assert got == want
        assert lay.tokens_per_expert.tolist() == [sum(1 for w in want if w[0] == e) for e in range(L)]
        assert lay.expert_offsets[-1] == lay.num_rows == len(want)
        # segments split a minibatch at expert boundaries, covering it exactly
        for _, _, lo, hi in minibatches(lay.num_rows, 4, 2):
            segs = list(lay.segments(lo, hi))
            assert sum(b - a for _, a, b in segs) == hi - lo
            assert all((lay.local_expert[a:b] == e).all() for e, a, b in segs)


def test_minibatches_cycle_the_ring():
    got = list(minibatches(10, 4, 2))
    assert got == [(0, 0, 0, 4), (1, 1, 4, 8), (2, 0, 8, 10)]
    assert list(minibatches(0, 4, 2)) == []


def test_topk_from_routing_map_orders_and_pads():
    probs = torch.tensor([[0.0, 0.7, 0.0, 0.3], [0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0]], requires_grad=True)
    rmap = probs.detach() > 0
    idx, w = topk_from_routing_map(rmap, probs, 2)
    assert idx.tolist() == [[1, 3], [0, 2], [2, -1]]
    assert torch.allclose(w, torch.tensor([[0.7, 0.3], [0.5, 0.5], [1.0, 0.0]]))
    w.sum().backward()  # weights stay differentiable to the router's probs
    assert torch.equal(probs.grad, rmap.float())
    with pytest.raises(RoutingError, match="more than moe_router_topk=1"):
        topk_from_routing_map(rmap, probs, 1)
    with pytest.raises(RoutingError, match="must both be"):
        topk_from_routing_map(rmap[:2], probs, 2)


def test_validate_routing_names_the_problem():
    with pytest.raises(RoutingError, match="expert index 8 out of range"):
        validate_routing(torch.tensor([[0, 8]]), 8)
    with pytest.raises(RoutingError, match="expert index -2"):
        validate_routing(torch.tensor([[0, -2]]), 8)
    with pytest.raises(RoutingError, match="int32 or int64"):
        validate_routing(torch.tensor([[0.0, 1.0]]), 8)
    with pytest.raises(RoutingError, match=r"\[tokens, topk\]"):
        validate_routing(torch.tensor([0, 1]), 8)
    validate_routing(torch.tensor([[0, -1]]), 8)
