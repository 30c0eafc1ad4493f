"""FP8 block-scaled grouped GEMM units vs bf16 on a Hopper GPU, the Kimi-K2 slice over 8 experts x 8192 rows: the
forward unit's fc1 (K = H 7168 -> N = 2F 4096) and fc2 (K = F 2048 -> N = H 7168), and with ``--wgrad`` the
weight-gradient unit's dW1 = dH^T x (2F 4096 x H 7168) and dW2 = gy^T act (H 7168 x F 2048), reduced over each
expert's tokens, and the time its operands take to quantise from layout-order rows.

Prints ms, TFLOP/s, the ratio to per-expert bf16 cuBLAS GEMMs, to one dense bf16 GEMM of the same size and to
one dense FP8 GEMM of the same size with the same block scales (cuBLAS, ``torch._scaled_mm``) in the same run, and
the FP8 output's relative error against the bf16 product.
    python benchmarks/bench_fp8_gemm.py [--rows-per-expert 8192] [--experts 8] [--wgrad]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fp8 import blockwise_mm, runs_here  # noqa: E402

from megatron_mok import fp8  # noqa: E402
from megatron_mok.kernel.gemm import fp8_grouped_gemm, fp8_wgrad_gemm, quantize_tokens  # noqa: E402
from megatron_mok.timing import cuda_pipelined_ms, cuda_times_ms  # noqa: E402


def _cublas_ceiling(block: Callable[[], torch.Tensor], iters: int, unit_ms: float, tf: Callable[[float], float]) -> str:
    """One dense cuBLAS FP8 GEMM of the same FLOPs with the unit's block scales, and the unit's share of its speed
    (empty where this torch / GPU cannot run it)."""
    if not runs_here("dense FP8 block-scaled", block):
        return ""
    ms = cuda_times_ms(block, iters, 2)[0]
    return f" | dense FP8 block-scaled (cuBLAS) {ms:.3f} ms = {tf(ms):.0f} -> unit at {ms / unit_ms:.1%}"


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

    # scales of its own layout (values do not change the time)
    bl = _cublas_ceiling(blockwise_mm(xq, wq[0].t(), b_blocks=128), iters, f8_ms, tf)
    print(
        f"{name} [{L} x {M} rows, K {K} -> N {N}]: fp8 {f8_ms:.3f} ms (min {f8_min:.3f}, pipelined {f8_pipe:.3f}) "
        f"= {tf(f8_ms):.0f} TFLOP/s | bf16 per-expert mm {bf_ms:.3f} ms = {tf(bf_ms):.0f} -> fp8 {bf_ms / f8_ms:.2f}x | "
        f"dense bf16 {dn_ms:.3f} ms = {tf(dn_ms):.0f}{bl} | fp8 rel err vs bf16 product {err:.2e}",
        flush=True,
    )


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def bench_wgrad(name: str, M: int, N: int, L: int, T: int, iters: int) -> None:
    """out_e = a_e^T b_e [M, N] over T tokens of each of L experts: the FP8 unit (fp32 out, stored and accumulated)
    against per-expert bf16 cuBLAS GEMMs on the token rows as the backward holds them ([T, M] and [T, N])."""
    dev = torch.device("cuda")
    flops = 2.0 * L * T * M * N
    ra = torch.randn(L * T, M, device=dev).bfloat16()
    rb = torch.randn(L * T, N, device=dev).bfloat16()
    a, sa, counts = fp8.token_major_operand(ra, [T] * L)
    b, sb, _ = fp8.token_major_operand(rb, [T] * L)
    out = fp8_wgrad_gemm(a, sa, b, sb, counts)
    seg = [slice(e * T, (e + 1) * T) for e in range(L)]
    err = max(_rel_err(o, (ra[s].t() @ rb[s]).float()) for o, s in zip(out, seg))
    f8_ms, f8_min = cuda_times_ms(lambda: fp8_wgrad_gemm(a, sa, b, sb, counts, out=out), iters, 2)
    acc_ms, _ = cuda_times_ms(lambda: fp8_wgrad_gemm(a, sa, b, sb, counts, out=out, accumulate=True), iters, 2)
    bf_ms, _ = cuda_times_ms(lambda: [ra[s].t() @ rb[s] for s in seg], iters, 2)
    dn_ms, _ = cuda_times_ms(lambda: ra.t() @ rb, iters, 2)  # one reduction over all L x T tokens: same FLOPs

    tpe = torch.full((L,), T, dtype=torch.int32, device=dev)
    qa_ms, _ = cuda_times_ms(lambda: quantize_tokens(ra, tpe), iters, 2)  # the operands from layout-order rows
    qb_ms, _ = cuda_times_ms(lambda: quantize_tokens(rb, tpe), iters, 2)
    quant = f" | quantising a {qa_ms:.3f} ms, b {qb_ms:.3f} ms ({3 * L * T * (M + N) / (qa_ms + qb_ms) / 1e6:.0f} GB/s)"

    def tf(ms: float) -> float:
        return flops / (ms * 1e-3) / 1e12

    bl = _cublas_ceiling(blockwise_mm(a, b.t(), b_blocks=1), iters, f8_ms, tf)  # 1 x 128 along the tokens, both
    print(
        f"{name} [{L} x {T} tokens, {M} x {N}]: fp8 {f8_ms:.3f} ms (min {f8_min:.3f}; accumulating {acc_ms:.3f}) "
        f"= {tf(f8_ms):.0f} TFLOP/s | bf16 per-expert mm {bf_ms:.3f} ms = {tf(bf_ms):.0f} -> fp8 {bf_ms / f8_ms:.2f}x | "
        f"dense bf16 {dn_ms:.3f} ms = {tf(dn_ms):.0f}{bl}{quant} | fp8 rel err vs bf16 product {err:.2e}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows-per-expert", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--wgrad", action="store_true", help="the weight-gradient unit (dW1, dW2) instead of fc1 / fc2")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    if args.wgrad:
        for name, M, N in (("dW1", 4096, 7168), ("dW2", 7168, 2048)):
            bench_wgrad(name, M, N, args.experts, args.rows_per_expert, args.iters)
        return
    for name, K, N in (("fc1", 7168, 4096), ("fc2", 2048, 7168)):
        bench_shape(name, K, N, args.experts, args.rows_per_expert, args.iters)


if __name__ == "__main__":
    main()
