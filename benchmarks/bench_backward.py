#!/usr/bin/env python3
"""Benchmark the MoK backward megakernel against unfused torch and Megatron-Core baselines (Kimi-K2 slice).

One process, same inputs for every method; CUDA events around one call, warmup, median of --iters.
  MoK dgrad     : mok_backward(..., wgrad="none")   one kernel launch (+ a W2^T copy when recomputing)
  MoK + grouped : wgrad="grouped" (two torch._grouped_mm after the kernel, no host sync, bf16 wgrad out)
  MoK + mm      : wgrad="mm" (2 x L cuBLAS mm with fp32 output after the kernel, one host sync)
  MoK + kernel  : wgrad="kernel" (default: the MoK wgrad kernel, fp32 out, no host sync)
  torch         : the reference backward math: permute + _grouped_mm (fc1 recompute, dA, dX, dW2, dW1)
                  + SwiGLU backward + unpermute/top-k sum + router grad
  mcore         : Megatron-Core MoEAlltoAllTokenDispatcher + SequentialMLP at EP=1, autograd backward
                  (fc1 output saved by autograd, no recompute)
FLOPs: model backward = 2 x forward = 12 * rows * H * F; MoK and torch also recompute fc1 (+4 * rows * H * F).

  python benchmarks/bench_backward.py [--tokens 8192] [--comm-sms 8] [--minibatch 2560] [--no-mcore]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_common import PEAK, make_inputs, mcore_forward, mcore_layer, pipelined, timeit  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))
from emulated import mok_backward_emulated, mok_forward_emulated  # noqa: E402

from megatron_mok.kernel import check_last_error  # noqa: E402


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def permutation(idx, L):
    K = idx.shape[1]
    flat = idx.view(-1).long()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=L), 0).to(torch.int32)
    return order, order // K, offs


def torch_combine_buf(x, idx, w1, w2, L, F):
    """Forward's unweighted expert outputs combine_buf [T, K, H] (bf16), via torch._grouped_mm."""
    T, H = x.shape
    K = idx.shape[1]
    order, tok, offs = permutation(idx, L)
    h = torch._grouped_mm(x.index_select(0, tok), w1.transpose(1, 2), offs=offs)
    a = (torch.nn.functional.silu(h[:, :F].float()) * h[:, F:].float()).bfloat16()
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    comb = torch.empty((T * K, H), dtype=torch.bfloat16, device=x.device)
    comb[order] = y
    return comb.view(T, K, H)


def torch_backward(x, idx, w, go, comb, w1, w2, L, F):
    T, H = x.shape
    K = idx.shape[1]
    order, tok, offs = permutation(idx, L)
    xs = x.index_select(0, tok)
    gy = (go.index_select(0, tok).float() * w.view(-1)[order].unsqueeze(1)).bfloat16()
    h = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs)  # fc1 recompute [n, 2F]
    da = torch._grouped_mm(gy, w2, offs=offs).float()  # gy @ W2_e   [n, F]
    g, u = h[:, :F].float(), h[:, F:].float()
    sig = torch.sigmoid(g)
    silu = g * sig
    dh = torch.cat([da * u * sig * (1 + g * (1 - sig)), da * silu], 1).bfloat16()
    act = (silu * u).bfloat16()
    dx = torch._grouped_mm(dh, w1, offs=offs)  # dH @ W1_e [n, H]
    gb = torch.empty((T * K, H), dtype=torch.bfloat16, device=x.device)
    gb[order] = dx
    gx = gb.view(T, K, H).float().sum(1).bfloat16()
    gw = torch.bmm(comb, go.unsqueeze(2)).squeeze(2).float()
    dw2 = torch._grouped_mm(gy.t(), act, offs=offs)  # [L, H, F]
    dw1 = torch._grouped_mm(dh.t(), xs, offs=offs)  # [L, 2F, H]
    return gx, gw, dw1, dw2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--comm-sms", type=int, default=8)
    ap.add_argument("--minibatch", type=int, default=2560)
    ap.add_argument("--ring-slots", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--sweep", action="store_true", help="also try comm_sms 4 / 16")
    ap.add_argument("--no-mcore", action="store_true")
    ap.add_argument("--saved-only", action="store_true", help="skip the recompute variants of MoK (quick run)")
    ap.add_argument(
        "--kept-comm-sms",
        type=lambda v: [int(c) for c in v.split(",") if c],
        default=[8, 12, 16],
        help="backward comm SMs to try with the forward's kept x / act rows (kernel.save_expert_input); '' skips",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="print the GPU time of every kernel of one saved-h backward (torch.profiler)",
    )
    args = ap.parse_args()

    from megatron_mok.kernel import backward as bk

    H, F, K, L, T = 7168, 2048, 8, 8, args.tokens
    rows = T * K
    model_flops = 12.0 * rows * H * F
    recompute = 4.0 * rows * H * F
    dgrad_exec = 10.0 * rows * H * F  # dA + fc1 recompute + dX
    tf = lambda fl, ms: fl / (ms * 1e-3) / 1e12  # noqa: E731
    print(
        f"=== Kimi-K2 slice backward: H={H} F={F} top-{K} L={L} tokens={T} rows={rows} "
        f"(model bwd {model_flops / 1e12:.2f} TFLOP, +fc1 recompute {recompute / 1e12:.2f}) ===",
        flush=True,
    )
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    if not bk.is_available():
        print(f"MoK backward kernel unavailable: {bk.unavailable_reason()}", flush=True)
    x, idx, w, w1, w2, go = make_inputs(H, F, K, L, T, grad=True)
    comb = torch_combine_buf(x, idx, w1, w2, L, F)
    w1l, w2l = [[w1[e] for e in range(L)]], [[w2[e] for e in range(L)]]

    t_ref = torch_backward(x, idx, w, go, comb, w1, w2, L, F)
    t_ms, t_mn = timeit(lambda: torch_backward(x, idx, w, go, comb, w1, w2, L, F), args.iters, args.warmup)
    print(
        f"torch (_grouped_mm, recompute fc1): {t_ms:8.3f} ms (min {t_mn:.3f})  "
        f"{tf(model_flops, t_ms):6.1f} model TFLOP/s, {tf(model_flops + recompute, t_ms):6.1f} executed",
        flush=True,
    )

    def torch_fwd_bwd():
        comb_t = torch_combine_buf(x, idx, w1, w2, L, F)
        (comb_t.float() * w.unsqueeze(2)).sum(1).bfloat16()  # the forward's weighted top-k sum
        return torch_backward(x, idx, w, go, comb_t, w1, w2, L, F)

    tfb_ms, _ = timeit(torch_fwd_bwd, args.iters, args.warmup)
    print(f"torch (_grouped_mm) forward + backward: {tfb_ms:8.3f} ms", flush=True)
    mok_fb = m_fb = None

    best = None
    best_pipe = None  # (ms per call back to back, mode): the host queues ahead as in training

    def err_text(gx, gw, g1, g2) -> str:
        errs = dict(
            grad_x=rel(gx[0], t_ref[0]),
            grad_w=rel(gw[0], t_ref[1]),
            grad_w1=rel(torch.stack(g1[0]), t_ref[2]),
            grad_w2=rel(torch.stack(g2[0]), t_ref[3]),
        )
        return "rel err vs torch " + " ".join(f"{k} {v:.2e}" for k, v in errs.items())

    def time_saved_h_modes(label0, tag, pipe_tag, comm, kw, comb, hbuf, kept) -> None:
        """dgrad alone, + mm wgrad, + wgrad kernel of a saved-h backward (kept: the forward's kept rows),
        timed alone and back to back; the full-backward modes compete for the SUMMARY."""
        nonlocal best, best_pipe
        for mode, label, fl in (
            ("none", "dgrad kernel only", 6.0 * rows * H * F),
            ("mm", "+ mm fp32 wgrad", None),
            ("kernel", "+ wgrad kernel", None),
        ):
            fn = lambda m=mode: mok_backward_emulated(  # noqa: E731
                [go], [x], [idx], [w], comb, w1l, w2l, wgrad=m, check=False, saved_h=hbuf, kept=kept, **kw
            )
            ms, mn = timeit(fn, args.iters, args.warmup)
            pm = pipelined(fn, args.iters, 1)
            check_last_error()
            if fl is not None:
                extra = f"{tf(fl, ms):6.1f} executed dgrad TFLOP/s ({tf(fl, ms) / PEAK * 100:4.1f}% of {PEAK:.0f})"
            else:
                extra = (
                    f"{tf(model_flops, ms):6.1f} model TFLOP/s ({tf(model_flops, ms) / PEAK * 100:4.1f}% of {PEAK:.0f})"
                )
                if best is None or ms < best[0]:
                    best = (ms, comm, f"{mode}, {tag}")
                if best_pipe is None or pm < best_pipe[0]:
                    best_pipe = (pm, f"{mode}, {pipe_tag}")
            extra += f"; pipelined {pm:.3f} ms/call"
            print(f"MoK {label0} comm_sms={comm} {label:18s}: {ms:8.3f} ms (min {mn:.3f})  {extra}", flush=True)

    configs = [args.comm_sms] + ([c for c in (4, 16) if c != args.comm_sms] if args.sweep else [])
    if args.saved_only:
        configs = []
    if bk.is_available():
        for comm in configs:
            kw = dict(comm_sms=comm, ring_slots=args.ring_slots, minibatch_tokens=args.minibatch)
            try:
                gx, gw, g1, g2 = mok_backward_emulated([go], [x], [idx], [w], [comb], w1l, w2l, **kw)
                print(
                    f"MoK comm_sms={comm} minibatch={args.minibatch} slots={args.ring_slots}: "
                    + err_text(gx, gw, g1, g2),
                    flush=True,
                )
                for mode, label, fl in (
                    ("none", "dgrad kernel only", dgrad_exec),
                    ("grouped", "+ grouped wgrad", None),
                    ("mm", "+ mm fp32 wgrad", None),
                    ("kernel", "+ wgrad kernel", None),
                ):
                    fn = lambda m=mode, kw=kw: mok_backward_emulated(
                        [go],
                        [x],
                        [idx],
                        [w],
                        [comb],
                        w1l,
                        w2l,  # noqa: E731
                        wgrad=m,
                        check=False,
                        **kw,
                    )
                    ms, mn = timeit(fn, args.iters, args.warmup)
                    check_last_error()
                    if fl is not None:
                        extra = (
                            f"{tf(fl, ms):6.1f} executed dgrad TFLOP/s ({tf(fl, ms) / PEAK * 100:4.1f}% of {PEAK:.0f})"
                        )
                    else:
                        extra = (
                            f"{tf(model_flops, ms):6.1f} model TFLOP/s, {tf(model_flops + recompute, ms):6.1f} "
                            f"executed ({tf(model_flops + recompute, ms) / PEAK * 100:4.1f}% of {PEAK:.0f})"
                        )
                        if best is None or ms < best[0]:
                            best = (ms, comm, mode)
                    print(f"MoK comm_sms={comm} {label:18s}: {ms:8.3f} ms (min {mn:.3f})  {extra}", flush=True)
            except Exception as exc:
                print(f"MoK comm_sms={comm}: FAILED {type(exc).__name__}: {exc}", flush=True)
                traceback.print_exc(limit=4)
                if isinstance(exc, bk.MokKernelError):
                    break
        # save instead of recompute: the forward kernel keeps h, the backward skips the fc1 GEMM
        try:
            from megatron_mok import kernel as fk

            comm = args.comm_sms
            kw = dict(comm_sms=comm, ring_slots=args.ring_slots, minibatch_tokens=args.minibatch)
            hbuf = [torch.empty((rows, 2 * F), dtype=torch.bfloat16, device="cuda")]
            _, kcomb, _ = mok_forward_emulated([x], [idx], [w], w1l, w2l, saved_h=hbuf, **kw)
            gx, gw, g1, g2, bufs = mok_backward_emulated(
                [go], [x], [idx], [w], kcomb, w1l, w2l, saved_h=hbuf, return_buffers=True, **kw
            )
            print(f"MoK saved-h comm_sms={comm}: " + err_text(gx, gw, g1, g2), flush=True)
            # the expert weight gradients alone, on the buffers the dgrad kernel left (6 * rows * H * F FLOP)
            wfl = 6.0 * rows * H * F
            bb = [bufs[k][0] for k in ("tpe", "xl", "gyl", "dh", "act")]
            g1m, g2m = bk.weight_grads(*bb, mode="mm")
            print(
                "  wgrad kernel vs mm: rel diff "
                f"dW1 {rel(torch.stack(g1[0]), torch.stack(g1m)):.2e} dW2 {rel(torch.stack(g2[0]), torch.stack(g2m)):.2e}",
                flush=True,
            )
            # Megatron's gradient-accumulation fusion: the kernel adds into fp32 main_grad instead of storing
            main_grad = {
                "main_grad_w1": [torch.zeros_like(t) for t in g1m],
                "main_grad_w2": [torch.zeros_like(t) for t in g2m],
            }
            for mode, label, kw_mg in (
                ("kernel", "kernel", {}),
                ("kernel", "kernel +=", main_grad),
                ("mm", "mm", {}),
                ("grouped", "grouped", {}),
            ):
                ms, mn = timeit(lambda m=mode, k=kw_mg: bk.weight_grads(*bb, mode=m, **k), args.iters, args.warmup)
                print(
                    f"  wgrad alone ({label:9s}): {ms:8.3f} ms (min {mn:.3f})  {tf(wfl, ms):6.1f} TFLOP/s "
                    f"({tf(wfl, ms) / PEAK * 100:4.1f}% of {PEAK:.0f})",
                    flush=True,
                )
            time_saved_h_modes("saved-h", "saved h", "saved h", comm, kw, kcomb, hbuf, None)
            if args.profile:  # where a saved-h backward's GPU time goes, kernel by kernel (gaps = the rest)
                fn = lambda: mok_backward_emulated(  # noqa: E731
                    [go], [x], [idx], [w], kcomb, w1l, w2l, check=False, saved_h=hbuf, **kw
                )
                for _ in range(2):
                    fn()
                torch.cuda.synchronize()
                host = []  # host time of one call (checks, allocations, tensor maps, launches), GPU idle
                for _ in range(5):
                    t0 = time.perf_counter()
                    fn()
                    host.append((time.perf_counter() - t0) * 1e3)
                    torch.cuda.synchronize()
                print(f"  host time per call (median of 5): {sorted(host)[2]:.3f} ms", flush=True)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                evs = sorted(
                    (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start,
                )
                if evs:
                    span = (evs[-1].time_range.end - evs[0].time_range.start) / 3e3
                    busy = sum(e.time_range.end - e.time_range.start for e in evs) / 3e3
                    print(f"  profile: 3 calls, {span:.3f} ms per call span, {busy:.3f} ms busy", flush=True)
                    prev_end = None
                    for e in evs[: len(evs) // 3]:
                        gap = (e.time_range.start - prev_end) / 1e3 if prev_end is not None else 0.0
                        dur = (e.time_range.end - e.time_range.start) / 1e3
                        print(f"    {dur:9.3f} ms  (gap before {gap:7.3f} ms)  {e.name[:90]}", flush=True)
                        prev_end = e.time_range.end
            # what W1^T / W2^T copies would cost per call (the wrapper made them before the kernel read W1 / W2
            # MN-major; the recompute path still makes W2^T)
            tms, _ = timeit(
                lambda: ([w.t().contiguous() for w in w1l[0]], [w.t().contiguous() for w in w2l[0]]),
                args.iters,
                args.warmup,
            )
            print(f"  (W1^T + W2^T copies, not made on this path: {tms:.3f} ms)", flush=True)
        except Exception as exc:
            print(f"MoK saved-h: FAILED {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc(limit=4)
        # saved h + kept rows (the layer's default, kernel.save_expert_input): the forward keeps the
        # layout-order x and act rows, the backward pulls only grad_out -> fewer comm SMs needed
        if args.kept_comm_sms:
            try:
                from megatron_mok import kernel as fk

                fkw = dict(comm_sms=8, ring_slots=args.ring_slots, minibatch_tokens=args.minibatch)
                hbuf = [torch.empty((rows, 2 * F), dtype=torch.bfloat16, device="cuda")]
                kept = fk.KeptRows.allocate(rows, H, F, args.minibatch, "cuda")
                _, kcomb, _ = mok_forward_emulated([x], [idx], [w], w1l, w2l, saved_h=hbuf, keep=kept, **fkw)
                for comm in args.kept_comm_sms:
                    kw = dict(comm_sms=comm, ring_slots=args.ring_slots, minibatch_tokens=args.minibatch)
                    res = mok_backward_emulated([go], [x], [idx], [w], kcomb, w1l, w2l, saved_h=hbuf, kept=kept, **kw)
                    print(f"MoK saved-h+kept comm_sms={comm}: " + err_text(*res), flush=True)
                    time_saved_h_modes(
                        "saved-h+kept",
                        "saved h + kept x/act",
                        f"saved h + kept x/act, comm {comm}",
                        comm,
                        kw,
                        kcomb,
                        hbuf,
                        kept,
                    )
                    if comm == args.kept_comm_sms[0]:  # the layer's fwd + bwd: forward at the config's split
                        from megatron_mok.config import load_config

                        kc = load_config("kimi-k2").kernel
                        fwk = dict(comm_sms=kc.comm_sms, ring_slots=kc.ring_slots, minibatch_tokens=kc.minibatch_tokens)
                        kept_fb = fk.KeptRows.allocate(rows, H, F, kc.minibatch_tokens, "cuda")

                        def mok_fwd_bwd(kw=kw, kept_fb=kept_fb, fwk=fwk):
                            _, c, _ = mok_forward_emulated(
                                [x], [idx], [w], w1l, w2l, saved_h=hbuf, keep=kept_fb, check=False, **fwk
                            )
                            return mok_backward_emulated(
                                [go], [x], [idx], [w], c, w1l, w2l, saved_h=hbuf, kept=kept_fb, check=False, **kw
                            )

                        mok_fb, _ = timeit(mok_fwd_bwd, args.iters, args.warmup)
                        mok_fb_pipe = pipelined(mok_fwd_bwd, args.iters, 2)
                        check_last_error()
                        print(
                            f"MoK forward (comm {kc.comm_sms}, mb {kc.minibatch_tokens}, saved h + kept) + backward (comm {comm}, mb "
                            f"{args.minibatch}, wgrad kernel): {mok_fb:8.3f} ms; pipelined {mok_fb_pipe:.3f} ms/call",
                            flush=True,
                        )
            except Exception as exc:
                print(f"MoK saved-h+kept: FAILED {type(exc).__name__}: {exc}", flush=True)
                traceback.print_exc(limit=4)

    m_ms = m_pipe = None
    if not args.no_mcore:
        try:
            experts, disp, routing_map, probs0 = mcore_layer(H, F, K, L, w1, w2, idx, w, port="29535")
            xi = x.clone().requires_grad_()
            probs = probs0.clone().requires_grad_()
            out = mcore_forward(experts, disp, xi, routing_map, probs)
            m_ms, m_mn = timeit(lambda: out.backward(go, retain_graph=True), args.iters, args.warmup)
            merr = rel(xi.grad / (args.iters + args.warmup), t_ref[0])
            m_pipe = pipelined(lambda: out.backward(go, retain_graph=True), args.iters, 1)

            def mcore_fwd_bwd():
                xf = x.clone().requires_grad_()
                pf = probs0.clone().requires_grad_()
                mcore_forward(experts, disp, xf, routing_map, pf).backward(go)

            m_fb, _ = timeit(mcore_fwd_bwd, args.iters, args.warmup)
            print(f"Megatron-Core alltoall + SequentialMLP forward + backward: {m_fb:8.3f} ms", flush=True)
            print(
                f"Megatron-Core alltoall + SequentialMLP backward (EP=1, autograd): {m_ms:8.3f} ms (min {m_mn:.3f}) "
                f"{tf(model_flops, m_ms):6.1f} model TFLOP/s  grad_x rel err vs torch {merr:.2e}; "
                f"pipelined {m_pipe:.3f} ms/call",
                flush=True,
            )
        except Exception as exc:
            print(f"Megatron-Core baseline unavailable: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc(limit=4)

    if best:
        line = (
            f"SUMMARY kimi backward: MoK {best[0]:.3f} ms (comm_sms={best[1]}, wgrad={best[2]}, "
            f"{tf(model_flops, best[0]):.0f} model / {tf(model_flops + recompute, best[0]):.0f} executed TFLOP/s) | "
            f"torch {t_ms:.3f} ms -> {t_ms / best[0]:.2f}x"
        )
        if m_ms:
            line += f" | mcore {m_ms:.3f} ms -> {m_ms / best[0]:.2f}x"
        print(line, flush=True)
    if mok_fb:
        line = f"SUMMARY kimi fwd+bwd: MoK {mok_fb:.3f} ms | torch {tfb_ms:.3f} ms -> {tfb_ms / mok_fb:.2f}x"
        if m_fb:
            line += f" | mcore {m_fb:.3f} ms -> {m_fb / mok_fb:.2f}x"
        print(line, flush=True)
    if best_pipe and m_pipe:
        print(
            f"SUMMARY kimi backward, pipelined (calls back to back, host ahead): MoK {best_pipe[0]:.3f} ms/call "
            f"(wgrad={best_pipe[1]}) | mcore {m_pipe:.3f} ms/call -> {m_pipe / best_pipe[0]:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
