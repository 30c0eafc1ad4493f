#!/usr/bin/env python3
"""Host time of one MoK forward call, by part (H200 or any CUDA GPU): what a per-call CUDA-event timing
adds to the layer's device time while the GPU waits for the launch.

For each slice of benchmarks/bench_fp8.py (Kimi-K2 L=8, DeepSeek-V3 L=32) and kernel (bf16, fp8) it prints
the median microseconds of the whole call and of its parts: the ``mok::forward`` operator (dispatch, argument
checks, tensor maps, staging upload, zeroing, the cooperative launch) and the rest (the Python wrapper, its
allocations and the FP8 weight cache look-up).

With ``--layer`` it takes Megatron's MoE layer instead (the Kimi-K2 slice's bf16 and FP8 configs, stock router,
``mok`` dispatcher, as ``bench_ceilings.py`` builds it) and splits the host time of its forward into Megatron's
router, the routing conversion, the expert-path check, the expert weights' look-up, the plan, the backend choice,
the autograd node, the kernel call's Python wrapper, its FP8 weight look-up and the ``mok::forward`` operator (each
part without the parts nested in it); the rest is Megatron's layer and the dispatcher.
    python benchmarks/host_overhead.py [--shapes kimi,dsv3] [--calls 50] [--json out.json]
    python benchmarks/host_overhead.py --layer [--tokens 8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when loaded as a module (tests)
from bench_common import make_inputs  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))
from bench_fp8 import SHAPES  # noqa: E402
from emulated import mok_forward_emulated  # noqa: E402
from result_file import write_result  # noqa: E402

from megatron_mok.kernel import check_last_error  # noqa: E402


class PartTimer:
    """Wraps callables and sums their wall time per call of the outer function. A part called inside another counts
    for itself only: the outer part's time is what remains without it, so the parts add up to no more than the
    whole."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = {}
        self._inner: list[float] = []  # per open part: the time of the parts nested in it so far

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*a, **k):
            self._inner.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent = time.perf_counter() - t0
                inner = self._inner.pop()
                self.acc[name] = self.acc.get(name, 0.0) + spent - inner
                if self._inner:
                    self._inner[-1] += spent

        return timed


def measure(fn, timer: PartTimer, calls: int) -> dict[str, float]:
    per: dict[str, list[float]] = {}
    for _ in range(calls):
        torch.cuda.synchronize()  # the GPU idle, as in a per-call timing
        timer.acc.clear()
        t0 = time.perf_counter()
        fn()
        total = time.perf_counter() - t0
        parts = dict(timer.acc)
        parts["rest"] = total - sum(parts.values())
        parts["total"] = total
        for k, v in parts.items():
            per.setdefault(k, []).append(v * 1e6)
    torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in per.items()}


def shape_overheads(name: str, args, timer: PartTimer) -> list[dict]:
    from megatron_mok.kernel.quant import quantize_expert_weights

    H, F, K, L, T = SHAPES[name]
    x, idx, w, w1, w2 = make_inputs(H, F, K, L, T)
    w1l, w2l = [[w1[e] for e in range(L)]], [[w2[e] for e in range(L)]]
    q8 = quantize_expert_weights(w1l, w2l)
    kw = dict(comm_sms=args.comm_sms, ring_slots=args.ring_slots, minibatch_tokens=args.minibatch, check=False)
    out = []
    for kind, extra in (("bf16", {}), ("fp8", {"fp8": q8})):

        def fn(extra=extra):
            return mok_forward_emulated([x], [idx], [w], w1l, w2l, **kw, **extra)

        for _ in range(3):
            fn()
        check_last_error()
        got = measure(fn, timer, args.calls)
        parts = " | ".join(f"{k} {v:7.1f}" for k, v in got.items() if k != "total")
        print(f"{name:5s} L={L:3d} {kind:4s}: host {got['total']:7.1f} us per call = {parts} (us, medians)", flush=True)
        out.append({"shape": name, "L": L, "kind": kind, **got})
    return out


def layer_overheads(args, timer: PartTimer) -> list[dict]:
    """The layer forward's host time by part (disjoint parts; ``rest`` is what none of them covers)."""
    from bench_ceilings import build_layer
    from megatron.core import tensor_parallel

    import megatron_mok
    import megatron_mok.dispatcher as dispatcher
    from megatron_mok.kernel import routing
    from megatron_mok.testing import init_one_rank

    init_one_rank("nccl")
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    megatron_mok.register()
    saved = {(routing, "topk_from_routing_map"): routing.topk_from_routing_map,
             (dispatcher, "expert_weights"): dispatcher.expert_weights,
             (dispatcher, "mok_moe"): dispatcher.mok_moe,
             (torch.ops.mok, "forward"): torch.ops.mok.forward}  # fmt: skip
    routing.topk_from_routing_map = timer.wrap("routing conversion", routing.topk_from_routing_map)
    dispatcher.expert_weights = timer.wrap("expert weights", dispatcher.expert_weights)
    dispatcher.mok_moe = timer.wrap("autograd node", dispatcher.mok_moe)
    real_op = saved[(torch.ops.mok, "forward")]
    torch.ops.mok.forward = timer.wrap("operator", lambda *a: real_op(*a))
    out = []
    try:
        for config in ("kimi-k2", "kimi-k2-fp8"):
            layer = build_layer(config, 8)
            d = layer.token_dispatcher
            x = torch.randn(args.tokens, 1, d.config.hidden_size, device="cuda", dtype=torch.bfloat16)
            x.requires_grad_()
            layer(x)  # the backend chosen, the library loaded, the FP8 weights cached
            backend = d.backend_for(x.view(-1, x.shape[-1]), saved[(dispatcher, "expert_weights")](layer.experts)[1][0])
            layer.router.forward = timer.wrap("router", layer.router.forward)
            layer._resolve_expert_path = timer.wrap("expert path", layer._resolve_expert_path)
            d.plan = timer.wrap("plan", d.plan)
            d.backend_for = timer.wrap("backend choice", d.backend_for)
            backend.forward = timer.wrap("kernel call", backend.forward)
            backend._fp8_weights = timer.wrap("fp8 weights", backend._fp8_weights)
            try:
                for _ in range(3):
                    layer(x)
                check_last_error()
                got = measure(functools.partial(layer, x), timer, args.calls)
            finally:
                del layer.router.forward, layer._resolve_expert_path, d.plan, d.backend_for
                del backend.forward, backend._fp8_weights
            parts = " | ".join(f"{k} {v:7.1f}" for k, v in got.items() if k != "total")
            print(f"layer {config:12s}: host {got['total']:7.1f} us per forward = {parts} (us, medians)", flush=True)
            out.append({"config": config, "tokens": args.tokens, **got})
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="kimi,dsv3")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--comm-sms", type=int, default=0)
    ap.add_argument("--minibatch", type=int, default=4096)
    ap.add_argument("--ring-slots", type=int, default=4)
    ap.add_argument("--layer", action="store_true", help="Megatron's MoE layer forward instead of the kernel call")
    ap.add_argument("--tokens", type=int, default=8192, help="with --layer: tokens per forward")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import megatron_mok.kernel as mk

    if not mk.is_available():
        print(f"MoK kernel unavailable: {mk.unavailable_reason()}")
        return 1
    timer = PartTimer()
    if args.layer:
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
        out = layer_overheads(args, timer)
        if args.json:
            write_result(args.json, "host_overhead", out)
        return 0
    # the operator call: its argument checks, tensor maps, staging upload, zeroing and the cooperative launch
    real = torch.ops.mok.forward
    wrapped = timer.wrap("operator", lambda *a: real(*a))
    torch.ops.mok.forward = wrapped
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    out: list[dict] = []
    for name in args.shapes.split(","):
        out += shape_overheads(name, args, timer)
        torch.cuda.empty_cache()
    if args.json:
        write_result(args.json, "host_overhead", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
