"""FP8 block-scaled grouped GEMM unit vs bf16 on a Hopper GPU: the Kimi-K2 slice's fc1
(K = H 7168 -> N = 2F 4096) and fc2 (K = F 2048 -> N = H 7168) over 8 experts x 8192 rows.

Prints ms, TFLOP/s, the ratio to per-expert bf16 cuBLAS GEMMs, to one dense bf16 GEMM of the same size and to
one dense FP8 GEMM of the same size with the same block scales (cuBLAS, ``torch._scaled_mm``) in the same run, and
the FP8 output's relative error against the bf16 product.
    python benchmarks/bench_fp8_gemm.py [--rows-per-expert 8192] [--experts 8]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fp8 import blockwise_mm, runs_here  # noqa: E402

from megatron_mok import fp8  # noqa: E402
from megatron_mok.kernel.gemm import fp8_grouped_gemm  # noqa: E402
from megatron_mok.timing import cuda_pipelined_ms, cuda_times_ms  # noqa: E402


def bench_shape(name: str, K: int, N: int, L: int, M: int, iters: int) -> None:
    dev = torch.device("cuda")
    flops = 2.0 * L * M * K * N
    x = torch.randn(L * M, K, device=dev).bfloat16()
    w = [(torch.randn(N, K, device=dev) / K**0.5).bfloat16() for _ in range(L)]
    xq, xs = fp8.quantize_act_1x128(x)
    wq, ws = (list(t) for t in zip(*[fp8.quantize_weight_128x128(t) for t in w]))
    counts = [M] * L
    out = fp8_grouped_gemm(xq, xs, wq, ws, counts)
    ref = torch.cat([x[e * M : (e + 1) * M] @ w[e].t() for e in range(L)])
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()

    def run_fp8():
        return fp8_grouped_gemm(xq, xs, wq, ws, counts, out=out)

    f8_ms, f8_min = cuda_times_ms(run_fp8, iters, 2)
    f8_pipe = cuda_pipelined_ms(run_fp8, iters, 1)
    bf_ms, _ = cuda_times_ms(lambda: [x[e * M : (e + 1) * M] @ w[e].t() for e in range(L)], iters, 2)
    big, wd = torch.randn(L * M, K, device=dev).bfloat16(), w[0]
    dn_ms, _ = cuda_times_ms(lambda: big @ wd.t(), iters, 2)

    def tf(ms: float) -> float:
        return flops / (ms * 1e-3) / 1e12

    block = blockwise_mm(xq, wq[0].t(), b_blocks=128)  # scales of its own layout (values do not change the time)
    bl = ""
    if runs_here("dense FP8 block-scaled", block):
        bl_ms = cuda_times_ms(block, iters, 2)[0]
        bl = f" | dense FP8 block-scaled (cuBLAS) {bl_ms:.3f} ms = {tf(bl_ms):.0f} -> unit at {bl_ms / f8_ms:.1%}"

    print(
        f"{name} [{L} x {M} rows, K {K} -> N {N}]: fp8 {f8_ms:.3f} ms (min {f8_min:.3f}, pipelined {f8_pipe:.3f}) "
        f"= {tf(f8_ms):.0f} TFLOP/s | bf16 per-expert mm {bf_ms:.3f} ms = {tf(bf_ms):.0f} -> fp8 {bf_ms / f8_ms:.2f}x | "
        f"dense bf16 {dn_ms:.3f} ms = {tf(dn_ms):.0f}{bl} | fp8 rel err vs bf16 product {err:.2e}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows-per-expert", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    for name, K, N in (("fc1", 7168, 4096), ("fc2", 2048, 7168)):
        bench_shape(name, K, N, args.experts, args.rows_per_expert, args.iters)


if __name__ == "__main__":
    main()
