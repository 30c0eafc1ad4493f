#!/usr/bin/env python3
"""Where a forward launch that does not finish is stuck: every thread's last progress code, read while it runs.

Builds the ablation library and launches with its bit 256 (MOK_DEBUG=ablation=256): each thread writes its last
progress code (MOK_PROGRESS in csrc/mok, e.g. 0x12..: a producer about to wait for a free stage, 0x25..: an
FP8 consumer about to wait for a stage to land) into host-pinned memory in place of the timeline. The host
polls; if the launch has not finished after --wait seconds it prints, per CTA, the codes of the producer
thread, the rest of warpgroup 0 and each consumer warp's lane 0, grouped into the distinct patterns, and
exits without synchronising (the caller's timeout ends the process).

    python3 tools/diagnose_hang.py --dtype fp8 --comm 0
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

os.environ["MOK_DEBUG"] = "ablation=256"  # the ablation build, progress codes on (csrc/mok/common.cuh)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))

import torch  # noqa: E402

THREADS = 384
WATCH = [0, 1, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352]  # producer, WG0 rest, consumer warps' lane 0


class ProgressBuffer:
    """Stands in for megatron_mok.kernel.timeline.Timeline: host-pinned progress words the kernel writes."""

    def __init__(self) -> None:
        self.host: torch.Tensor | None = None
        self.count: torch.Tensor | None = None
        self.grid = 0

    def prepare(self, grid: int, device: torch.device) -> tuple[int, int, int]:
        self.grid = grid
        self.host = torch.zeros((grid * THREADS,), dtype=torch.int32).pin_memory()
        self.count = torch.zeros((grid,), dtype=torch.int32, device=device)
        return self.host.data_ptr(), self.count.data_ptr(), 1

    def codes(self) -> list[list[int]]:
        assert self.host is not None
        flat = [v & 0xFFFFFFFF for v in self.host.tolist()]
        return [flat[b * THREADS : (b + 1) * THREADS] for b in range(self.grid)]


def summarize(codes: list[list[int]]) -> str:
    patterns: dict[tuple, list[int]] = defaultdict(list)
    for b, c in enumerate(codes):
        key = tuple(f"{c[t]:08x}" for t in WATCH)
        patterns[key].append(b)
    lines = [f"threads shown: {WATCH}"]
    for key, ctas in sorted(patterns.items(), key=lambda kv: kv[1][0]):
        shown = ctas if len(ctas) <= 12 else ctas[:12] + ["..."]
        lines.append(f"{len(ctas):3d} CTAs {shown}: {' '.join(key)}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--comm", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--shape", default="4,512,256,4,1500", help="L,H,F,K,T")
    ap.add_argument("--mode", default="uniform")
    ap.add_argument("--minibatch", type=int, default=192)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--timeout-ms", type=float, default=2000.0)
    ap.add_argument("--wait", type=float, default=10.0)
    args = ap.parse_args()
    from mok_truth import make_backward_case

    import megatron_mok.kernel as kernel

    L, H, F, K, T = (int(v) for v in args.shape.split(","))
    x, idx, wts, w1, w2, _ = make_backward_case(args.ranks, L, H, F, K, [T] * args.ranks, args.mode, seed=1)
    kw = dict(comm_sms=args.comm, ring_slots=args.slots, minibatch_tokens=args.minibatch)
    if args.dtype == "fp8":
        from megatron_mok.kernel.quant import quantize_expert_weights

        kw["fp8"] = quantize_expert_weights(w1, w2)
    kernel.build_library()  # the (ablation) library is built and loaded before the clock starts
    kernel.is_available()
    torch.cuda.synchronize()
    buf = ProgressBuffer()
    done = torch.cuda.Event()
    t_launch = time.time()
    print("launching", flush=True)
    kernel.mok_forward_emulated(x, idx, wts, w1, w2, check=False, timeline=buf, timeout_ms=args.timeout_ms, **kw)
    done.record()
    # the wait runs from the launch's return: a first launch that builds the library (a snapshot was once read
    # at once, CTA by CTA, instead of after --wait) must not eat it up
    t0 = time.time()
    print(f"launch returned after {t0 - t_launch:.2f} s", flush=True)
    while time.time() - t0 < args.wait:
        if done.query():
            print(f"completed in < {time.time() - t0:.1f} s; last codes:")
            print(summarize(buf.codes()))
            kernel.check_last_error(R=args.ranks, L=L, timeout_ms=args.timeout_ms)
            print("no error recorded")
            return 0
        time.sleep(0.5)
    print(f"NOT FINISHED after {args.wait:.0f} s; last codes:")
    print(summarize(buf.codes()), flush=True)
    os._exit(3)


if __name__ == "__main__":
    sys.exit(main())
