#!/usr/bin/env python3
"""Record the MoK forward kernel's in-kernel timeline and render it as a PNG (one row per SM).

    python scripts/timeline.py --config kimi-k2 --out timeline       # GPU: writes timeline.json (+ .png)
    python scripts/timeline.py --render timeline.json                # anywhere with matplotlib: the PNG

Shows when each SM ran schedule, pull dispatch (per minibatch), fc1 / fc2 tiles and the final
weighted sum, so the overlap of dispatch, expert GEMMs and combine (and idle gaps) is visible.
Runs emulated EP (--ep ranks on one GPU, one launch) on the config's per-GPU slice, after a warmup.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_mok.kernel.timeline import load_json, render_png, save_json, summarize  # noqa: E402


def record(args) -> str:
    import torch

    from megatron_mok.config import load_config
    from megatron_mok.kernel import mok_forward_emulated
    from megatron_mok.kernel.timeline import Timeline

    cfg = load_config(args.config)
    m, k = cfg.model, cfg.kernel
    L = args.local_experts or max(1, m.num_moe_experts // args.ep_of_config)
    H, F, K, T, R = m.hidden_size, m.moe_ffn_hidden_size, m.moe_router_topk, args.tokens, args.ep
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = [torch.randn((T, H), generator=gen, device=dev).bfloat16() for _ in range(R)]
    idx = [torch.rand((T, R * L), generator=gen, device=dev).topk(K, dim=1).indices.int() for _ in range(R)]
    w = [torch.softmax(torch.randn((T, K), generator=gen, device=dev), 1) for _ in range(R)]
    w1 = [
        [(torch.randn((2 * F, H), generator=gen, device=dev) * H**-0.5).bfloat16() for _ in range(L)] for _ in range(R)
    ]
    w2 = [[(torch.randn((H, F), generator=gen, device=dev) * F**-0.5).bfloat16() for _ in range(L)] for _ in range(R)]
    kw = dict(comm_sms=args.comm_sms or k.comm_sms, ring_slots=k.ring_slots, minibatch_tokens=k.minibatch_tokens)
    for _ in range(3):
        mok_forward_emulated(x, idx, w, w1, w2, **kw)
    tl = Timeline(cap=args.cap)
    _, _, tpe = mok_forward_emulated(x, idx, w, w1, w2, **kw, timeline=tl)
    events = tl.events()
    meta = {
        "config": args.config,
        "shape": {"H": H, "F": F, "K": K, "L": L, "tokens_per_rank": T, "ep": R},
        **kw,
        "dropped_events": tl.dropped(),
        "gpu": torch.cuda.get_device_name(),
    }
    meta.update(summarize(events))
    path = args.out + ".json"
    save_json(events, path, meta)
    rows = sum(int(t.sum()) for t in tpe)
    flops = 2.0 * rows * H * 2 * F + 2.0 * rows * F * H
    print(f"{len(events)} events on {meta['ctas']} CTAs, span {meta['span_us']:.1f} us -> {path}")
    print(f"{'phase':10s} {'window (us)':>22s} {'busy SM-us':>12s} {'share of SM-time':>17s}")
    for kind in ("schedule", "dispatch", "fc1", "fc2", "combine"):
        if kind in meta["busy_sm_us"]:
            w = meta["window_us"][kind]
            print(
                f"{kind:10s} {w[0]:10.1f} - {w[1]:9.1f} {meta['busy_sm_us'][kind]:12.1f} "
                f"{100 * meta['sm_time_share'][kind]:16.1f}%"
            )
    gemm_us = meta["busy_sm_us"].get("fc1", 0.0) + meta["busy_sm_us"].get("fc2", 0.0)
    if gemm_us > 0:
        per_sm = flops / (gemm_us * 1e-6) / 1e12  # TFLOP/s per busy SM
        print(
            f"expert GEMM tiles: {flops / 1e12:.2f} TFLOP in {gemm_us:.0f} SM-us -> {per_sm:.2f} TFLOP/s per busy SM "
            f"({per_sm * 132:.0f} TFLOP/s if all 132 SMs ran tiles; launch overall {flops / (meta['span_us'] * 1e-6) / 1e12:.0f})"
        )
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="kimi-k2", help="bundled config name or YAML path")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    ap.add_argument("--ep", type=int, default=1, help="emulated EP ranks in the launch")
    ap.add_argument("--ep-of-config", type=int, default=48, help="EP size that sets local experts (E / ep)")
    ap.add_argument("--local-experts", type=int, default=0)
    ap.add_argument("--comm-sms", type=int, default=0, help="0: the config's value")
    ap.add_argument("--cap", type=int, default=8192, help="events per CTA")
    ap.add_argument("--out", default="timeline")
    ap.add_argument("--render", default=None, help="render an existing timeline JSON to PNG")
    args = ap.parse_args()
    path = args.render or record(args)
    events, meta = load_json(path)
    png = os.path.splitext(path)[0] + ".png"
    try:
        shape = meta.get("shape", {})
        title = f"MoK forward timeline: {meta.get('config', '')} {shape}, comm_sms {meta.get('comm_sms')}"
        render_png(events, png, title=title)
        print("wrote", png)
    except ImportError:
        print("matplotlib not installed: JSON only; render elsewhere with --render", path)


if __name__ == "__main__":
    main()
