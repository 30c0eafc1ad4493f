#!/usr/bin/env python3
"""MoK against its GEMM ceilings, the kernels alone and through Megatron's MoE layer: one run, both slices.

For each slice (EP 1, hidden 7168, expert ffn 2048, top-8, --tokens tokens; Kimi-K2 with 8 local experts,
DeepSeek-V3 with 32), every variant below is timed once per round, in a fresh seeded order each round (the GPU's
power-capped clock drifts, and a kernel's clock depends on what ran before it); the figures are medians of the
per-round ratios, with their range:

  ceilings  dense bf16 ``torch.mm`` and dense FP8 ``torch._scaled_mm`` (rowwise e4m3) at the fc1 + fc2 shapes of
            all routed rows; ``torch._scaled_grouped_mm`` fc1 + fc2 on the rows split evenly over the experts (the
            bare grouped GEMMs: no dispatch, quantisation, SwiGLU or combine); dense FP8 with MoK's block scales
            (1 x 128 / 128 x 128: what the recipe itself costs a library GEMM); the backward's four GEMMs (dgrad and
            wgrad of fc1 and fc2) in dense bf16 and in FP8 with DeepSeek-V3's block scales, and their wgrad pair
  kernel    the MoK forward and backward of the slice's bf16 and FP8 configs (the layer's backend, the layer's
            settings and saved tensors, the router's routing)
  layer     Megatron's MoE layer (local spec, stock TopKRouter with fp32 gating, ``mok`` dispatcher) forward with
            autograd on, and forward + backward (weight gradients as autograd returns them)
  router    the layer's router alone: Megatron's own work, the same for every dispatcher
  queued    the router, kernel and layer forwards once more as back-to-back calls (the host queues ahead, as in a
            training step; the other figures time each call between its own events, host preparation included)
  own path  the layer forward once more with CUDA events at its router's and its kernel call's entry and exit: the
            layer's own path is what of each call's event span is neither router nor kernel call (the conversion of
            the routing, weight and workspace bookkeeping, autograd, and any wait for the host between them), as a
            share of the span, per call and queued -- one timeline cut in parts, not a difference of timings made
            in separate calls at a drifting clock

Errors are relative (L2) against
the fp32 layer by autograd (no roundings), on a call of --err-tokens tokens: output, grad_x, the router weights'
gradient, dW1, dW2.

    python benchmarks/bench_ceilings.py --json docs/results/ceilings.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import random
import sys
import warnings
from collections.abc import Callable

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, ".."))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(_HERE, "..", "tests", "gpu"))
from bench_common import med, median_range, round_ratios  # noqa: E402
from bench_fp8 import blockwise_mm, dense_fns, fp8_ceiling_fns, runs_here  # noqa: E402
from result_file import write_result  # noqa: E402

from megatron_mok.kernel import check_pending_errors  # noqa: E402
from megatron_mok.timing import cuda_pipelined_ms, cuda_times_ms  # noqa: E402

#: slice -> (bf16 config, fp8 config, local experts)
SLICES = {"kimi-k2": ("kimi-k2", "kimi-k2-fp8", 8), "deepseek-v3": ("deepseek-v3", "deepseek-v3-fp8", 32)}
KINDS = ("bf16", "fp8")


def build_layer(config: str, experts: int):
    """Megatron's MoE layer with the ``mok`` dispatcher and this config's kernel settings, ``experts`` local experts
    (per-expert shapes and top-k of the config), bf16, initialised on the GPU."""
    from megatron_mok.config import load_config, parse_config
    from megatron_mok.testing import build_moe_layer, moe_transformer_config

    cfg = load_config(config)
    m = cfg.model
    model = dict(
        name=m.name,
        hidden_size=m.hidden_size,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        num_moe_experts=experts,
        moe_router_topk=m.moe_router_topk,
    )
    mok = parse_config({"model": model, "kernel": dataclasses.asdict(cfg.kernel)}, cfg.source)
    tc = moe_transformer_config(
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.moe_ffn_hidden_size,
        num_experts=experts,
        topk=m.moe_router_topk,
        dtype=torch.bfloat16,
        use_cpu_initialization=False,
    )
    tc.mok_config = mok
    return build_moe_layer(tc).cuda()


class KernelAlone:
    """The layer's backend called directly on the router's routing: what the layer adds on top is the router, the
    routing conversion and autograd."""

    def __init__(self, layer, x: torch.Tensor) -> None:
        from megatron_mok.experts import expert_weights
        from megatron_mok.layout import topk_from_routing_map

        disp = layer.token_dispatcher
        self.hidden = x.reshape(-1, x.shape[-1])
        with torch.no_grad():
            probs, routing_map = layer.router(x)
        self.idx, self.w = topk_from_routing_map(routing_map, probs, disp.topk)
        self.w1, self.w2 = expert_weights(layer.experts)
        self.plan = disp.plan()
        self.backend = disp.backend_for(self.hidden, self.w2[0])
        if self.backend.name != "kernel":
            raise SystemExit(f"the MoK kernel does not run here: {getattr(self.backend, 'reason', '')}")
        self.grad_out = (torch.randn_like(self.hidden) * 0.1).bfloat16()
        self.state = None  # the saved tensors the timed backward reads: one forward's, made at its first call

    def forward(self):
        with torch.no_grad():
            return self.backend.forward(self.plan, self.hidden, self.idx, self.w, self.w1, self.w2)

    def backward(self):
        if self.state is None:
            self.state = self.forward()[1]
        with torch.no_grad():
            return self.backend.backward(self.plan, self.state, self.grad_out, self.w1, self.w2)


class OwnPathSplit:
    """The layer forward cut in parts on its own GPU timeline: CUDA events at the call's start and end, at the router's
    entry and exit (module hooks) and around the backend's forward (the kernel call, as ``KernelAlone`` times it).
    The layer's own path of a call is its span less the router's and the kernel call's parts."""

    def __init__(self, layer, x: torch.Tensor, backend) -> None:
        self.layer, self.x, self.backend = layer, x, backend  # backend: the layer's, as ``KernelAlone`` has it
        self.marks: list[torch.cuda.Event] = []

    def _mark(self) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.marks.append(ev)

    def share(self, iters: int, queued: bool) -> float:
        """The own path's share of the layer forward: the median over ``iters`` calls, each synchronised before the
        next (the host's preparation counts, as in ``cuda_times_ms``), or with ``queued`` the sum over ``iters``
        back-to-back calls over the sum of their spans."""
        backend, router = self.backend, self.layer.router
        kernel_forward = backend.forward

        def timed_forward(*a, **kw):
            self._mark()
            out = kernel_forward(*a, **kw)
            self._mark()
            return out

        hooks = [router.register_forward_pre_hook(lambda *_: self._mark()),
                 router.register_forward_hook(lambda *_: self._mark())]  # fmt: skip
        backend.forward = timed_forward  # this instance only, for this measurement
        try:
            self.layer(self.x)  # warm-up call
            torch.cuda.synchronize()
            calls = []
            for _ in range(iters):
                self.marks = []
                self._mark()
                self.layer(self.x)
                self._mark()
                if not queued:
                    self.marks[-1].synchronize()
                calls.append(self.marks)
            torch.cuda.synchronize()
        finally:
            del backend.forward
            for h in hooks:
                h.remove()
        spans, owns = [], []
        for m in calls:
            if len(m) != 6:
                raise SystemExit(f"own-path split: {len(m)} events in one layer forward, expected 6 (one router call, "
                                 "one kernel call)")  # fmt: skip
            start, r0, r1, k0, k1, end = m
            span = start.elapsed_time(end)
            spans.append(span)
            owns.append(span - r0.elapsed_time(r1) - k0.elapsed_time(k1))
        if queued:
            return sum(owns) / sum(spans)
        return med([o / s for o, s in zip(owns, spans)])


def backward_ceiling_fns(rows: int, H: int, F: int) -> dict[str, Callable[[], None]]:
    """The backward's four GEMMs at all routed rows, dense: dX = dH W1, dA = dY W2 (dgrad), dW1 = dH^T X,
    dW2 = dY^T A (wgrad, K = the tokens). In bf16 (``dense_bf16_backward``, its wgrad alone ``dense_bf16_wgrad``) and
    in FP8 with the recipe an FP8 backward takes (DeepSeek-V3's): dgrad with 1 x 128 gradient and 128 x 128 weight
    block scales, wgrad with 1 x 128 block scales along the tokens on both operands (``dense_fp8_block_backward``,
    ``dense_fp8_block_wgrad``). FP8 operands are laid out as the GEMMs take them (K-contiguous), as a fused
    quantisation would write them; a ceiling the installed torch or GPU cannot run is left out, its reason printed."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    dh, x, dy, a = (torch.randn(rows, n, **bf) for n in (2 * F, H, H, F))
    w1, w2 = torch.randn(2 * F, H, **bf), torch.randn(H, F, **bf)

    def dgrad() -> None:
        torch.mm(dh, w1)
        torch.mm(dy, w2)

    def wgrad() -> None:
        torch.mm(dh.t(), x)
        torch.mm(dy.t(), a)

    fns: dict[str, Callable[[], None]] = {
        "dense_bf16_backward": lambda: (dgrad(), wgrad()),
        "dense_bf16_wgrad": wgrad,
    }

    def rand8(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda").to(torch.float8_e4m3fn)

    fp8_dgrad = [
        blockwise_mm(rand8(rows, 2 * F), rand8(H, 2 * F).t(), b_blocks=128),  # dH [rows, 2F] x W1 [2F, H]
        blockwise_mm(rand8(rows, H), rand8(F, H).t(), b_blocks=128),  # dY [rows, H] x W2 [H, F]
    ]
    fp8_wgrad = [
        blockwise_mm(rand8(2 * F, rows), rand8(H, rows).t(), b_blocks=1),  # dH^T [2F, rows] x X [rows, H]
        blockwise_mm(rand8(H, rows), rand8(F, rows).t(), b_blocks=1),  # dY^T [H, rows] x A [rows, F]
    ]
    if not runs_here("FP8 block-scaled backward", *fp8_dgrad, *fp8_wgrad):
        return fns
    fns["dense_fp8_block_backward"] = lambda: [f() for f in (*fp8_dgrad, *fp8_wgrad)]
    fns["dense_fp8_block_wgrad"] = lambda: [f() for f in fp8_wgrad]
    return fns


def errors_vs_fp32(layer, x: torch.Tensor, n: int) -> dict[str, float]:
    """Relative errors of the kernel's output and gradients against the fp32 layer by autograd, on n tokens."""
    from mok_truth import exact_fp32, exact_fp32_grads, rel_err

    from megatron_mok.function import mok_moe

    k = KernelAlone(layer, x[:n])
    xg = k.hidden.detach().requires_grad_()
    wg = k.w.detach().float().requires_grad_()
    ps = [p.detach().requires_grad_() for p in (*k.w1, *k.w2)]
    L = len(k.w1)
    out = mok_moe(xg, k.idx, wg, ps[:L], ps[L:], k.plan, k.backend)
    out.backward(k.grad_out)
    w1, w2 = [[w.detach() for w in k.w1]], [[w.detach() for w in k.w2]]  # leaves for the fp32 autograd
    exact_out = exact_fp32([k.hidden], [k.idx], [k.w], w1, w2)[0]
    gx, gw, dw1, dw2 = exact_fp32_grads([k.hidden], [k.idx], [k.w], w1, w2, [k.grad_out])
    cat = lambda ts: torch.cat([t.flatten().float() for t in ts])  # noqa: E731
    return {
        "out": rel_err(out, exact_out),
        "grad_x": rel_err(xg.grad, gx[0]),
        "grad_router_weights": rel_err(wg.grad, gw[0]),
        "dW1": rel_err(cat(p.grad for p in ps[:L]), cat(dw1[0])),
        "dW2": rel_err(cat(p.grad for p in ps[L:]), cat(dw2[0])),
    }


def variants(
    layers: dict, x: torch.Tensor, rows: int, H: int, F: int, L: int
) -> tuple[dict[str, Callable[[], object]], dict[str, OwnPathSplit]]:
    """Every timed variant of one slice (name -> one call), and per layer kind the own-path split of its forward."""
    f1, f2 = dense_fns(rows, H, F)
    fp8 = fp8_ceiling_fns(rows, H, F, L, block=True)
    fns: dict[str, Callable[[], object]] = {"dense_bf16": lambda: (f1(), f2())}
    fns.update({name: (lambda p=pair: (p[0](), p[1]())) for name, pair in fp8.items()})
    fns.update(backward_ceiling_fns(rows, H, F))
    some = next(iter(layers.values()))
    fns["router"] = lambda: some.router(x)
    xg = x.detach().requires_grad_()
    grad = (torch.randn_like(x) * 0.1).bfloat16()
    splits: dict[str, OwnPathSplit] = {}
    for kind, layer in layers.items():
        k = KernelAlone(layer, x)
        splits[kind] = OwnPathSplit(layer, xg, k.backend)
        fns[f"{kind}_kernel_forward"] = k.forward
        fns[f"{kind}_kernel_backward"] = k.backward
        fns[f"{kind}_layer_forward"] = lambda layer=layer: layer(xg)

        def fwd_bwd(layer=layer) -> None:
            layer.zero_grad(set_to_none=True)
            xg.grad = None  # no accumulation pass into the input's gradient
            layer(xg)[0].backward(grad)

        fns[f"{kind}_layer_forward_backward"] = fwd_bwd
    return fns, splits


#: variants also timed queued: back-to-back calls between one pair of events, the host ahead as in training
QUEUED = ("router", "bf16_kernel_forward", "bf16_layer_forward", "fp8_kernel_forward", "fp8_layer_forward")


def rounds(
    fns: dict[str, Callable[[], object]], splits: dict[str, OwnPathSplit], n_rounds: int, iters: int
) -> dict[str, list[float]]:
    """Per variant, its ms in each round (a fresh seeded order each round): the median of ``iters`` calls, each
    between its own events (the host's preparation of the call counts while the GPU waits), and for the QUEUED
    variants, as ``<name>_queued``, the mean of ``iters`` back-to-back calls; per layer kind, as
    ``<kind>_own_path_share[_queued]``, the share of its layer forward spent on the layer's own path."""
    jobs: dict[str, Callable[[], float]] = {k: (lambda f=fn: cuda_times_ms(f, iters, 1)[0]) for k, fn in fns.items()}
    jobs.update({f"{k}_queued": (lambda f=fns[k]: cuda_pipelined_ms(f, iters, 1)) for k in QUEUED if k in fns})
    for kind, split in splits.items():
        jobs[f"{kind}_own_path_share"] = lambda s=split: s.share(iters, queued=False)
        jobs[f"{kind}_own_path_share_queued"] = lambda s=split: s.share(iters, queued=True)
    values: dict[str, list[float]] = {k: [] for k in jobs}
    for r in range(n_rounds):
        for key in random.Random(1000 + r).sample(list(jobs), len(jobs)):
            values[key].append(jobs[key]())
    return values


def ratio(times: dict[str, list[float]], num: str, den: str) -> tuple[float, float, float]:
    """Median (min, max) over the rounds of times[num] / times[den]."""
    return round_ratios(times[num], times[den])


def fmt(r: tuple[float, float, float], pct: bool = False) -> str:
    if pct:
        return f"{r[0] * 100:.1f}% ({r[1] * 100:.1f}-{r[2] * 100:.1f})"
    return f"{r[0]:.2f}x ({r[1]:.2f}-{r[2]:.2f})"


def report(name: str, t: dict[str, list[float]], flops: float, errs: dict) -> dict:
    """Print the slice's figures and return them."""
    tf = lambda key, fl=flops: fl / (med(t[key]) * 1e-3) / 1e12  # noqa: E731
    print(f"{'variant':32s} {'ms (median of rounds)':>22s} {'TFLOP/s':>8s}")
    for key in (k for k in t if "_own_path_share" not in k):
        fl = 2 * flops if "backward" in key and "forward_backward" not in key else flops
        fl = 3 * flops if "forward_backward" in key else fl
        shown = f"{tf(key, fl):8.0f}" if not key.startswith("router") else f"{'-':>8s}"
        print(f"{key:32s} {med(t[key]):22.3f} {shown}")
    out: dict = {"ms": t, "ratios": {}}

    def put(label: str, r: tuple[float, float, float], pct: bool = False) -> str:
        out["ratios"][label] = {"median": r[0], "min": r[1], "max": r[2]}
        return fmt(r, pct)

    for where in ("kernel", "layer"):
        fw = lambda kind, w=where: f"{kind}_{w}_forward"  # noqa: E731
        parts = [
            f"bf16 {put(f'{where} bf16 forward of dense bf16', ratio(t, 'dense_bf16', fw('bf16')), True)} of dense bf16",
            f"fp8 {put(f'{where} fp8 forward of dense bf16', ratio(t, 'dense_bf16', fw('fp8')), True)} of dense bf16",
        ]
        if "dense_fp8" in t:
            parts.append(
                f"fp8 {put(f'{where} fp8 forward of dense fp8', ratio(t, 'dense_fp8', fw('fp8')), True)} of dense FP8 "
                "(target 85%)"
            )
        if "grouped_fp8" in t:
            parts.append(
                f"fp8 at {put(f'{where} fp8 forward of grouped fp8', ratio(t, 'grouped_fp8', fw('fp8')), True)} of "
                "the speed of _scaled_grouped_mm fc1 + fc2 (target > 100%)"
            )
        if "dense_fp8_block" in t:
            parts.append(
                f"fp8 {put(f'{where} fp8 forward of dense fp8 block', ratio(t, 'dense_fp8_block', fw('fp8')), True)} "
                "of dense FP8 with MoK's block scales"
            )
        print(f"SUMMARY {name} forward, {where}: " + " | ".join(parts), flush=True)
    if "dense_fp8_block" in t and "dense_fp8" in t:
        recipe = put("dense fp8 block of dense fp8", ratio(t, "dense_fp8", "dense_fp8_block"), True)
        print(
            f"SUMMARY {name} FP8 recipe: dense FP8 with 1x128 / 128x128 block scales (cuBLAS) runs at {recipe} of "
            "the rowwise dense FP8 speed",
            flush=True,
        )
    kb = put("kernel fp8 backward speedup", ratio(t, "bf16_kernel_backward", "fp8_kernel_backward"))
    lb = put(
        "layer fp8 forward+backward speedup", ratio(t, "bf16_layer_forward_backward", "fp8_layer_forward_backward")
    )
    of = put("kernel bf16 backward of dense bf16", ratio(t, "dense_bf16_backward", "bf16_kernel_backward"), True)
    print(
        f"SUMMARY {name} backward: kernel fp8 -> {kb} bf16 (target 1.5x) | kernel bf16 at {of} of the dense bf16 "
        f"backward GEMMs | layer forward + backward fp8 -> {lb} bf16",
        flush=True,
    )
    if "dense_fp8_block_backward" in t:
        db = put("dense fp8 block backward speedup", ratio(t, "dense_bf16_backward", "dense_fp8_block_backward"))
        dw = put("dense fp8 block wgrad speedup", ratio(t, "dense_bf16_wgrad", "dense_fp8_block_wgrad"))
        print(
            f"SUMMARY {name} FP8 backward ceiling: the four dense GEMMs in FP8 with DeepSeek-V3's block scales "
            f"(cuBLAS) -> {db} their bf16 time; the wgrad pair alone (1x128 along the tokens on both operands) -> {dw}",
            flush=True,
        )
    for how, sfx in (("per call", ""), ("queued", "_queued")):
        if f"router{sfx}" not in t:
            continue
        paths = [f"{kind} {put(f'layer own path {kind}{sfx}', median_range(t[f'{kind}_own_path_share{sfx}']), True)}"
                 for kind in KINDS]  # fmt: skip
        print(
            f"SUMMARY {name} layer path, {how}: Megatron's router {med(t[f'router{sfx}']):.3f} ms (the same for every "
            f"dispatcher); the layer's own path (the layer forward's events less its router and kernel call) of the "
            f"layer forward: {' | '.join(paths)} (target <= 3%)",
            flush=True,
        )
    out["errors_vs_fp32"] = errs
    for kind, e in errs.items():
        print(f"SUMMARY {name} errors vs fp32, {kind}: " + ", ".join(f"{k} {v:.2e}" for k, v in e.items()), flush=True)
    return out


def bench(name: str, args) -> dict:
    bf16_cfg, fp8_cfg, L = SLICES[name]
    layers = {"bf16": build_layer(bf16_cfg, L)}
    layers["fp8"] = build_layer(fp8_cfg, L)
    layers["fp8"].load_state_dict(layers["bf16"].state_dict())
    H = layers["bf16"].config.hidden_size
    F = layers["bf16"].config.moe_ffn_hidden_size
    K = layers["bf16"].config.moe_router_topk
    T = args.tokens
    rows = T * K
    flops = 2.0 * rows * (H * 2 * F + F * H)
    print(
        f"\n=== {name}: hidden {H}, expert ffn {F}, top-{K}, {L} local experts, {T} tokens ({rows} rows), EP 1; "
        f"forward {flops / 1e12:.2f} TFLOP, backward {2 * flops / 1e12:.2f} TFLOP ===",
        flush=True,
    )
    torch.manual_seed(0)
    x = torch.randn(T, 1, H, device="cuda", dtype=torch.bfloat16)
    errs = {kind: errors_vs_fp32(layer, x, args.err_tokens) for kind, layer in layers.items()}
    fns, splits = variants(layers, x, rows, H, F, L)
    t = rounds(fns, splits, args.rounds, args.iters)
    check_pending_errors(wait=True)  # a failed launch of the rounds is an error, not a timing
    res = report(name, t, flops, errs)
    res.update(slice=name, hidden=H, ffn=F, topk=K, local_experts=L, tokens=T, configs=[bf16_cfg, fp8_cfg])
    del fns, splits, layers
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slices", default=",".join(SLICES), help=f"comma-separated, of {', '.join(SLICES)}")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10, help="timed calls per variant and round")
    ap.add_argument("--err-tokens", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    names = [s for s in args.slices.split(",") if s]
    bad = [s for s in names if s not in SLICES]
    if bad or not names:
        raise SystemExit(f"--slices: unknown {', '.join(bad) or '(none)'}; known: {', '.join(SLICES)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_ceilings needs a CUDA GPU (Hopper)")
    warnings.filterwarnings("ignore")
    from megatron.core import tensor_parallel

    import megatron_mok
    from megatron_mok.testing import init_one_rank

    init_one_rank("nccl")
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # the layers are initialised on the GPU
    megatron_mok.register()
    results = []
    for name in names:
        results.append(bench(name, args))
        if args.json:  # after each slice: a later slice's failure keeps the earlier figures
            write_result(args.json, "bench_ceilings", results, tokens=args.tokens, rounds=args.rounds, iters=args.iters)


if __name__ == "__main__":
    main()
