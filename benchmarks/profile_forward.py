#!/usr/bin/env python3
"""Where a MoK forward call's time goes: GPU time per operation (torch.profiler / CUPTI) and host time
per call, for the bf16 and the fp8 kernel on the Kimi-K2 slice (EP 1).

    python benchmarks/profile_forward.py [--calls 5] [--dtype bf16,fp8]

Prints, per dtype: host milliseconds per call (Python + library up to the launch returning), the
profiler's table of GPU operations (kernel, memsets, the tensor-map upload) over --calls back-to-back
calls, and the wall time per call of those calls.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_common import make_inputs  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))
from emulated import mok_forward_emulated  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--dtype", default="bf16,fp8")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--comm-sms", type=int, default=16)
    ap.add_argument("--minibatch", type=int, default=2560)
    args = ap.parse_args()
    from megatron_mok.kernel.quant import quantize_expert_weights

    H, F, K, L, T = 7168, 2048, 8, 8, args.tokens
    x, idx, w, w1, w2 = make_inputs(H, F, K, L, T)
    w1l, w2l = [[w1[e] for e in range(L)]], [[w2[e] for e in range(L)]]
    kw = dict(comm_sms=args.comm_sms, ring_slots=3, minibatch_tokens=args.minibatch, check=False)
    for dtype in args.dtype.split(","):
        extra = {"fp8": quantize_expert_weights(w1l, w2l)} if dtype == "fp8" else {}

        def fn(extra=extra):
            return mok_forward_emulated([x], [idx], [w], w1l, w2l, **kw, **extra)

        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        host = []
        for _ in range(args.calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        print(
            f"\n=== {dtype}: host time per call (to the launch returning) {sorted(host)[len(host) // 2]:.3f} ms",
            flush=True,
        )
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                fn()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / args.calls
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        kernels.sort(key=lambda e: e.time_range.start)
        gaps = [b.time_range.start - a.time_range.end for a, b in zip(kernels, kernels[1:])]
        print(
            f"{dtype}: {len(kernels)} GPU ops in {args.calls} calls, wall {wall:.3f} ms per call under the profiler; "
            f"largest gaps between GPU ops (us): {sorted(gaps)[-6:]}",
            flush=True,
        )
        for e in kernels[:12]:
            print(f"  {e.name[:60]:60s} start {e.time_range.start:12.1f} dur {e.time_range.elapsed_us():10.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
