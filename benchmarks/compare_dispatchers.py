#!/usr/bin/env python3
"""Compare one Megatron MoE layer across token dispatchers: mok, alltoall, flex+HybridEP, flex+DeepEP.

Same model config, same weights (state dict copied from the first layer built), same inputs.
Backends that are not installed are skipped with a message. Prints per-GPU layer time (forward and
forward+backward), tokens/s per GPU and the ratio to ``alltoall``; saves a bar plot (PNG).

    torchrun --nproc-per-node 8 benchmarks/compare_dispatchers.py --config kimi-k2 --tokens 8192
    python benchmarks/compare_dispatchers.py --config tiny-test --tokens 256 --iters 2   # 1 process (CPU ok)

EP = number of processes. The model uses the config's per-layer shapes; at small EP the expert
count is reduced to ``--experts-per-rank * EP`` so the layer fits one GPU (per-expert shapes unchanged).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from result_file import write_result  # noqa: E402

DISPATCHERS = {
    "mok": dict(dispatcher="mok"),
    "alltoall": dict(dispatcher="alltoall"),
    "flex-hybridep": dict(dispatcher="flex", moe_flex_dispatcher_backend="hybridep", moe_router_dtype="fp32"),
    "flex-deepep": dict(dispatcher="flex", moe_flex_dispatcher_backend="deepep"),
}


def _init(backend: str) -> tuple[int, int]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_mok.testing import free_port

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    return rank, world


def _time(fn, iters: int, warmup: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny-test")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per GPU")
    ap.add_argument("--experts-per-rank", type=int, default=8)
    ap.add_argument("--dispatchers", default=",".join(DISPATCHERS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on GPU, fp32 on CPU")
    ap.add_argument("--plot", default="compare_dispatchers.png")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")

    import megatron_mok
    from megatron_mok.config import load_config
    from megatron_mok.testing import build_moe_layer, install_cpu_alltoall_shim, moe_transformer_config

    cuda = torch.cuda.is_available()
    rank, world = _init("nccl" if cuda else "gloo")
    install_cpu_alltoall_shim()
    megatron_mok.register()
    cfg = load_config(args.config)
    m = cfg.model
    experts = min(m.num_moe_experts, args.experts_per_rank * world)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if cuda else "fp32")]
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    from megatron_mok.config import parse_config

    mok_cfg = parse_config(
        {
            "model": {
                "name": f"{m.name}-x{experts}",
                "hidden_size": m.hidden_size,
                "moe_ffn_hidden_size": m.moe_ffn_hidden_size,
                "num_moe_experts": experts,
                "moe_router_topk": m.moe_router_topk,
            },
            # every kernel setting of the config (backward split, kept rows, ...): only the expert count changes
            "kernel": dataclasses.asdict(cfg.kernel),
        },
        cfg.source,
    )
    torch.manual_seed(0)
    x = torch.randn(args.tokens, 1, m.hidden_size, device=device, dtype=dtype)
    results, state = [], None
    for name in args.dispatchers.split(","):
        spec = dict(DISPATCHERS[name])
        kw = dict(
            hidden_size=m.hidden_size,
            ffn_hidden_size=m.moe_ffn_hidden_size,
            num_experts=experts,
            topk=m.moe_router_topk,
            ep_size=world,
            dtype=dtype,
            dispatcher=spec.pop("dispatcher"),
            **spec,
        )
        try:
            tc = moe_transformer_config(**kw)
            tc.mok_config = mok_cfg
            torch.manual_seed(0)
            layer = build_moe_layer(tc).to(device)
            if state is None:
                state = layer.state_dict()
            else:
                layer.load_state_dict(state)
        except Exception as exc:  # noqa: BLE001 - report and skip what is not installed / supported
            if rank == 0:
                print(f"[skip] {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)
            continue

        def fwd(layer=layer):
            with torch.no_grad():
                layer(x)

        def fwd_bwd(layer=layer):
            xi = x.detach().requires_grad_()
            out, _ = layer(xi)
            out.float().sum().backward()

        f = _time(fwd, args.iters, args.warmup, cuda)
        fb = _time(fwd_bwd, args.iters, args.warmup, cuda)
        res = {"dispatcher": name, "fwd_ms": f, "fwd_bwd_ms": fb, "tokens_per_s": args.tokens / (fb / 1e3)}
        if name == "mok":
            res["backend"] = layer.token_dispatcher.last_backend
        results.append(res)
    base = next((r for r in results if r["dispatcher"] == "alltoall"), None)
    if rank == 0:
        print(
            f"\n{m.name}: hidden {m.hidden_size} ffn {m.moe_ffn_hidden_size} experts {experts} top-{m.moe_router_topk}, "
            f"EP {world}, {args.tokens} tokens/GPU, {dtype}, {'GPU' if cuda else 'CPU'}"
        )
        print(
            f"{'dispatcher':16s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} {'tokens/s/GPU':>13s} {'vs alltoall (fwd, fwd+bwd)':>28s}"
        )
        for r in results:
            ratio = f"{base['fwd_ms'] / r['fwd_ms']:.2f}x, {base['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x" if base else "-"
            extra = f"  [{r['backend']}]" if "backend" in r else ""
            print(
                f"{r['dispatcher']:16s} {r['fwd_ms']:9.3f} {r['fwd_bwd_ms']:11.3f} {r['tokens_per_s']:13.0f} {ratio:>28s}{extra}"
            )
        if args.json:
            shape = dict(hidden=m.hidden_size, ffn=m.moe_ffn_hidden_size, experts=experts, topk=m.moe_router_topk)
            write_result(
                args.json,
                "compare_dispatchers",
                results,
                config=m.name,
                ep=world,
                tokens=args.tokens,
                shape=shape,
                dtype=str(dtype).removeprefix("torch."),
                iters=args.iters,
            )
        if args.plot and results:
            try:
                import matplotlib

                matplotlib.use("Agg")
                import matplotlib.pyplot as plt

                names = [r["dispatcher"] for r in results]
                fig, ax = plt.subplots(figsize=(6, 3.2))
                pos = range(len(names))
                ax.bar([p - 0.2 for p in pos], [r["fwd_ms"] for r in results], 0.4, label="forward")
                ax.bar([p + 0.2 for p in pos], [r["fwd_bwd_ms"] for r in results], 0.4, label="forward+backward")
                ax.set_xticks(list(pos), names)
                ax.set_ylabel("ms per layer per GPU")
                ax.set_title(f"{m.name} MoE layer, EP {world}, {args.tokens} tokens/GPU")
                ax.legend()
                fig.tight_layout()
                fig.savefig(args.plot, dpi=120)
                print(f"plot: {args.plot}")
            except ImportError:
                print("no plot: matplotlib is not installed (pip install 'megatron-mok[plot]')")
    import torch.distributed as dist

    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
