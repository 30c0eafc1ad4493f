"""CUDA-event timing shared by the tuner (``mok tune``) and the benchmarks in scripts/."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def cuda_times_ms(fn: Callable[[], object], iters: int, warmup: int) -> tuple[float, float]:
    """(median, min) milliseconds of fn() over ``iters`` calls, each between its own CUDA events on the
    current stream, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times), min(times)


def cuda_pipelined_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Mean milliseconds per call of ``iters`` back-to-back calls between ONE pair of CUDA events, after
    ``warmup`` calls: the host queues ahead as in a training step, so its per-call Python / launch
    overhead is hidden unless the caller is host-bound (``cuda_times_ms`` includes it in every call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / iters
