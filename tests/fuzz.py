"""Seeded random MoE cases for the fuzz tests: sizes, experts, top-k, token counts (zero and odd ones included) and
routings drawn from named distributions. A case is reproduced from its seed alone; every failure message names it."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

# uniform; Zipf-skewed expert popularity; every token's first choice one expert; every choice on rank 0's experts;
# some ranks without tokens; unused top-k slots (-1)
ROUTINGS = ("uniform", "zipf", "one_expert", "one_rank", "empty_ranks", "holes")


@dataclass(frozen=True)
class Case:
    seed: int
    R: int  # EP ranks
    L: int  # local experts per rank
    H: int
    F: int
    K: int
    tokens: tuple[int, ...]  # per rank
    routing: str
    minibatch: int
    ring_slots: int

    def __str__(self) -> str:
        return (
            f"fuzz case seed={self.seed}: EP {self.R}, {self.L} experts/rank, H {self.H}, F {self.F}, top-{self.K}, "
            f"tokens {list(self.tokens)}, {self.routing} routing, minibatch {self.minibatch} x {self.ring_slots} slots"
        )


def draw_case(
    seed: int,
    *,
    ranks=(1, 2, 4),
    experts=(1, 4),
    hidden=(8, 16, 24),
    ffn=(4, 8, 12),
    tokens=(0, 40),
    log_tokens: bool = False,
    minibatches=(1, 3, 8, 16, 64),
) -> Case:
    """One case from ``seed``: EP size from ``ranks``, local experts in the ``experts`` range, sizes from ``hidden`` /
    ``ffn``, token counts per rank in the ``tokens`` range (``log_tokens``: log-uniform, so small and large counts are
    drawn alike often), the minibatch from ``minibatches``."""
    rng = random.Random(seed)
    R = rng.choice(ranks)
    L = rng.randint(*experts)
    K = rng.randint(1, min(8, R * L))
    routing = rng.choice(ROUTINGS)
    if log_tokens:
        lo, hi = max(tokens[0], 1), tokens[1]
        counts = [min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))) for _ in range(R)]
    else:
        counts = [rng.randint(*tokens) for _ in range(R)]
    if routing == "empty_ranks" and R > 1:
        for r in rng.sample(range(R), rng.randint(1, R - 1)):
            counts[r] = 0
    return Case(
        seed, R, L, rng.choice(hidden), rng.choice(ffn), K, tuple(counts), routing,
        minibatch=rng.choice(minibatches), ring_slots=rng.randint(1, 4),
    )  # fmt: skip


def draw_routing(case: Case, gen: torch.Generator) -> list[torch.Tensor]:
    """Per rank [T, K] global expert ids, distinct per token (or -1 for an unused slot with ``holes``)."""
    E = case.R * case.L
    out = []
    for T in case.tokens:
        scores = torch.rand(T, E, generator=gen)
        if case.routing == "zipf":
            pop = 1.0 / torch.arange(1, E + 1, dtype=torch.float) ** 1.5
            scores = scores ** (1.0 / pop)
        elif case.routing == "one_expert":
            scores[:, 0] = 2.0
        elif case.routing == "one_rank":  # rank 0's experts first, then the rest (top-k may exceed L)
            scores[:, : case.L] += 2.0
        idx = scores.topk(case.K, dim=1).indices
        if case.routing == "holes" and T:
            idx[torch.rand(T, case.K, generator=gen) < 0.25] = -1
        out.append(idx)
    return out
