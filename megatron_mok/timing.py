"""CUDA-event timing shared by the tuner (``mok tune``) and the benchmarks in benchmarks/."""

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


def cuda_call_and_device_ms(fn: Callable[[tuple], object], iters: int, warmup: int) -> tuple[float, float]:
    """(median call ms, median device ms) over ``iters`` calls of ``fn(events)``, after ``warmup`` calls.

    Call time: CUDA events around the whole call (as ``cuda_times_ms``: the host's preparation counts
    while the GPU waits for it). Device time: the ``(start, end)`` event pair ``fn`` records around the
    work it enqueues (e.g. ``mok_forward(..., gpu_events=events)``), which a host that queues
    ahead (a training step) hides its preparation behind."""
    for _ in range(warmup):
        fn((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
    torch.cuda.synchronize()
    call, dev = [], []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        s.record()
        fn(ev)
        e.record()
        e.synchronize()
        call.append(s.elapsed_time(e))
        dev.append(ev[0].elapsed_time(ev[1]))
    return statistics.median(call), statistics.median(dev)
