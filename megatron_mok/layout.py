"""The MoK schedule: which rows an expert-owning rank pulls, and in what order.

Each rank publishes its routing (top-k expert ids per token). The rank that owns experts
``[q*L, (q+1)*L)`` reads every rank's routing and lays the rows it needs out per local expert.
Rows of one expert are ordered by (source rank, token, k); experts follow in local order.
Nobody else needs to know these offsets: that is what lets dispatch *pull*.

The layout is then cut into minibatches of about ``minibatch_tokens`` consecutive rows; minibatch ``i``
lives in ring slot ``i % ring_slots``. The forward kernel puts each boundary on the GEMM tile grid of
the expert it falls in (``FORWARD_TILE_ROWS``), so no row block is split between two minibatches. The
CUDA kernel computes the identical layout on the GPU; this module is the definition both are tested
against.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


class RoutingError(ValueError):
    """Routing metadata is malformed (shape, dtype or expert index out of range)."""


#: The id the device conversion of a dense routing map (``kernel.routing``) puts in the last slot of a token the map
#: routes to more than top-k experts; the kernels' schedule and :func:`validate_routing` report it.
OVER_ROUTED = -(2**31)


@dataclass(frozen=True)
class ExpertLayout:
    """Rows one expert-owning rank computes, grouped by local expert."""

    rank: int
    num_local_experts: int
    tokens_per_expert: torch.Tensor  # [L] int64
    expert_offsets: torch.Tensor  # [L + 1] int64, exclusive prefix sum
    src_rank: torch.Tensor  # [N] int64
    src_token: torch.Tensor  # [N] int64
    src_k: torch.Tensor  # [N] int64
    local_expert: torch.Tensor  # [N] int64

    @property
    def num_rows(self) -> int:
        return int(self.src_rank.numel())

    def segments(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """(local expert, row begin, row end) pieces of layout rows [start, end)."""
        offsets = self.expert_offsets.tolist()
        for e in range(self.num_local_experts):
            lo, hi = max(start, offsets[e]), min(end, offsets[e + 1])
            if lo < hi:
                yield e, lo, hi


def validate_routing(topk_idx: torch.Tensor, num_experts: int, what: str = "topk_idx") -> None:
    """Check one rank's top-k routing: 2-D integer tensor with ids in [0, E) or -1 (unused)."""
    if topk_idx.dim() != 2:
        raise RoutingError(f"{what} must be [tokens, topk], got shape {tuple(topk_idx.shape)}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise RoutingError(f"{what} must be int32 or int64, got {topk_idx.dtype}")
    if topk_idx.numel():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo == OVER_ROUTED and topk_idx.dtype == torch.int32:  # the device conversion's mark
            token = int((topk_idx == OVER_ROUTED).any(1).nonzero()[0, 0])
            raise RoutingError(
                f"the routing map routes token {token} to more than moe_router_topk={topk_idx.shape[1]} experts"
            )
        if lo < -1 or hi >= num_experts:
            bad = lo if lo < -1 else hi
            raise RoutingError(
                f"{what} has expert index {bad} out of range [0, {num_experts}) (-1 marks an unused slot)"
            )


def compute_layout(all_topk_idx: Sequence[torch.Tensor], rank: int, num_local_experts: int) -> ExpertLayout:
    """The layout rank ``rank`` computes from every rank's routing (``all_topk_idx[r]``: [T_r, K])."""
    device = all_topk_idx[0].device if all_topk_idx else torch.device("cpu")
    first = rank * num_local_experts
    src_rank, src_token, src_k, expert = [], [], [], []
    for r, idx in enumerate(all_topk_idx):
        idx = idx.long()
        mine = (idx >= first) & (idx < first + num_local_experts)
        t, k = torch.nonzero(mine, as_tuple=True)  # row-major: token asc, then k asc
        src_rank.append(torch.full_like(t, r))
        src_token.append(t)
        src_k.append(k)
        expert.append(idx[t, k] - first)
    cat = (lambda xs: torch.cat(xs)) if src_rank else (lambda xs: torch.empty(0, dtype=torch.long, device=device))
    src_rank_t, src_token_t, src_k_t, expert_t = cat(src_rank), cat(src_token), cat(src_k), cat(expert)
    # Stable sort by expert keeps the (rank, token, k) order inside each expert.
    order = torch.sort(expert_t, stable=True).indices
    counts = torch.bincount(expert_t, minlength=num_local_experts)
    offsets = torch.zeros(num_local_experts + 1, dtype=torch.long, device=device)
    offsets[1:] = torch.cumsum(counts, 0)
    return ExpertLayout(
        rank=rank,
        num_local_experts=num_local_experts,
        tokens_per_expert=counts,
        expert_offsets=offsets,
        src_rank=src_rank_t[order],
        src_token=src_token_t[order],
        src_k=src_k_t[order],
        local_expert=expert_t[order],
    )


def positions_by_rank(src_rank: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """For each rank r, the positions (ascending) of the rows whose source is r."""
    return [torch.nonzero(src_rank == r, as_tuple=False).flatten() for r in range(world_size)]


#: Row-block height of the forward kernel's GEMM tiles (csrc/mok/common.cuh kBM): its minibatch
#: boundaries sit on each expert's grid of these blocks.
FORWARD_TILE_ROWS = 128


def num_minibatches(num_rows: int, minibatch_tokens: int) -> int:
    return -(-num_rows // minibatch_tokens)


def minibatch_start(
    i: int, minibatch_tokens: int, expert_offsets: Sequence[int] | None = None, tile_rows: int = 1
) -> int:
    """First layout row of minibatch ``i``: ``i * minibatch_tokens``, rounded down to the ``tile_rows``
    grid of the expert it falls in when ``expert_offsets`` ([L + 1], exclusive prefix sum) is given; the
    number of rows for ``i`` past the last minibatch (csrc/mok/comm/ring_buffer.cuh: mb_begin)."""
    if expert_offsets is None:
        raise ValueError("minibatch_start needs the expert offsets (their last entry is the row count)")
    n = int(expert_offsets[-1])
    p = i * minibatch_tokens
    if p >= n:
        return n
    e = max(j for j in range(len(expert_offsets) - 1) if expert_offsets[j] <= p)
    lo = int(expert_offsets[e])
    return lo + (p - lo) // tile_rows * tile_rows


def minibatches(
    num_rows: int,
    minibatch_tokens: int,
    ring_slots: int,
    expert_offsets: Sequence[int] | None = None,
    tile_rows: int = 1,
) -> Iterator[tuple[int, int, int, int]]:
    """(minibatch index, ring slot, first row, end row) for every minibatch of the layout.

    Without ``expert_offsets`` (or with ``tile_rows`` 1) the boundaries are the multiples of
    ``minibatch_tokens``. With them and ``tile_rows`` > 1 (the forward kernel: ``FORWARD_TILE_ROWS``) each
    boundary is rounded down to its expert's tile grid: as many minibatches, each under
    ``minibatch_tokens + tile_rows`` rows, and only an expert's last row block is ever partial."""
    nmb = num_minibatches(num_rows, minibatch_tokens)
    if expert_offsets is None or tile_rows == 1:
        for i in range(nmb):
            start = i * minibatch_tokens
            yield i, i % ring_slots, start, min(start + minibatch_tokens, num_rows)
        return
    offsets = [int(v) for v in expert_offsets]
    if offsets[-1] != num_rows:
        raise ValueError(f"expert offsets end at {offsets[-1]} rows, the layout has {num_rows}")
    for i in range(nmb):
        a = minibatch_start(i, minibatch_tokens, offsets, tile_rows)
        yield i, i % ring_slots, a, minibatch_start(i + 1, minibatch_tokens, offsets, tile_rows)


def topk_from_routing_map(
    routing_map: torch.Tensor, probs: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's dense ``routing_map``/``probs`` [T, E] -> top-k ids and weights [T, K].

    Ids are in ascending expert order; tokens routed to fewer than K experts (capacity drops,
    padding) get id -1 and weight 0. Weights keep autograd to ``probs``.
    """
    if routing_map.shape != probs.shape or routing_map.dim() != 2:
        raise RoutingError(
            f"routing_map {tuple(routing_map.shape)} and probs {tuple(probs.shape)} must both be [tokens, experts]"
        )
    num_tokens, num_experts = routing_map.shape
    k = min(topk, num_experts)
    if num_tokens == 0:
        empty = torch.empty(0, topk, dtype=torch.long, device=probs.device)
        return empty, probs.new_empty(0, topk)
    too_many = routing_map.sum(dim=1).max() > topk
    msg = f"routing_map routes a token to more than moe_router_topk={topk} experts"
    if routing_map.is_cuda:
        torch._assert_async(~too_many, msg)  # checked on the device: no host synchronisation
    elif bool(too_many):
        raise RoutingError(msg)
    # Stable descending sort of 0/1 puts routed experts first, in ascending id order.
    sorted_mask, sorted_idx = torch.sort(routing_map.to(torch.int8), dim=1, descending=True, stable=True)
    idx = sorted_idx[:, :k]
    valid = sorted_mask[:, :k].bool()
    weights = probs.gather(1, idx) * valid
    idx = torch.where(valid, idx, torch.full_like(idx, -1))
    if k < topk:
        pad = topk - k
        idx = torch.cat([idx, idx.new_full((num_tokens, pad), -1)], 1)
        weights = torch.cat([weights, weights.new_zeros(num_tokens, pad)], 1)
    return idx, weights
