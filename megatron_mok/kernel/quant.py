"""E4M3 expert weights with 128 x 128 block scales for the FP8 forward kernel (``kernel.dtype: fp8``).

Weights change once per optimizer step, so they are quantised outside the kernel (the activations are
quantised inside it: in the pull dispatch and the SwiGLU epilogue) and cached: ``Fp8WeightCache``
re-quantises a weight when its storage or its autograd version counter changed, or after any optimizer
step. Megatron's optimizers write the new weights through ``param.data`` (and the distributed optimizer
through its parameter buffer), which leaves the version counter alone, so the cache also keys on a
generation that a global ``torch.optim`` step post-hook advances (installed with the first cache);
code that changes weights any other way calls :func:`weights_changed`. Micro-batches of one step
share one quantisation.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .. import fp8
from . import ops

_generation = 0
_step_hook = None


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], fp32 [N / 128, K / 128]) as ``fp8.quantize_weight_128x128`` computes it
    (bit-identical for finite weights; a NaN poisons only its own value, not its whole block): on a CUDA bf16 weight
    with unit inner stride, a row stride of a multiple of 8 and a 16-byte aligned start, one kernel that reads w
    once (``mok::fp8_quantize_weight``, csrc/mok/quant/fp8_weight_quant.cuh); otherwise, or without the MoK
    kernels, the PyTorch recipe."""
    fast = w.is_cuda and w.dtype == torch.bfloat16 and w.dim() == 2 and w.stride(1) == 1
    if not (fast and w.stride(0) % 8 == 0 and w.data_ptr() % 16 == 0):
        return fp8.quantize_weight_128x128(w)
    from .build import BuildError

    N, K = w.shape
    if N % fp8.BLOCK or K % fp8.BLOCK:
        raise ValueError(f"weights: shape {tuple(w.shape)} must be multiples of {fp8.BLOCK} in both dimensions")
    try:
        ops.load()
    except (BuildError, OSError):
        return fp8.quantize_weight_128x128(w)
    return torch.ops.mok.fp8_quantize_weight(w)


def weights_changed() -> None:
    """Invalidate every cached FP8 weight (called after each optimizer step by the hook below)."""
    global _generation
    _generation += 1


def _install_optimizer_hook() -> None:
    global _step_hook
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _step_hook = register_optimizer_step_post_hook(lambda _opt, _args, _kwargs: weights_changed())


@dataclass
class Fp8ExpertWeights:
    """Per owner rank q and local expert e: fc1 ``w1q[q][e]`` e4m3 [2F, H] with ``w1s[q][e]`` fp32
    [2F/128, H/128], fc2 ``w2q[q][e]`` e4m3 [H, F] with ``w2s[q][e]`` fp32 [H/128, F/128].

    The FP8 dgrad (backward kernel) reads the transposes, K-major as 8-bit WGMMA operands must be:
    ``w1tq`` [H, 2F] / ``w1ts`` [H/128, 2F/128] and ``w2tq`` [F, H] / ``w2ts`` [F/128, H/128]. A 128 x 128
    block quantisation of W^T is the transpose of W's (same blocks, same amax), so these are plain
    transposed copies (``with_transposes``); None until made."""

    w1q: list[list[torch.Tensor]]
    w1s: list[list[torch.Tensor]]
    w2q: list[list[torch.Tensor]]
    w2s: list[list[torch.Tensor]]
    w1tq: list[list[torch.Tensor]] | None = None
    w1ts: list[list[torch.Tensor]] | None = None
    w2tq: list[list[torch.Tensor]] | None = None
    w2ts: list[list[torch.Tensor]] | None = None

    def with_transposes(self) -> Fp8ExpertWeights:
        """These weights with the transposed copies filled in (made here if missing; uncached)."""
        if self.w1tq is not None:
            return self
        t = lambda lst: [[v.t().contiguous() for v in r] for r in lst]  # noqa: E731
        return Fp8ExpertWeights(
            self.w1q, self.w1s, self.w2q, self.w2s, t(self.w1q), t(self.w1s), t(self.w2q), t(self.w2s)
        )


class Fp8WeightCache:
    """Quantised copies of bf16 weights, reused while the weight is unchanged."""

    def __init__(self) -> None:
        _install_optimizer_hook()
        # id(w) -> (weak reference to w, its storage/version key, e4m3 copy, scales); the weak reference
        # makes a new tensor that reuses a freed one's id (and maybe its memory) a miss, not a stale hit
        self._entries: dict[int, tuple[weakref.ref, tuple, torch.Tensor, torch.Tensor]] = {}
        # id(w) -> (the e4m3 copy they were made from, its transpose, the scales' transpose): FP8 dgrad
        self._transposed: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # transposed flag -> (key, weak references to the weights, the Fp8ExpertWeights): experts()'s answer
        self._sets: dict[bool, tuple[tuple, list[weakref.ref], Fp8ExpertWeights]] = {}

    @staticmethod
    def _key(w: torch.Tensor) -> tuple:
        return (w.data_ptr(), w._version, _generation, tuple(w.shape), tuple(w.stride()), w.dtype, w.device)

    def get(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = self._key(w)
        hit = self._entries.get(id(w))
        if hit is not None and hit[0]() is w and hit[1] == key:
            return hit[2], hit[3]
        with torch.no_grad():
            q, s = quantize_weight(w.detach())
        q, s = q.contiguous(), s.contiguous()
        self._entries = {k: v for k, v in self._entries.items() if v[0]() is not None}  # drop dead weights
        self._transposed = {k: v for k, v in self._transposed.items() if k in self._entries}
        self._entries[id(w)] = (weakref.ref(w), key, q, s)
        return q, s

    def get_transposed(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(W^T e4m3, scales^T) of the current quantisation of w, made once per quantisation."""
        q, s = self.get(w)
        hit = self._transposed.get(id(w))
        if hit is not None and hit[0] is q:
            return hit[1], hit[2]
        qt, st = q.t().contiguous(), s.t().contiguous()
        self._transposed[id(w)] = (q, qt, st)
        return qt, st

    def experts(
        self, w1: list[list[torch.Tensor]], w2: list[list[torch.Tensor]], transposed: bool = False
    ) -> Fp8ExpertWeights:
        """Per-rank lists of bf16 expert weights -> their cached quantisation (``transposed``: with the
        FP8 dgrad's transposed copies, cached too).

        A layer asks for the same weights on every call, and the per-weight look-up (shape, strides,
        version of each of 2 x L tensors) was a visible part of its host time: the whole answer is kept
        and handed back while the same tensor objects (weak references) sit at the same addresses with
        the same versions and no optimizer step has happened since."""
        flat = [t for per_rank in w1 for t in per_rank] + [t for per_rank in w2 for t in per_rank]
        key = (
            _generation,
            tuple(len(r) for r in w1),
            tuple(len(r) for r in w2),
            tuple(map(id, flat)),
            tuple(t.data_ptr() for t in flat),
            tuple(t._version for t in flat),
        )
        last = self._sets.get(transposed)
        if last is not None and last[0] == key and all(r() is t for r, t in zip(last[1], flat)):
            return last[2]
        out = self._experts(w1, w2, transposed)
        self._sets[transposed] = (key, [weakref.ref(t) for t in flat], out)
        return out

    def _experts(
        self, w1: list[list[torch.Tensor]], w2: list[list[torch.Tensor]], transposed: bool
    ) -> Fp8ExpertWeights:
        p1 = [[self.get(t) for t in per_rank] for per_rank in w1]
        p2 = [[self.get(t) for t in per_rank] for per_rank in w2]
        out = Fp8ExpertWeights(
            w1q=[[a for a, _ in r] for r in p1],
            w1s=[[b for _, b in r] for r in p1],
            w2q=[[a for a, _ in r] for r in p2],
            w2s=[[b for _, b in r] for r in p2],
        )
        if transposed:
            t1 = [[self.get_transposed(t) for t in per_rank] for per_rank in w1]
            t2 = [[self.get_transposed(t) for t in per_rank] for per_rank in w2]
            out.w1tq, out.w1ts = [[a for a, _ in r] for r in t1], [[b for _, b in r] for r in t1]
            out.w2tq, out.w2ts = [[a for a, _ in r] for r in t2], [[b for _, b in r] for r in t2]
        return out

    def clear(self) -> None:
        self._entries.clear()
        self._transposed.clear()
        self._sets.clear()


def quantize_expert_weights(
    w1: list[list[torch.Tensor]], w2: list[list[torch.Tensor]], transposed: bool = False
) -> Fp8ExpertWeights:
    """One-off quantisation (no cache) of per-rank lists of bf16 expert weights (``transposed``: also
    the FP8 dgrad's transposed copies)."""
    return Fp8WeightCache().experts(w1, w2, transposed=transposed)
