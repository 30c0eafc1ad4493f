#!/usr/bin/env python3
"""FP8 vs BF16 MoK forward on a Hopper GPU, one run: Kimi-K2 and DeepSeek-V3 per-GPU slices.

For each slice (EP 1, one launch, same inputs):
  dense   : torch.mm bf16 at the fc1 and fc2 shapes with the same row count (the ceiling, this run)
  FP8 ceilings (interleaved rounds): torch._scaled_mm (dense FP8, rowwise e4m3) at the same shapes, and
            torch._scaled_grouped_mm fc1 + fc2 on the same rows split evenly among the experts
  bf16    : the bf16 MoK forward kernel
  fp8     : the FP8 MoK forward kernel (e4m3, 1 x 128 / 128 x 128 block scales, activations quantised
            in the pull and the SwiGLU epilogue); expert weights quantised once beforehand (per
            optimizer step in training), whose time is printed separately
Prints ms, TFLOP/s (2*rows*H*2F + 2*rows*F*H), bf16 / dense, fp8 speedup over bf16, and both kernels'
relative error vs the fp32 layer (first --err-tokens tokens).
--backward: also the backward kernel from the saved fc1 output, bf16 dgrad vs FP8 dgrad (each with the
bf16 wgrad kernel, and dgrad alone), and grad_x's relative error vs fp32 autograd.
    python benchmarks/bench_fp8.py [--shapes kimi,dsv3] [--comm-sms 16] [--minibatch 2560]
        [--sweep-comm 8,12 --sweep-mb 4096,6144]   # both kernels over this grid too; each at its best
    python benchmarks/bench_fp8.py --backward --configs --comm-sms 0 --minibatch 4096 --ring-slots 4 --rounds 7
        # each forward kernel at its slice's shipped config (--configs covers the forward only; the backward
        # runs --minibatch / --ring-slots / --bwd-comm-sms)
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))
from bench_common import GpuSampler, make_inputs, med, pipelined, round_ratios, timeit  # noqa: E402
from emulated import mok_backward_emulated, mok_forward_emulated  # noqa: E402
from result_file import write_result  # noqa: E402

from megatron_mok.kernel import check_last_error  # noqa: E402
from megatron_mok.timing import cuda_call_and_device_ms  # noqa: E402

SHAPES = {
    # name: (H, F, K, L, tokens)
    "kimi": (7168, 2048, 8, 8, 8192),  # Kimi-K2 (384 experts) at EP 48: 8 local experts, 65536 rows
    "dsv3": (7168, 2048, 8, 32, 8192),  # DeepSeek-V3 (256 experts) at EP 8: 32 local experts, 65536 rows
}
# --configs: each slice's shipped configs (configs/*.yaml), bf16 and fp8 kernel
SLICE_CONFIGS = {"kimi": ("kimi-k2", "kimi-k2-fp8"), "dsv3": ("deepseek-v3", "deepseek-v3-fp8")}


def forward_settings(name: str, kind: str, args) -> dict:
    """comm_sms / ring_slots / minibatch_tokens of one kernel's forward: the command line's, or with --configs
    the slice's config for that dtype (the FP8 configs carry their own minibatch)."""
    if not args.configs:
        return dict(comm_sms=args.comm_sms, ring_slots=args.ring_slots, minibatch_tokens=args.minibatch)
    from megatron_mok.config import load_config

    k = load_config(SLICE_CONFIGS[name][0 if kind == "bf16" else 1]).kernel
    return dict(comm_sms=k.comm_sms, ring_slots=k.ring_slots, minibatch_tokens=k.minibatch_tokens)


def dense_fns(rows: int, H: int, F: int):
    """The dense bf16 ceiling's two GEMMs (fc1 [rows, H] x [H, 2F], fc2 [rows, F] x [F, H]) on random data."""
    a = torch.randn((rows, H), device="cuda").bfloat16()
    b1 = torch.randn((H, 2 * F), device="cuda").bfloat16()
    a2 = torch.randn((rows, F), device="cuda").bfloat16()
    b2 = torch.randn((F, H), device="cuda").bfloat16()
    return (lambda: torch.mm(a, b1)), (lambda: torch.mm(a2, b2))


def fp8_ceiling_fns(rows: int, H: int, F: int, L: int, block: bool = False) -> dict[str, tuple[Callable, Callable]]:
    """The FP8 ceilings' two GEMMs (fc1 then fc2, the same rows), e4m3 with rowwise scales (one per row of A, one
    per output column of B), bf16 out, on random data:

    * ``dense_fp8``: ``torch._scaled_mm`` over all rows with one weight (the dense FP8 ceiling);
    * ``grouped_fp8``: ``torch._scaled_grouped_mm`` over the rows split evenly among the L experts, each with its
      own weights (the unfused grouped GEMMs alone: no dispatch, quantisation, SwiGLU or combine);
    * ``dense_fp8_block`` (with ``block``): ``torch._scaled_mm`` over all rows with MoK's own recipe, 1 x 128
      activation and 128 x 128 weight block scales (cuBLAS promotes the partial sums every 128 of K, as the kernel
      does; the rowwise ceilings promote nothing).

    A ceiling the installed torch or GPU cannot run is left out with the reason printed."""
    e4m3, dev = torch.float8_e4m3fn, "cuda"

    def rand8(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev).to(e4m3)

    def scales(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, device=dev) + 0.5

    a1, a2 = rand8(rows, H), rand8(rows, F)
    sa1, sa2 = scales(rows, 1), scales(rows, 1)
    # B operands column-major, as cuBLASLt's FP8 kernels take them: [N, K] row-major weights, transposed
    b1, b2 = rand8(2 * F, H).t(), rand8(H, F).t()
    sb1, sb2 = scales(1, 2 * F), scales(1, H)
    g1, g2 = rand8(L, 2 * F, H).transpose(-2, -1), rand8(L, H, F).transpose(-2, -1)
    sg1, sg2 = scales(L, 2 * F), scales(L, H)
    offs = (torch.arange(1, L + 1, device=dev, dtype=torch.int32) * (rows // L)).clamp_(max=rows)
    offs[-1] = rows
    bf = torch.bfloat16
    candidates = {
        "dense_fp8": (
            lambda: torch._scaled_mm(a1, b1, sa1, sb1, out_dtype=bf),
            lambda: torch._scaled_mm(a2, b2, sa2, sb2, out_dtype=bf),
        ),
        "grouped_fp8": (
            lambda: torch._scaled_grouped_mm(a1, g1, sa1.view(-1), sg1, offs=offs, out_dtype=bf),
            lambda: torch._scaled_grouped_mm(a2, g2, sa2.view(-1), sg2, offs=offs, out_dtype=bf),
        ),
    }
    if block:
        candidates["dense_fp8_block"] = (blockwise_mm(a1, b1, b_blocks=128), blockwise_mm(a2, b2, b_blocks=128))
    return {name: pair for name, pair in candidates.items() if runs_here(name, *pair)}


def runs_here(name: str, *calls: Callable) -> bool:
    """Whether a ceiling's calls run with the installed torch and GPU (each is called once); one that cannot is
    left out, the reason printed."""
    try:
        for call in calls:
            call()
        torch.cuda.synchronize()
    except (RuntimeError, TypeError, ValueError, AttributeError) as exc:
        print(f"  {name} ceiling left out: {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
        return False
    return True


def blockwise_mm(a: torch.Tensor, b: torch.Tensor, b_blocks: int) -> Callable[[], torch.Tensor]:
    """``torch._scaled_mm(a, b)`` (e4m3, bf16 out) with 1 x 128 block scales on A ([M, K], K-contiguous) and, on B
    ([K, N], K-contiguous), 128 x 128 block scales (``b_blocks=128``, a weight as in the forward and the dgrad) or
    1 x 128 ones along K (``b_blocks=1``, an activation as in the wgrad, whose K is the tokens).

    cuBLAS wants the scales in particular strides (which differ between versions); the first layout it takes is
    kept. With none taken, the call raises the last layout's error when it is made (the ceiling is left out)."""
    M, K = a.shape
    N = b.shape[1]
    kb = (K + 127) // 128
    dev = a.device

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, device=dev) + 0.5

    # A's scales [M, K/128]: outer-dim-major (stride 1 along M) first, then contiguous
    a_layouts = [rand(kb, M).t(), rand(M, kb)]
    if b_blocks == 128:
        nb = (N + 127) // 128
        b_layouts = [rand(nb, kb).t(), rand(kb, nb)]  # [K/128, N/128]
    else:
        b_layouts = [rand(kb, N), rand(N, kb).t()]  # [K/128, N]
    error: Exception | None = None
    for sa in a_layouts:
        for sb in b_layouts:
            try:
                torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
                return lambda sa=sa, sb=sb: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
            except (RuntimeError, TypeError, ValueError) as exc:
                error = exc

    def refused() -> torch.Tensor:
        assert error is not None
        raise error

    return refused


def pair_ms(fns: tuple[Callable, Callable], iters: int) -> float:
    """One ceiling's time: its two GEMMs timed apart (median of ``iters`` each), summed."""
    return timeit(fns[0], iters, 2)[0] + timeit(fns[1], iters, 2)[0]


def dense_ms(rows: int, H: int, F: int, iters: int) -> float:
    f1, f2 = dense_fns(rows, H, F)
    t1, _ = timeit(f1, iters, 3)
    t2, _ = timeit(f2, iters, 3)
    return t1 + t2


def host_ms(fn, n: int = 20) -> float:
    """Median host milliseconds of one call that returns once its work is queued, the GPU idle at the
    start: what a per-call timing (CUDA events around each call) adds to the kernel's own time."""
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return sorted(ts)[len(ts) // 2]


def host_profile(fn, n: int = 20, top: int = 12) -> None:
    """cProfile of n calls (GPU synchronised before each), the top functions by own time."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    for _ in range(n):
        torch.cuda.synchronize()
        pr.enable()
        fn()
        pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr)
    st.sort_stats("tottime").print_stats(top)


def tuning_of(kv: str):
    """The forward tuning of an --ab-tuning KEY=VALUE (a field of ``kernel.tuning.ForwardTuning``)."""
    from megatron_mok.kernel.tuning import ForwardTuning

    key, _, val = kv.partition("=")
    if key != "tile_raster":
        raise SystemExit(f"--ab-tuning {kv!r}: KEY is tile_raster")
    return ForwardTuning(tile_raster=int(val))


def chosen_settings(res: dict, kind: str) -> dict:
    """The forward settings a kernel runs the interleaved rounds with: its slice's (--configs) or the command
    line's, or the sweep's best (res[kind], filled by bench)."""
    r = res[kind]
    return dict(comm_sms=r["comm_sms"], ring_slots=r["ring_slots"], minibatch_tokens=r["minibatch"])


def interleaved_rounds(name: str, args, res: dict, x, idx, w, w1l, w2l, q8, rows: int, H: int, F: int):
    """Dense, bf16, fp8 (each at its best setting) and the A/B variants, every one once per round.

    The power-limited clocks drift within a run, and a kernel's clock depends on what ran just before it:
    alternating the variants cancels the drift, a fresh (seeded) order each round the neighbour
    effect; the figures are medians of the per-round ratios. Each MoK variant gives two times per call:
    the call (CUDA events around it: the host's preparation counts while the GPU waits) and the device
    time (events around the library's enqueued work: what a host that queues ahead, as in training, sees).
    """

    f1, f2 = dense_fns(rows, H, F)
    ceilings = fp8_ceiling_fns(rows, H, F, len(w1l[0]))  # timed like the dense mm: no host preparation
    variants: dict = {}
    for kind in ("bf16", "fp8"):
        kwb = chosen_settings(res, kind)
        extra = {"fp8": q8} if kind == "fp8" else {}
        variants[kind] = lambda ev, kwb=kwb, extra=extra: mok_forward_emulated(
            [x], [idx], [w], w1l, w2l, check=False, gpu_events=ev, **kwb, **extra
        )
    # the kernels with a tuning setting (e.g. tile_raster=16), same rounds; one entry per --ab-tuning, each
    # for the kernels of --ab-tuning-kinds (a setting at its default value is an A/A control)
    env_kinds = [k for k in args.ab_tuning_kinds.split(",") if k]
    envs = args.ab_tuning or []
    for i, kv in enumerate(envs):
        t = tuning_of(kv)
        for kind in env_kinds:
            kwb = chosen_settings(res, kind)
            extra = {"fp8": q8} if kind == "fp8" else {}
            variants[f"{kind}_env{i}"] = lambda ev, kwb=kwb, extra=extra, t=t: mok_forward_emulated(
                [x], [idx], [w], w1l, w2l, check=False, gpu_events=ev, tuning=t, **kwb, **extra
            )
    if args.ab_comm is not None:  # the bf16 kernel at another SM split (A/B)
        kwa = dict(chosen_settings(res, "bf16"), comm_sms=args.ab_comm)
        variants["bf16_ab"] = lambda ev, kwa=kwa: mok_forward_emulated(
            [x], [idx], [w], w1l, w2l, check=False, gpu_events=ev, **kwa
        )
    graphs = {}  # kind -> (graph, its outputs), kept alive for the rounds
    if args.graphs:  # each kernel captured once in a CUDA graph and replayed: no host preparation per call
        for kind in ("bf16", "fp8"):
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    got = variants[kind](None)
                graphs[kind] = (g, got[0][0])
                variants[f"{kind}_graph"] = lambda ev, g=g: (ev[0].record(), g.replay(), ev[1].record())
            except Exception as exc:  # report and go on without it
                print(f"  {kind}: CUDA graph capture failed: {type(exc).__name__}: {exc}", flush=True)
    keys = ["dense", *ceilings, *variants]
    call: dict[str, list[float]] = {k: [] for k in keys}
    dev: dict[str, list[float]] = {k: [] for k in keys}
    spans: dict[str, list[tuple[float, float]]] = {k: [] for k in keys}
    sampler = GpuSampler()
    for r in range(args.rounds):
        # a fresh order each round (seeded): a rotation keeps every variant behind the same neighbour, and
        # under the power cap a kernel's clock depends on what ran just before it (A/B runs 2 and 4 of
        # once each favoured whichever variant followed the plain fp8 kernel by ~4 %)
        for key in random.Random(1000 + r).sample(keys, len(keys)):
            t0 = time.monotonic()
            if key == "dense":  # no host preparation to speak of: its call time is its device time
                c = timeit(f1, args.iters, 2)[0] + timeit(f2, args.iters, 2)[0]
                d = c
            elif key in ceilings:
                c = d = pair_ms(ceilings[key], args.iters)
            else:
                c, d = cuda_call_and_device_ms(variants[key], args.iters, 2)
            spans[key].append((t0, time.monotonic()))
            call[key].append(c)
            dev[key].append(d)
    check_last_error()
    sampler.close()
    for kind, (g, out_g) in graphs.items():  # the replays computed the layer (eager launches ran between them)
        g.replay()
        same = torch.equal(out_g, variants[kind](None)[0][0])
        res.setdefault("graph_replay_equals_eager", {})[kind] = same
        print(f"  {kind} CUDA graph replay == eager call (bitwise): {same}", flush=True)
    for key, ws in spans.items():  # mean SM clock / power while each variant ran (nvidia-smi samples)
        got = [v for v in (sampler.window(a, b) for a, b in ws) if v is not None]
        if got:
            clk = sum(c for c, _ in got) / len(got)
            pw = sum(p for _, p in got) / len(got)
            res.setdefault("clocks", {})[key] = {"sm_mhz": clk, "power_w": pw}
            print(f"  {key:8s}: SM clock {clk:6.0f} MHz, power {pw:5.0f} W (mean of the rounds' samples)")
    if "bf16_ab" in variants:
        m, lo, hi = round_ratios(call["bf16_ab"], call["bf16"])  # > 1: the chosen split is faster
        md = round_ratios(dev["bf16_ab"], dev["bf16"])[0]
        res["ab_comm"] = {"comm_sms": args.ab_comm, "ms": call["bf16_ab"], "speedup_of_best": m, "device": md}
        print(
            f"  A/B bf16 comm {res['bf16']['comm_sms']} vs comm {args.ab_comm} (minibatch {res['bf16']['minibatch']}): "
            f"time at comm {args.ab_comm} / time at the chosen = {m:.3f} per call ({lo:.3f}-{hi:.3f}), "
            f"{md:.3f} device (medians of rounds)",
            flush=True,
        )
    for i, kv in enumerate(envs):
        ab = res.setdefault("ab_tuning", {}).setdefault(kv, {})
        for kind in env_kinds:
            k = f"{kind}_env{i}"
            m, lo, hi = round_ratios(call[k], call[kind])  # < 1: the knob is faster
            md, dlo, dhi = round_ratios(dev[k], dev[kind])
            ab[kind] = {"ms": call[k], "device_ms": dev[k], "time_ratio": m, "device_ratio": md}
            print(
                f"  A/B {kind} with {kv}: time with / time without = {m:.3f} per call ({lo:.3f}-{hi:.3f}), "
                f"{md:.3f} device ({dlo:.3f}-{dhi:.3f}) (medians of rounds); with it: {med(call[k]):.3f} ms per "
                f"call, {med(dev[k]):.3f} ms device",
                flush=True,
            )
        b_env = f"bf16_env{i}" if f"bf16_env{i}" in variants else "bf16"  # the knob's bf16 if measured
        f_env = f"fp8_env{i}" if f"fp8_env{i}" in variants else "fp8"
        print(
            f"  with {kv}: bf16 = {round_ratios(call['dense'], call[b_env])[0] * 100:.1f}% of dense, fp8 -> "
            f"{round_ratios(call[b_env], call[f_env])[0]:.2f}x bf16 per call; device: bf16 "
            f"{round_ratios(dev['dense'], dev[b_env])[0] * 100:.1f}% of dense, fp8 -> {round_ratios(dev[b_env], dev[f_env])[0]:.2f}x",
            flush=True,
        )
    frac, flo, fhi = round_ratios(call["dense"], call["bf16"])
    spd, slo, shi = round_ratios(call["bf16"], call["fp8"])
    dfrac, dflo, dfhi = round_ratios(dev["dense"], dev["bf16"])
    dspd, dslo, dshi = round_ratios(dev["bf16"], dev["fp8"])
    res["interleaved"] = {
        "rounds": args.rounds,
        "order": "a seeded random permutation each round",
        "dense_ms": call["dense"],
        "bf16_ms": call["bf16"],
        "fp8_ms": call["fp8"],
        "bf16_device_ms": dev["bf16"],
        "fp8_device_ms": dev["fp8"],
        "bf16_of_dense": frac,
        "fp8_speedup": spd,
        "bf16_of_dense_device": dfrac,
        "fp8_speedup_device": dspd,
    }
    print(
        f"SUMMARY {name} interleaved ({args.rounds} rounds x {args.iters} calls, shuffled order, median of per-round "
        f"ratios), per call (host preparation included): bf16 = {frac * 100:.1f}% of dense bf16 (rounds "
        f"{flo * 100:.1f}-{fhi * 100:.1f}%, target 85%) | fp8 -> {spd:.2f}x bf16 (rounds {slo:.2f}-{shi:.2f}, target "
        f"1.4x) | dense {med(call['dense']):.3f} bf16 {med(call['bf16']):.3f} fp8 {med(call['fp8']):.3f} ms",
        flush=True,
    )
    fp8_ceilings_summary(name, call, dev, ceilings, res["interleaved"], rows * (2 * H * 2 * F + 2 * F * H))
    if "bf16_graph" in variants and "fp8_graph" in variants:
        gfrac, glo, ghi = round_ratios(call["dense"], call["bf16_graph"])
        gspd, gslo, gshi = round_ratios(call["bf16_graph"], call["fp8_graph"])
        res["interleaved"].update(
            bf16_graph_ms=call["bf16_graph"],
            fp8_graph_ms=call["fp8_graph"],
            bf16_of_dense_graph=gfrac,
            fp8_speedup_graph=gspd,
        )
        print(
            f"SUMMARY {name} interleaved, per call of a CUDA graph replay (each kernel captured once): bf16 = "
            f"{gfrac * 100:.1f}% of dense bf16 (rounds {glo * 100:.1f}-{ghi * 100:.1f}%, target 85%) | fp8 -> "
            f"{gspd:.2f}x bf16 (rounds {gslo:.2f}-{gshi:.2f}, target 1.4x) | bf16 {med(call['bf16_graph']):.3f} "
            f"fp8 {med(call['fp8_graph']):.3f} ms",
            flush=True,
        )
    print(
        f"SUMMARY {name} interleaved, device time (the layer's enqueued work): bf16 = {dfrac * 100:.1f}% of dense "
        f"bf16 (rounds {dflo * 100:.1f}-{dfhi * 100:.1f}%, target 85%) | fp8 -> {dspd:.2f}x bf16 (rounds "
        f"{dslo:.2f}-{dshi:.2f}, target 1.4x) | bf16 {med(dev['bf16']):.3f} fp8 {med(dev['fp8']):.3f} ms",
        flush=True,
    )


def fp8_ceilings_summary(
    name: str,
    call: dict[str, list[float]],
    dev: dict[str, list[float]],
    ceilings: dict,
    out: dict,
    flops: float,
) -> None:
    """The FP8 kernel against the FP8 ceilings of the same rounds: of the dense FP8 GEMMs' speed (target 85 %), and
    the unfused grouped FP8 GEMMs' time over the kernel's (target > 1: the whole fused layer faster than its two bare
    GEMMs)."""
    parts = []
    for key, what in (("dense_fp8", "dense FP8 _scaled_mm"), ("grouped_fp8", "_scaled_grouped_mm fc1 + fc2")):
        if key not in ceilings:
            continue
        # ceiling time / kernel time: the kernel's share of its speed
        frac, lo, hi = round_ratios(call[key], call["fp8"])
        dfrac = round_ratios(dev[key], dev["fp8"])[0]
        out.update({f"{key}_ms": call[key], f"fp8_of_{key}": frac, f"fp8_of_{key}_device": dfrac})
        tflops = flops / (med(call[key]) * 1e-3) / 1e12
        parts.append(
            f"{what} {med(call[key]):.3f} ms ({tflops:.0f} TFLOP/s): fp8 kernel at {frac * 100:.1f}% of its speed per "
            f"call (rounds {lo * 100:.1f}-{hi * 100:.1f}%), {dfrac * 100:.1f}% device"
        )
    if parts:
        print(
            f"SUMMARY {name} FP8 ceilings (same rounds; targets: >= 85% of dense FP8, > 100% of the grouped GEMMs): "
            + " | ".join(parts),
            flush=True,
        )


def bench(name: str, args, results: list) -> None:
    from mok_truth import exact_fp32, rel_err

    from megatron_mok.kernel.quant import quantize_expert_weights

    H, F, K, L, T = SHAPES[name]
    rows = T * K
    flops = 2.0 * rows * H * 2 * F + 2.0 * rows * F * H

    def tf(ms: float) -> float:
        return flops / (ms * 1e-3) / 1e12

    x, idx, w, w1, w2 = make_inputs(H, F, K, L, T)
    w1l, w2l = [[w1[e] for e in range(L)]], [[w2[e] for e in range(L)]]
    print(f"\n=== {name}: H={H} F={F} top-{K} L={L} tokens={T} rows={rows} ({flops / 1e12:.2f} TFLOP) ===", flush=True)
    res: dict = {"shape": name, "H": H, "F": F, "K": K, "L": L, "tokens": T}
    d_ms = dense_ms(rows, H, F, args.iters)
    print(f"dense bf16 torch.mm (fc1 + fc2, same rows): {d_ms:.3f} ms = {tf(d_ms):.0f} TFLOP/s", flush=True)
    res["dense_ms"] = d_ms

    qs, _ = timeit(lambda: quantize_expert_weights(w1l, w2l), 3, 1)
    q8 = quantize_expert_weights(w1l, w2l)
    print(f"fp8 weight quantisation (once per optimizer step, torch ops): {qs:.3f} ms", flush=True)
    res["weight_quant_ms"] = qs

    kws = {kind: forward_settings(name, kind, args) for kind in ("bf16", "fp8")}
    runs = {
        "bf16": lambda ev=None: mok_forward_emulated(
            [x], [idx], [w], w1l, w2l, check=False, gpu_events=ev, **kws["bf16"]
        ),
        "fp8": lambda ev=None: mok_forward_emulated(
            [x], [idx], [w], w1l, w2l, check=False, fp8=q8, gpu_events=ev, **kws["fp8"]
        ),
    }
    n = min(args.err_tokens, T)
    exact = exact_fp32([x[:n]], [idx[:n]], [w[:n]], w1l, w2l)[0]
    for kind, fn in runs.items():
        out = fn()[0][0]
        check_last_error()
        err = rel_err(out[:n], exact)
        ms, mn = timeit(fn, args.iters, 2)
        ms_pipe = pipelined(fn, args.iters, 1)
        check_last_error()
        h_ms = host_ms(fn)
        _, dev_ms = cuda_call_and_device_ms(fn, args.iters, 1)
        res[kind] = {
            "ms": ms,
            "min_ms": mn,
            "pipelined_ms": ms_pipe,
            "host_ms": h_ms,
            "device_ms": dev_ms,
            "rel_err_vs_fp32": err,
        }
        print(
            f"MoK {kind:4s}: {ms:.3f} ms (min {mn:.3f}, back-to-back {ms_pipe:.3f}) = {tf(ms):.0f} TFLOP/s "
            f"({tf(ms) / tf(d_ms) * 100:.1f}% of dense bf16) | device {dev_ms:.3f} ms ({d_ms / dev_ms * 100:.1f}% of "
            f"dense) | host {h_ms:.3f} ms per call | rel err vs fp32 layer {err:.3e}",
            flush=True,
        )
        if args.host_profile:
            print(f"host profile of the {kind} call (20 calls, own time):", flush=True)
            host_profile(fn)
    # each kernel at its best SM split / minibatch (the fp8 pull quantises, its GEMMs are shorter)
    for kind in ("bf16", "fp8"):
        res[kind].update(
            comm_sms=kws[kind]["comm_sms"], minibatch=kws[kind]["minibatch_tokens"], ring_slots=kws[kind]["ring_slots"]
        )
        for comm in args.sweep_comm:
            for mb in args.sweep_mb:
                kw2 = dict(kws[kind], comm_sms=comm, minibatch_tokens=mb)
                extra = {"fp8": q8} if kind == "fp8" else {}

                def fn2(kw2=kw2, extra=extra):
                    return mok_forward_emulated([x], [idx], [w], w1l, w2l, check=False, **kw2, **extra)

                ms, _ = timeit(fn2, args.iters, 2)
                check_last_error()
                print(f"  {kind} comm_sms={comm} minibatch={mb}: {ms:.3f} ms = {tf(ms):.0f} TFLOP/s", flush=True)
                res.setdefault(f"{kind}_sweep", []).append({"comm_sms": comm, "minibatch": mb, "ms": ms})
                if ms < res[kind]["ms"]:
                    res[kind].update(ms=ms, comm_sms=comm, minibatch=mb)
    if args.rounds > 0:
        interleaved_rounds(name, args, res, x, idx, w, w1l, w2l, q8, rows, H, F)
    b, f = res["bf16"]["ms"], res["fp8"]["ms"]
    print(
        f"SUMMARY {name}: bf16 {b:.3f} ms (comm {res['bf16']['comm_sms']}, minibatch {res['bf16']['minibatch']}) = "
        f"{d_ms / b * 100:.1f}% of dense bf16 (target 85%) | fp8 {f:.3f} ms (comm {res['fp8']['comm_sms']}, "
        f"minibatch {res['fp8']['minibatch']}) "
        f"-> {b / f:.2f}x bf16 (target 1.4x) | rel err vs fp32: bf16 {res['bf16']['rel_err_vs_fp32']:.2e}, "
        f"fp8 {res['fp8']['rel_err_vs_fp32']:.2e}",
        flush=True,
    )
    if args.backward:
        bench_backward(name, args, res, x, idx, w, w1l, w2l, n)
    results.append(res)


def bench_backward(name: str, args, res: dict, x, idx, w, w1l, w2l, n: int) -> None:
    from mok_truth import exact_fp32_grads, rel_err

    import megatron_mok.kernel as mk
    from megatron_mok.kernel.quant import quantize_expert_weights

    H, F, K, L, T = SHAPES[name]
    rows = T * K
    dgrad_flops = 2.0 * rows * H * F + 2.0 * rows * 2 * F * H  # dA = gy @ W2, dX = dH @ W1
    wgrad_flops = 2.0 * rows * 2 * F * H + 2.0 * rows * H * F
    # the backward's comm SMs pull two rows (x, gy) per layout row and write act: its own SM split
    kw = dict(comm_sms=args.bwd_comm_sms[0], ring_slots=args.ring_slots, minibatch_tokens=args.minibatch)
    t_q, _ = timeit(lambda: quantize_expert_weights(w1l, w2l, transposed=True), 3, 1)
    q8 = quantize_expert_weights(w1l, w2l, transposed=True)
    print(f"fp8 weights incl. the dgrad's W^T copies (once per optimizer step): {t_q:.3f} ms", flush=True)
    go = (torch.randn((T, H), device="cuda") * 0.1).bfloat16()
    exact_gx = exact_fp32_grads([x[:n]], [idx[:n]], [w[:n]], w1l, w2l, [go[:n]])[0][0]
    out = {}
    # bf16_kept: the bf16 layer's default (the forward keeps x / act rows, kernel.save_expert_input; the
    # backward pulls only grad_out, with --kept-comm-sms); the FP8 forward keeps none
    for kind, f8 in (("bf16", None), ("bf16_kept", None), ("fp8", q8)):
        kept = mk.KeptRows.allocate(rows, H, F, args.minibatch, "cuda") if kind == "bf16_kept" else None
        kwk = dict(kw, comm_sms=args.kept_comm_sms) if kept is not None else kw
        saved = [torch.empty((rows, 2 * F), dtype=torch.bfloat16, device="cuda")]
        _, comb, _ = mok_forward_emulated(
            [x], [idx], [w], w1l, w2l, saved_h=saved, fp8=f8, keep=kept, **dict(kw, comm_sms=args.comm_sms)
        )
        comb = [comb[0].view(T, K, H)]
        for wg in ("kernel", "none"):

            def fn(wg=wg, f8=f8, saved=saved, comb=comb, kept=kept, kwk=kwk):
                return mok_backward_emulated(
                    [go],
                    [x],
                    [idx],
                    [w],
                    comb,
                    w1l,
                    w2l,
                    saved_h=saved,
                    fp8=f8,
                    wgrad=wg,
                    check=False,
                    kept=kept,
                    **kwk,
                )

            gx = fn()[0][0]
            check_last_error()
            ms, mn = timeit(fn, args.iters, 2)
            check_last_error()
            key = f"{kind}_bwd" if wg == "kernel" else f"{kind}_dgrad"
            fl = dgrad_flops + (wgrad_flops if wg == "kernel" else 0.0)
            out[key] = {"ms": ms, "min_ms": mn, "tflops": fl / (ms * 1e-3) / 1e12}
            if wg == "kernel":
                out[key]["grad_x_rel_err_vs_fp32"] = rel_err(gx[:n], exact_gx)
            print(
                f"MoK backward {kind:9s} (comm {kwk['comm_sms']}) dgrad, wgrad {'kernel' if wg == 'kernel' else 'off   '}: {ms:.3f} ms "
                f"(min {mn:.3f}) = {fl / (ms * 1e-3) / 1e12:.0f} TFLOP/s"
                + (f" | grad_x rel err vs fp32 {out[key]['grad_x_rel_err_vs_fp32']:.3e}" if wg == "kernel" else ""),
                flush=True,
            )
        for comm in args.bwd_comm_sms[1:] if kept is None else []:  # the rest of the split sweep (dgrad + wgrad kernel)
            kw2 = dict(kw, comm_sms=comm)
            ms, _ = timeit(
                lambda kw2=kw2, f8=f8, saved=saved, comb=comb: mok_backward_emulated(
                    [go], [x], [idx], [w], comb, w1l, w2l, saved_h=saved, fp8=f8, check=False, **kw2
                ),
                args.iters,
                2,
            )
            check_last_error()
            print(f"  backward {kind} comm_sms={comm}: {ms:.3f} ms", flush=True)
            out.setdefault(f"{kind}_bwd_sweep", []).append({"comm_sms": comm, "ms": ms})
    res["backward"] = out
    print(f"(backward comm_sms={args.bwd_comm_sms[0]}, minibatch={args.minibatch})", flush=True)
    print(
        f"SUMMARY {name} backward: bf16 {out['bf16_bwd']['ms']:.3f} ms, fp8 dgrad {out['fp8_bwd']['ms']:.3f} ms "
        f"-> {out['bf16_bwd']['ms'] / out['fp8_bwd']['ms']:.2f}x | dgrad alone bf16 {out['bf16_dgrad']['ms']:.3f} "
        f"fp8 {out['fp8_dgrad']['ms']:.3f} -> {out['bf16_dgrad']['ms'] / out['fp8_dgrad']['ms']:.2f}x | grad_x rel "
        f"err vs fp32: bf16 {out['bf16_bwd']['grad_x_rel_err_vs_fp32']:.2e}, fp8 "
        f"{out['fp8_bwd']['grad_x_rel_err_vs_fp32']:.2e} | bf16 with kept x/act rows (layer default, comm "
        f"{args.kept_comm_sms}) {out['bf16_kept_bwd']['ms']:.3f} ms -> fp8 {out['bf16_kept_bwd']['ms'] / out['fp8_bwd']['ms']:.2f}x",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="kimi,dsv3")
    ap.add_argument("--comm-sms", type=int, default=16)
    ap.add_argument("--minibatch", type=int, default=2560)
    ap.add_argument("--ring-slots", type=int, default=3)
    ap.add_argument(
        "--configs",
        action="store_true",
        help="forward: each kernel at its slice's shipped config (comm_sms, ring_slots, minibatch_tokens of "
        "kimi-k2[-fp8] / deepseek-v3[-fp8]) instead of --comm-sms / --ring-slots / --minibatch",
    )
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved dense / bf16 / fp8 rounds (0: skip)")
    ap.add_argument("--err-tokens", type=int, default=2048)
    ap.add_argument(
        "--ab-comm", type=int, default=None, help="interleaved rounds: also the bf16 kernel at this comm_sms (A/B)"
    )
    ap.add_argument(
        "--ab-tuning",
        action="append",
        default=None,
        help="interleaved rounds: also the kernels with this forward tuning, KEY=VALUE (A/B; repeatable), "
        "e.g. tile_raster=16 (key: tile_raster)",
    )
    ap.add_argument("--ab-tuning-kinds", default="bf16,fp8", help="which kernels the --ab-tuning variants run")
    ap.add_argument("--host-profile", action="store_true", help="cProfile the host side of one call per kernel")
    ap.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="interleaved rounds: also each kernel captured in a CUDA graph, timed per replay",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep-comm", type=lambda v: [int(c) for c in v.split(",") if c], default=[])
    ap.add_argument("--sweep-mb", type=lambda v: [int(c) for c in v.split(",") if c], default=[2560])
    ap.add_argument("--backward", action="store_true", help="also bf16 vs FP8 dgrad of the backward kernel")
    ap.add_argument(
        "--kept-comm-sms",
        type=int,
        default=8,
        help="backward comm SMs of the bf16 backward with kept x / act rows (the layer's default path)",
    )
    ap.add_argument(
        "--bwd-comm-sms",
        type=lambda v: [int(c) for c in v.split(",") if c],
        default=[16],
        help="comm SMs of the backward kernel (a list: the first is the main figure, the rest a sweep)",
    )
    args = ap.parse_args()
    import megatron_mok.kernel as mk

    if not mk.is_available():
        print(f"MoK kernel unavailable: {mk.unavailable_reason()}")
        return 1
    from megatron_mok.kernel.build import build_choices

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    choices = build_choices()  # the timing-ablation build, or not
    print("library build: " + " ".join(f"{k}={v}" for k, v in choices.items()), flush=True)
    results: list = [{"build": choices}]
    for name in args.shapes.split(","):
        bench(name.strip(), args, results)
    if args.json:
        write_result(args.json, "bench_fp8", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
