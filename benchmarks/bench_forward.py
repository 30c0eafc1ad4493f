#!/usr/bin/env python3
"""Benchmark the fused MoK forward megakernel against unfused torch and Megatron-Core baselines.

One process, same inputs for every method. CUDA events, warmup, median of --iters.
  MoK        : megatron_mok.kernel.mok_forward (EP 1, one launch)
  torch      : permute (argsort) + torch._grouped_mm fc1 + SwiGLU + torch._grouped_mm fc2 + unpermute + weighted sum
  mcore      : Megatron-Core MoEAlltoAllTokenDispatcher + SequentialMLP at EP=1 (if megatron.core imports)
  dense      : torch.mm bf16 ceiling at the fc1 and fc2 shapes with the same row count
TFLOP/s counts 2*rows*H*2F + 2*rows*F*H (rows = routed (token, k) rows).

  python benchmarks/bench_forward.py                       # kimi + qwen shapes
  python benchmarks/bench_forward.py --shapes kimi --sweep # also sweep comm_sms x minibatch
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_common import PEAK, make_inputs, mcore_forward, mcore_layer, pipelined, timeit  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))
from emulated import mok_forward_emulated  # noqa: E402
from result_file import write_result  # noqa: E402

from megatron_mok import env  # noqa: E402
from megatron_mok.kernel import check_last_error  # noqa: E402
from megatron_mok.kernel.tuning import ForwardTuning  # noqa: E402


def tuning(raster: int | None) -> ForwardTuning:
    """The forward tuning of a benchmark row: its ticket order (None: the kernel's measured default)."""
    return ForwardTuning(tile_raster=raster)


SHAPES = {
    # name: (H, F, K, L, tokens)
    "kimi": (7168, 2048, 8, 8, 8192),  # Kimi-K2 per-GPU slice: 65536 routed rows, 8 local experts
    "qwen": (2048, 768, 8, 16, 4096),  # Qwen3-30B-A3B-like slice: 32768 rows, 16 local experts
}


def torch_forward(x, idx, w, w1t, w2t, L, F):
    T, H = x.shape
    K = idx.shape[1]
    flat = idx.view(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=L)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x.index_select(0, order // K)
    h = torch._grouped_mm(xs, w1t, offs=offs)
    a = (torch.nn.functional.silu(h[:, :F].float()) * h[:, F:].float()).bfloat16()
    y = torch._grouped_mm(a, w2t, offs=offs)
    yk = torch.empty_like(y)
    yk[order] = y
    return (yk.view(T, K, H).float() * w.unsqueeze(-1)).sum(1).bfloat16()


def dense_ceiling(rows, H, F, iters, warmup):
    a = torch.randn((rows, H), device="cuda").bfloat16()
    b1 = torch.randn((H, 2 * F), device="cuda").bfloat16()
    a2 = torch.randn((rows, F), device="cuda").bfloat16()
    b2 = torch.randn((F, H), device="cuda").bfloat16()
    t1, _ = timeit(lambda: torch.mm(a, b1), iters, warmup)
    t2, _ = timeit(lambda: torch.mm(a2, b2), iters, warmup)
    return t1, t2


def bench_shape(name, args, results):
    import megatron_mok.kernel as mk

    H, F, K, L, T = SHAPES[name]
    rows = T * K
    flops = 2.0 * rows * H * 2 * F + 2.0 * rows * F * H
    tf = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    x, idx, w, w1, w2 = make_inputs(H, F, K, L, T)
    w1l = [[w1[e] for e in range(L)]]
    w2l = [[w2[e] for e in range(L)]]
    print(f"\n=== {name}: H={H} F={F} top-{K} L={L} tokens={T} rows={rows} ({flops / 1e12:.2f} TFLOP) ===", flush=True)
    res = {"shape": name, "H": H, "F": F, "K": K, "L": L, "tokens": T, "rows": rows, "tflop": flops / 1e12}

    # correctness spot check vs torch baseline
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)
    ref = torch_forward(x, idx, w, w1t, w2t, L, F)

    configs = [(args.comm_sms, args.minibatch, args.raster)]
    if args.sweep:
        configs = [(c, m, r) for r in args.sweep_raster for c in args.sweep_comm for m in args.sweep_mb]
    best = None
    for comm, mb, raster in configs:
        try:
            kw = dict(comm_sms=comm, ring_slots=args.ring_slots, minibatch_tokens=mb, tuning=tuning(raster))
            out, _, _ = mok_forward_emulated([x], [idx], [w], w1l, w2l, **kw)
            err = ((out[0].float() - ref.float()).norm() / ref.float().norm()).item()
            fn = lambda kw=kw: mok_forward_emulated([x], [idx], [w], w1l, w2l, check=False, **kw)  # noqa: E731
            ms, mn = timeit(fn, args.iters, args.warmup)
            ms_pipe = pipelined(fn, args.iters, 1)
            check_last_error()
            print(
                f"MoK comm_sms={comm:3d} minibatch={mb:5d} slots={args.ring_slots} raster={raster}: {ms:8.3f} ms (min {mn:.3f}) "
                f"{tf(ms):7.1f} TFLOP/s  {tf(ms) / PEAK * 100:5.1f}% of {PEAK:.0f}  back-to-back {ms_pipe:.3f} ms  "
                f"rel.err vs torch {err:.2e}",
                flush=True,
            )
            res.setdefault("mok", []).append(
                {
                    "comm_sms": comm,
                    "minibatch": mb,
                    "raster": raster,
                    "ms": ms,
                    "ms_back_to_back": ms_pipe,
                    "tflops": tf(ms),
                    "rel_err_vs_torch": err,
                }
            )
            if best is None or ms < best[0]:
                best = (ms, comm, mb, raster)
        except Exception as exc:
            print(f"MoK comm_sms={comm} minibatch={mb}: FAILED {type(exc).__name__}: {exc}", flush=True)
            res.setdefault("mok_fail", []).append(str(exc))
            if isinstance(exc, mk.MokKernelError):
                break

    if best and not args.no_training:
        # the training forward (what the layer runs under autograd): saved h, and saved h + kept x / act rows
        # (kernel.save_expert_input: the caller's layout-order buffers stand in for the ring)
        kw = dict(comm_sms=best[1], ring_slots=args.ring_slots, minibatch_tokens=best[2], tuning=tuning(best[3]))
        hbuf = [torch.empty((rows, 2 * F), dtype=torch.bfloat16, device="cuda")]
        kept = mk.KeptRows.allocate(rows, H, F, best[2], "cuda")
        for label, extra_kw in (
            ("saved h", dict(saved_h=hbuf)),
            ("saved h + kept x/act", dict(saved_h=hbuf, keep=kept)),
        ):
            try:
                fn = lambda e=extra_kw: mok_forward_emulated([x], [idx], [w], w1l, w2l, check=False, **kw, **e)  # noqa: E731
                ms, mn = timeit(fn, args.iters, args.warmup)
                check_last_error()
                out, _, _ = mok_forward_emulated([x], [idx], [w], w1l, w2l, **kw, **extra_kw)
                err = ((out[0].float() - ref.float()).norm() / ref.float().norm()).item()
                print(
                    f"MoK training forward ({label}, comm_sms={best[1]} minibatch={best[2]}): {ms:8.3f} ms (min {mn:.3f}) "
                    f"{tf(ms):7.1f} TFLOP/s  {tf(ms) / PEAK * 100:5.1f}% of {PEAK:.0f}  rel.err vs torch {err:.2e}",
                    flush=True,
                )
                res.setdefault("mok_training", []).append({"variant": label, "ms": ms, "tflops": tf(ms)})
            except Exception as exc:
                print(f"MoK training forward ({label}): FAILED {type(exc).__name__}: {exc}", flush=True)

    if args.ablate and best and env.debug().ablation is None:
        print("ablation skipped: run with MOK_DEBUG=ablation (the kernel build with the leave-one-out switches)")
    elif args.ablate and best:
        # leave-one-stage-out timings (results are wrong on purpose; the MOK_DEBUG=ablation=BITS bits per launch)
        kw = dict(comm_sms=best[1], ring_slots=args.ring_slots, minibatch_tokens=best[2], tuning=tuning(best[3]))
        fn = lambda: mok_forward_emulated([x], [idx], [w], w1l, w2l, check=False, **kw)  # noqa: E731
        for bit, what in (
            (1, "no final weighted sum"),
            (2, "no fc2 epilogue stores (push combine)"),
            (4, "no fc1 epilogue stores"),
            (8, "no dispatch copy"),
            (15, "all four"),
        ):
            os.environ["MOK_DEBUG"] = f"ablation={bit}"
            try:
                a_ms = pipelined(fn, args.iters, 2)
                check_last_error()
                print(f"ablation bits {bit:2d} ({what}): back-to-back {a_ms:.3f} ms", flush=True)
                res.setdefault("ablation", {})[what] = a_ms
            except Exception as exc:
                print(f"ablation {bit} failed: {exc}", flush=True)
        os.environ["MOK_DEBUG"] = "ablation"

    t_ms, t_mn = timeit(lambda: torch_forward(x, idx, w, w1t, w2t, L, F), args.iters, args.warmup)
    print(
        f"torch permute+_grouped_mm+SwiGLU+_grouped_mm+combine: {t_ms:8.3f} ms (min {t_mn:.3f}) "
        f"{tf(t_ms):7.1f} TFLOP/s  {tf(t_ms) / PEAK * 100:5.1f}%",
        flush=True,
    )
    res["torch_ms"] = t_ms

    if not args.no_mcore:
        try:
            experts, disp, routing_map, probs = mcore_layer(H, F, K, L, w1, w2, idx, w)
            with torch.no_grad():
                mo = mcore_forward(experts, disp, x, routing_map, probs)
                merr = ((mo.float() - ref.float()).norm() / ref.float().norm()).item()
                m_ms, m_mn = timeit(
                    lambda: mcore_forward(experts, disp, x, routing_map, probs), args.iters, args.warmup
                )
            print(
                f"Megatron-Core alltoall dispatcher + SequentialMLP (EP=1): {m_ms:8.3f} ms (min {m_mn:.3f}) "
                f"{tf(m_ms):7.1f} TFLOP/s  rel.err vs torch {merr:.2e}",
                flush=True,
            )
            res["mcore_ms"] = m_ms
        except Exception as exc:
            print(f"Megatron-Core baseline unavailable: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc(limit=3)
            res["mcore_error"] = f"{type(exc).__name__}: {exc}"

    d1, d2 = dense_ceiling(rows, H, F, args.iters, args.warmup)
    dense_tf = flops / ((d1 + d2) * 1e-3) / 1e12
    print(
        f"dense torch.mm ceiling: fc1 [{rows}x{H}]x[{H}x{2 * F}] {d1:.3f} ms, fc2 {d2:.3f} ms -> "
        f"{d1 + d2:.3f} ms {dense_tf:.1f} TFLOP/s",
        flush=True,
    )
    res["dense_ms"] = d1 + d2
    if best:
        res["mok_best_ms"] = best[0]
        line = (
            f"SUMMARY {name}: MoK {best[0]:.3f} ms ({tf(best[0]):.0f} TFLOP/s, comm_sms={best[1]}, "
            f"minibatch={best[2]}, raster={best[3]}) | torch {t_ms:.3f} ms -> speedup {t_ms / best[0]:.2f}x"
        )
        if "mcore_ms" in res:
            line += f" | mcore {res['mcore_ms']:.3f} ms -> {res['mcore_ms'] / best[0]:.2f}x"
        line += f" | dense-mm ceiling {d1 + d2:.3f} ms (MoK/dense = {(d1 + d2) / best[0]:.2f})"
        print(line, flush=True)
    results.append(res)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="kimi,qwen")
    ap.add_argument("--comm-sms", type=int, default=16)
    ap.add_argument("--minibatch", type=int, default=2560)
    ap.add_argument("--ring-slots", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--raster", type=int, default=None, help="kernel.tile_raster (default: the measured default)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-raster", type=lambda s: [int(v) for v in s.split(",")], default=[0, 1])
    ap.add_argument("--sweep-comm", type=lambda s: [int(v) for v in s.split(",")], default=[4, 8, 16])
    ap.add_argument("--sweep-mb", type=lambda s: [int(v) for v in s.split(",")], default=[2560, 4096, 8192])
    ap.add_argument("--no-mcore", action="store_true")
    ap.add_argument("--no-training", action="store_true", help="skip the saved-h / kept-rows forward timings")
    ap.add_argument("--ablate", action="store_true", help="also time leave-one-stage-out variants (MOK_DEBUG=ablation)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import megatron_mok.kernel as mk

    if not mk.is_available():
        print(f"MoK kernel unavailable: {mk.unavailable_reason()}")
        return 1
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    results = []
    for name in args.shapes.split(","):
        bench_shape(name.strip(), args, results)
    if args.json:
        write_result(args.json, "bench_forward", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
