"""Routing patterns shared by the reference, Megatron and kernel tests."""

from __future__ import annotations

import torch


def make_topk(kind: str, num_tokens: int, num_experts: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """[T, K] distinct expert ids per token for a named routing pattern."""
    if num_tokens == 0:
        return torch.empty(0, topk, dtype=torch.long)
    if kind == "random":
        scores = torch.rand(num_tokens, num_experts, generator=gen)
    elif kind == "skewed":  # Zipf-like popularity: a few experts get most tokens
        pop = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float) ** 1.5
        scores = torch.rand(num_tokens, num_experts, generator=gen) ** (1.0 / pop)
    elif kind == "empty_experts":  # only the first half of the experts receive anything
        scores = torch.rand(num_tokens, num_experts, generator=gen)
        scores[:, num_experts // 2 :] = -1
    elif kind == "all_to_one":  # every token's first choice is expert 0 (top-1: only expert 0)
        scores = torch.rand(num_tokens, num_experts, generator=gen)
        scores[:, 0] = 2
    else:
        raise ValueError(kind)
    return scores.topk(topk, dim=1).indices


def dense_routing(topk_idx: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map) in Megatron's dense [T, E] form; probs are a softmax over the chosen
    experts' logits (differentiable through ``logits``)."""
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, topk_idx, True)
    masked = logits.masked_fill(~routing_map, float("-inf"))
    probs = torch.softmax(masked, dim=1).masked_fill(~routing_map, 0.0)
    return probs, routing_map


ROUTINGS = ("random", "skewed", "empty_experts", "all_to_one")
