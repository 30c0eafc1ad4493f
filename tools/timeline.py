#!/usr/bin/env python3
"""Record a MoK kernel's in-kernel timeline and render it as a PNG (one row per SM).

    python tools/timeline.py --config kimi-k2 --out timeline       # GPU: writes timeline.json (+ .png)
    python tools/timeline.py --pass backward --out timeline-bwd    # the backward kernel (saved h)
    python tools/timeline.py --dtype fp8 --out timeline-fp8        # the FP8 forward kernel
    python tools/timeline.py --pass backward --dtype fp8 --out timeline-bwd-fp8   # FP8 dgrad
    python tools/timeline.py --render timeline.json                # anywhere with matplotlib: the PNG

Shows when each SM ran schedule, pull dispatch (per minibatch), fc1 / fc2 tiles and the final
weighted sum, so the overlap of dispatch, expert GEMMs and combine (and idle gaps) is visible.
Runs one EP-1 launch of the layer's kernels on the config's per-GPU slice, after a warmup.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_mok.kernel.timeline import (  # noqa: E402
    BACKWARD_KINDS,
    FORWARD_KINDS,
    PhaseWork,
    load_json,
    phase_fractions,
    render_png,
    save_json,
    summarize,
)


def record(args) -> str:
    import torch

    from megatron_mok.config import load_config
    from megatron_mok.kernel import KeptRows, PeerBuffers, mok_backward, mok_forward
    from megatron_mok.kernel.timeline import Timeline

    cfg = load_config(args.config)
    m, k = cfg.model, cfg.kernel
    L = args.local_experts or max(1, m.num_moe_experts // args.ep_of_config)
    H, F, K, T = m.hidden_size, m.moe_ffn_hidden_size, m.moe_router_topk, args.tokens
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn((T, H), generator=gen, device=dev).bfloat16()
    idx = torch.rand((T, L), generator=gen, device=dev).topk(K, dim=1).indices.int()
    w = torch.softmax(torch.randn((T, K), generator=gen, device=dev), 1)
    w1 = [(torch.randn((2 * F, H), generator=gen, device=dev) * H**-0.5).bfloat16() for _ in range(L)]
    w2 = [(torch.randn((H, F), generator=gen, device=dev) * F**-0.5).bfloat16() for _ in range(L)]
    bufs = PeerBuffers.local(dev)
    comm = k.comm_sms if args.comm_sms is None else args.comm_sms
    kw = dict(comm_sms=comm, ring_slots=k.ring_slots, minibatch_tokens=k.minibatch_tokens)
    tl = Timeline(cap=args.cap)
    if args.dtype == "fp8":
        if args.pass_ != "forward" and not args.saved_h:
            raise SystemExit("--dtype fp8 --pass backward: the FP8 dgrad reads the saved fc1 output (no --recompute)")
        from megatron_mok.kernel.quant import quantize_expert_weights

        kw["fp8"] = quantize_expert_weights([w1], [w2], transposed=args.pass_ == "backward")
    kept = None
    if args.pass_ == "forward":
        for _ in range(3):
            mok_forward(bufs, x, idx, w, w1, w2, **kw)
        _, _, tpe = mok_forward(bufs, x, idx, w, w1, w2, **kw, timeline=tl)
    else:
        # the layer's backward: the config's backward comm SMs / minibatch; kept x / act rows with bf16
        # (kernel.save_expert_input, --no-kept: pull x again)
        bkw = dict(kw, comm_sms=args.comm_sms or k.bwd_comm_sms, minibatch_tokens=k.bwd_minibatch_tokens)
        kw["comm_sms"] = k.comm_sms  # the forward that lays out the kept rows: the config's split
        if args.dtype == "bf16" and k.save_expert_input and args.kept:
            kept = KeptRows.allocate(T * K, H, F, k.minibatch_tokens, dev)
        hbuf = torch.empty((T * K, 2 * F), dtype=torch.bfloat16, device=dev) if args.saved_h else None
        _, comb, tpe = mok_forward(bufs, x, idx, w, w1, w2, **kw, saved_h=hbuf, keep=kept)
        go = torch.randn((T, H), generator=gen, device=dev).bfloat16()
        bkw.update(wgrad="none", saved_h=hbuf, kept=kept)
        for _ in range(3):
            mok_backward(bufs, go, x, idx, w, comb, w1, w2, **bkw)
        mok_backward(bufs, go, x, idx, w, comb, w1, w2, **bkw, timeline=tl)
    events = tl.events()
    meta = {
        "pass": args.pass_,
        "dtype": args.dtype,
        "saved_h": bool(args.saved_h),
        "config": args.config,
        "shape": {"H": H, "F": F, "K": K, "L": L, "tokens_per_rank": T, "ep": 1},
        **{k: v for k, v in (kw if args.pass_ == "forward" else bkw).items() if k not in ("fp8", "saved_h", "kept")},
        "kept_rows": args.pass_ == "backward" and kept is not None,
        "dropped_events": tl.dropped(),
        "gpu": torch.cuda.get_device_name(),
    }
    meta.update(summarize(events))
    path = args.out + ".json"
    save_json(events, path, meta)
    rows = int(tpe.sum())
    print(f"{len(events)} events on {meta['ctas']} CTAs, span {meta['span_us']:.1f} us -> {path}")
    print(f"{'phase':16s} {'window (us)':>22s} {'busy SM-us':>12s} {'share of SM-time':>17s} {'events':>7s}")
    for kind in FORWARD_KINDS if args.pass_ == "forward" else BACKWARD_KINDS:
        if kind in meta["busy_sm_us"]:
            w = meta["window_us"][kind]
            n = sum(1 for e in events if e.kind == kind)
            print(
                f"{kind:16s} {w[0]:10.1f} - {w[1]:9.1f} {meta['busy_sm_us'][kind]:12.1f} "
                f"{100 * meta['sm_time_share'][kind]:16.1f}% {n:7d}"
            )
    # forward tiles' K blocks: 128-deep (fp8) or 64-deep (bf16), the same tensor work per block either way
    # (two warpgroups x four m64n256 WGMMAs), so their MMA time per block compares the two K loops directly
    bk = 128 if args.dtype == "fp8" else 64
    nk = {"fc1": H // bk, "fc2": F // bk} if args.pass_ == "forward" else {}
    for kind, t in meta.get("tile_us", {}).items():
        per_block = ""
        if kind in nk:
            per_block = f"; MMA time per {bk}-deep K block {(t['mean_us'] - t['epilogue_us']) / nk[kind]:.3f} us"
        print(
            f"{kind} tiles: {t['tiles']}, mean {t['mean_us']:.2f} us, of which epilogue (MMAs done -> its stores issued) "
            f"{t['epilogue_us']:.2f} us ({100 * t['epilogue_us'] / t['mean_us']:.1f}%){per_block}"
        )
    # per GEMM phase: FLOPs / busy SM-time -> TFLOP/s per busy SM (x 132 = rate if every SM ran it)
    if args.pass_ == "forward":
        gemms = {"fc1": 2.0 * rows * H * 2 * F, "fc2": 2.0 * rows * F * H}
    else:
        s1 = 2.0 * rows * H * F * (1 if args.saved_h else 3)  # dA (+ fc1 recompute: 2x)
        gemms = {"dgrad1": s1, "dgrad2": 2.0 * rows * 2 * F * H}
    total = sum(gemms.values())
    for kind, fl in gemms.items():
        us = meta["busy_sm_us"].get(kind, 0.0)
        if us > 0:
            per_sm = fl / (us * 1e-6) / 1e12
            print(
                f"{kind}: {fl / 1e12:.2f} TFLOP in {us:.0f} SM-us -> {per_sm:.2f} TFLOP/s per busy SM "
                f"({per_sm * 132:.0f} TFLOP/s if all 132 SMs ran it)"
            )
    print(
        f"launch overall: {total / 1e12:.2f} TFLOP in {meta['span_us']:.0f} us = {total / (meta['span_us'] * 1e-6) / 1e12:.0f} TFLOP/s"
    )
    # fraction of ceiling per phase: GEMMs vs the dense GEMM ceiling of their dtype, copies / reductions
    # vs the device copy rate (bytes read + written), both measured on the H200 (README ceilings)
    fp8 = args.dtype == "fp8"
    gemm_ceil = args.fp8_ceiling if fp8 else args.bf16_ceiling
    Tt = T
    xq = H * (1 + 4 / 128) if fp8 else 2 * H  # bytes of a ring row (e4m3 + block scales, or bf16)
    # minibatch 0 is pulled by every CTA of an owner, but only the comm CTAs record pull events: count
    # the comm CTAs' share of it only, so the pull rates are not inflated (in-SM pull, comm_sms 0: no
    # CTA records minibatch 0, and the other minibatches' events overlap the GEMM tiles of their SM)
    lkw = kw if args.pass_ == "forward" else bkw
    cpr = meta["ctas"]
    comm_share = lkw["comm_sms"] / cpr
    mb0 = min(lkw["minibatch_tokens"], rows)
    pulled = rows - mb0 * (1 - comm_share)  # rows whose pull the recorded events cover
    if args.pass_ == "forward":
        work = {
            "dispatch": PhaseWork(pulled * (2 * H + xq), "byte", args.copy_ceiling),
            "fc1": PhaseWork(gemms["fc1"], "flop", gemm_ceil),
            "fc2": PhaseWork(gemms["fc2"], "flop", gemm_ceil),
            "combine": PhaseWork(rows * 2 * H + Tt * 2 * H, "byte", args.copy_ceiling),
        }
    else:
        kept_x = bool(meta.get("kept_rows"))
        pull = pulled * (2 * H * 2 + (0 if kept_x else 2 * H * 2) + ((H + H / 32) if fp8 else 0))
        work = {
            "pull": PhaseWork(pull, "byte", args.copy_ceiling),
            "dgrad1": PhaseWork(gemms["dgrad1"], "flop", gemm_ceil),
            "dgrad2": PhaseWork(gemms["dgrad2"], "flop", gemm_ceil),
            "grad_x": PhaseWork(rows * 2 * H + Tt * 2 * H, "byte", args.copy_ceiling),
        }
    fr = phase_fractions(meta, work, meta["ctas"])
    print(
        f"fraction of ceiling ({'fp8' if fp8 else 'bf16'} GEMM {gemm_ceil:.0f} TFLOP/s, copy {args.copy_ceiling:.0f} GB/s):"
    )
    for kind, f in fr.items():
        u = "TFLOP/s" if work[kind].unit == "flop" else "GB/s"
        print(
            f"  {kind:9s} per busy SM x {meta['ctas']}: {f['rate_full_gpu']:8.1f} {u} = {100 * f['frac_full_gpu']:5.1f}% | "
            f"over its window: {f['rate_window']:8.1f} {u} = {100 * f['frac_window']:5.1f}%"
        )
    if lkw["comm_sms"] == 0:
        print(
            "  (in-SM pull: the dispatch events are three pull warps per SM running beside that SM's GEMM tiles, "
            "so its busy SM-time overlaps fc1 / fc2 and its per-SM rate is not an SM's copy rate)"
        )
    sched = meta["window_us"].get("schedule")
    if sched:
        print(
            f"  schedule  {sched[1] - sched[0]:.1f} us of the {meta['span_us']:.0f} us span ({100 * (sched[1] - sched[0]) / meta['span_us']:.1f}%)"
        )
    meta["fractions"] = fr
    save_json(events, path, meta)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="kimi-k2", help="bundled config name or YAML path")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    ap.add_argument("--ep-of-config", type=int, default=48, help="EP size that sets local experts (E / ep)")
    ap.add_argument("--local-experts", type=int, default=0)
    ap.add_argument(
        "--comm-sms",
        type=int,
        default=None,
        help="comm SMs of the timed launch (default: the config's; forward 0 = the in-SM pull)",
    )
    ap.add_argument("--cap", type=int, default=8192, help="events per CTA")
    ap.add_argument("--out", default="timeline")
    ap.add_argument("--pass", dest="pass_", choices=("forward", "backward"), default="forward")
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="kernel variant (fp8 backward: dgrad)")
    ap.add_argument(
        "--recompute", dest="saved_h", action="store_false", help="backward: recompute fc1 instead of the saved h"
    )
    ap.add_argument(
        "--no-kept",
        dest="kept",
        action="store_false",
        help="backward: the forward keeps no x / act rows (pull x again)",
    )
    ap.add_argument("--bf16-ceiling", type=float, default=760.0, help="dense bf16 GEMM TFLOP/s (H200, torch 2.11)")
    ap.add_argument("--fp8-ceiling", type=float, default=1302.0, help="fp8 rowwise GEMM TFLOP/s (H200, torch 2.11)")
    ap.add_argument("--copy-ceiling", type=float, default=4150.0, help="device copy GB/s, read + written (H200)")
    ap.add_argument("--render", default=None, help="render an existing timeline JSON to PNG")
    args = ap.parse_args()
    path = args.render or record(args)
    events, meta = load_json(path)
    png = os.path.splitext(path)[0] + ".png"
    try:
        shape = meta.get("shape", {})
        title = (
            f"MoK {meta.get('pass', 'forward')} timeline: {meta.get('config', '')} {shape}, "
            f"comm_sms {meta.get('comm_sms')}"
        )
        render_png(events, png, title=title)
        print("wrote", png)
    except ImportError:
        print("matplotlib not installed: JSON only; render elsewhere with --render", path)


if __name__ == "__main__":
    main()
