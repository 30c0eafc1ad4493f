from __future__ import annotations

import pytest
import torch
from routings import ROUTINGS, make_topk

from megatron_mok.layout import (
    FORWARD_TILE_ROWS,
    OVER_ROUTED,
    RoutingError,
    compute_layout,
    minibatches,
    num_minibatches,
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


def test_forward_minibatches_sit_on_the_experts_tile_grid():
    torch.manual_seed(3)
    for _ in range(20):
        counts = torch.randint(0, 700, (int(torch.randint(1, 12, (1,))),))
        offsets = [0] + torch.cumsum(counts, 0).tolist()
        n = offsets[-1]
        for mb in (64, 100, 128, 300, 512):
            got = list(minibatches(n, mb, 3, offsets, FORWARD_TILE_ROWS))
            assert len(got) == num_minibatches(n, mb)
            assert [g[1] for g in got] == [i % 3 for i in range(len(got))]
            ends = [g[2] for g in got] + [n]
            assert ends[0] == 0 and all(a <= b for a, b in zip(ends, ends[1:])), ends
            assert all(b - a < mb + FORWARD_TILE_ROWS for a, b in zip(ends, ends[1:]))
            for i, a in enumerate(ends[1:-1], start=1):
                e = max(j for j in range(len(offsets) - 1) if offsets[j] <= i * mb)
                # on expert e's tile grid, no later than i * mb, less than one tile before it
                assert (a - offsets[e]) % FORWARD_TILE_ROWS == 0 and i * mb - FORWARD_TILE_ROWS < a <= i * mb
            # every expert's row blocks: only the last may be partial
            for e in range(len(offsets) - 1):
                cuts = sorted({offsets[e], offsets[e + 1]} | {a for a in ends if offsets[e] < a < offsets[e + 1]})
                assert all((a - offsets[e]) % FORWARD_TILE_ROWS == 0 for a in cuts[:-1])
    assert list(minibatches(0, 64, 2, [0, 0], FORWARD_TILE_ROWS)) == []
    with pytest.raises(ValueError, match="expert offsets end at 5"):
        list(minibatches(6, 4, 2, [0, 5], FORWARD_TILE_ROWS))


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
    with pytest.raises(RoutingError, match="routes token 1 to more than moe_router_topk=2 experts"):
        validate_routing(torch.tensor([[0, 1], [2, OVER_ROUTED]], dtype=torch.int32), 8)
