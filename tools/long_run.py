#!/usr/bin/env python3
"""Run a Megatron MoE layer with ``mok`` for many forward + backward steps and check that nothing creeps: the memory
allocated after a warm-up equals the memory after the last step, no step takes more than twice the median, and the
host's time per step stays flat.

The layer is Megatron's own (the local spec, Megatron's router) at a Kimi-K2 slice (hidden 7168, expert ffn 2048,
top-8, 8 experts at EP 1), bf16 or FP8 (the shipped config's kernel settings); each step draws new tokens, so the
routing changes every step, and a plain SGD step updates every weight after it (so the FP8 weight copies are made
anew each step).

    python tools/long_run.py --dtype bf16 --steps 1000 --tokens 4096 [--json out.json]

Prints one line per dtype: steps, memory after the warm-up and at the end, the device time per step (median, max and
the max / median ratio), the host time per step (median of the first and the last 100 steps) and PASS / FAIL.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MAX_STEP_OVER_MEDIAN = 2.0  # no step more than twice the median device time
MAX_HOST_CREEP = 1.5  # the last 100 steps' median host time over the first 100 steps'


def _init() -> None:
    from megatron.core import tensor_parallel

    from megatron_mok.testing import init_one_rank

    init_one_rank()
    tensor_parallel.model_parallel_cuda_manual_seed(0)


def build_layer(dtype: str, hidden: int, ffn: int, experts: int, topk: int) -> torch.nn.Module:
    import dataclasses

    from megatron_mok.config import load_config, parse_config
    from megatron_mok.testing import build_moe_layer, moe_transformer_config

    shipped = load_config("kimi-k2-fp8" if dtype == "fp8" else "kimi-k2")
    mok_cfg = parse_config(
        {
            "model": {
                "name": f"long-run-{dtype}",
                "hidden_size": hidden,
                "moe_ffn_hidden_size": ffn,
                "num_moe_experts": experts,
                "moe_router_topk": topk,
            },
            "kernel": dataclasses.asdict(shipped.kernel),
        },
        shipped.source,
    )
    tc = moe_transformer_config(
        hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts, topk=topk, dtype=torch.bfloat16
    )
    tc.mok_config = mok_cfg
    torch.manual_seed(0)
    return build_moe_layer(tc).cuda()


def run(dtype: str, steps: int, warmup: int, tokens: int, hidden: int, ffn: int, experts: int, topk: int) -> dict:
    """``steps`` forward + backward steps after ``warmup`` ones; the figures and whether they pass."""
    torch.cuda.reset_peak_memory_stats()  # this dtype's peak, not an earlier run's
    layer = build_layer(dtype, hidden, ffn, experts, topk)
    gen = torch.Generator(device="cuda").manual_seed(1)

    def step() -> None:
        x = torch.randn((tokens, 1, hidden), generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
        out, _ = layer(x)
        out.float().square().mean().backward()
        with torch.no_grad():  # a plain SGD step: the weights change (the FP8 weight copies are made anew) and so
            for p in layer.parameters():  # does the router
                if p.grad is not None:
                    p.add_(p.grad, alpha=-1e-4)
                p.grad = None

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    mem_after_warmup = torch.cuda.memory_allocated()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    host_us = []
    for s, e in events:
        t = time.perf_counter()
        s.record()
        step()
        e.record()
        host_us.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    mem_end = torch.cuda.memory_allocated()
    from megatron_mok.kernel import check_pending_errors

    check_pending_errors(wait=True)
    device_ms = [s.elapsed_time(e) for s, e in events]
    med = statistics.median(device_ms)
    window = min(100, steps)
    host_first, host_last = statistics.median(host_us[:window]), statistics.median(host_us[-window:])
    backends = sorted({m.token_dispatcher.last_backend for m in layer.modules() if hasattr(m, "token_dispatcher")})
    res = {
        "dtype": dtype,
        "steps": steps,
        "warmup": warmup,
        "tokens": tokens,
        "shape": dict(hidden=hidden, ffn=ffn, experts=experts, topk=topk),
        "backend": backends,
        "memory_after_warmup_bytes": mem_after_warmup,
        "memory_end_bytes": mem_end,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(),
        "device_ms_median": med,
        "device_ms_max": max(device_ms),
        "device_max_over_median": max(device_ms) / med,
        "host_us_first_median": host_first,
        "host_us_last_median": host_last,
        "host_creep": host_last / host_first,
    }
    res["passed"] = (
        mem_end == mem_after_warmup
        and res["device_max_over_median"] <= MAX_STEP_OVER_MEDIAN
        and res["host_creep"] <= MAX_HOST_CREEP
        and backends == ["kernel"]
    )
    return res


def summary(r: dict) -> str:
    return (
        f"{r['dtype']}: {r['steps']} steps of {r['tokens']} tokens ({r['backend']}), memory after warm-up "
        f"{r['memory_after_warmup_bytes']} B, at the end {r['memory_end_bytes']} B, peak "
        f"{r['peak_memory_bytes'] / 2**30:.2f} GiB; device ms/step median {r['device_ms_median']:.3f}, max "
        f"{r['device_ms_max']:.3f} ({r['device_max_over_median']:.2f}x); host us/step first 100 "
        f"{r['host_us_first_median']:.0f}, last 100 {r['host_us_last_median']:.0f} ({r['host_creep']:.2f}x): "
        f"{'PASS' if r['passed'] else 'FAIL'}"
    )


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16,fp8", help="comma-separated: bf16, fp8")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    dtypes = args.dtype.split(",")
    for d in dtypes:
        if d not in ("bf16", "fp8"):
            ap.error(f"--dtype: unknown {d!r} (bf16, fp8)")
    for name in ("steps", "warmup", "tokens", "hidden", "ffn", "experts", "topk"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.topk > args.experts:
        ap.error(f"--topk {args.topk} exceeds --experts {args.experts}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the kernels' memory and step times are what it checks)")
    warnings.filterwarnings("ignore")
    _init()
    results = []
    for d in dtypes:
        r = run(d, args.steps, args.warmup, args.tokens, args.hidden, args.ffn, args.experts, args.topk)
        print(summary(r), flush=True)
        results.append(r)
        torch.cuda.empty_cache()  # the layer of this dtype is gone
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    sys.exit(0 if all(r["passed"] for r in main()) else 1)
