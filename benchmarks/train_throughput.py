#!/usr/bin/env python3
"""Training throughput of a Megatron-Core GPT-MoE with ``mok`` and with Megatron's ``alltoall``, back to back on
one GPU: the same model, the same weights (same seed), the same data.

The model is Megatron-Core's own GPTModel (local spec, a MoE in every layer; ``examples/train_gpt_moe.py`` builds
it), trained with torch Adam on synthetic next-token data. Each dispatcher in turn: build the model, run the warm-up
iterations, then the timed ones; an iteration is forward, loss, backward and the optimizer step, timed with CUDA
events (on CPU: the wall clock), with one synchronisation at its end. Prints ms per iteration (median and the
min-max spread), tokens/s per GPU, peak GPU memory, the speed-up over ``alltoall``, which backend ``mok`` ran, and
both loss curves.

The defaults are Kimi-K2's expert shapes (hidden 7168, expert ffn 2048, top-8) with 8 experts at EP 1, 56 heads of
128, 2 layers, sequence 4096, micro-batch 1, vocab 32768, bf16: about 1.6 B parameters, sized for one 80 GB GPU.

    python benchmarks/train_throughput.py --json train_throughput.json --plot train_loss.png
    python benchmarks/train_throughput.py --hidden 64 --ffn 32 --experts 4 --topk 2 --layers 1 --heads 4 \\
        --seq 16 --batch 2 --vocab 128 --steps 2 --warmup 1          # CPU (gloo, the reference backend)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any, NoReturn

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, ".."))
sys.path.insert(0, os.path.join(_HERE, "..", "examples"))
sys.path.insert(0, _HERE)
import train_gpt_moe  # noqa: E402
from result_file import write_result  # noqa: E402

if TYPE_CHECKING:
    from megatron_mok.config import MokConfig

DISPATCHERS = ("alltoall", "allgather", "mok")
BASELINE = "alltoall"
# the bundled config whose kernel settings the defaults use: the defaults are its per-expert shapes
DEFAULT_MOK_CONFIG = "kimi-k2"


def _fail(msg: str) -> NoReturn:
    """One line naming the problem, exit status 2, before anything is built."""
    print(f"train_throughput.py: {msg}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048, help="expert ffn hidden size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--layers", type=int, default=2, help="transformer layers, each with a MoE")
    p.add_argument("--heads", type=int, default=56, help="attention heads (must divide --hidden)")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1, help="micro-batch (sequences per iteration)")
    p.add_argument("--steps", type=int, default=20, help="timed iterations per dispatcher")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations before them")
    p.add_argument("--dispatchers", default="alltoall,mok", help=f"comma-separated, of: {', '.join(DISPATCHERS)}")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on GPU, fp32 on CPU")
    # the parameters are bf16 with no fp32 master copy (as the example trains): much smaller Adam steps than a
    # bf16 weight's rounding step would be lost, and the loss curves would say little
    p.add_argument(
        "--lr", type=float, default=1e-4, help="Adam learning rate (gradients clipped to norm 1, as Megatron does)"
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--mok-config",
        default=None,
        help=f"MoK config (bundled name or YAML) whose kernel settings mok uses; its expert count is replaced by "
        f"--experts (default: {DEFAULT_MOK_CONFIG} where hidden / ffn / top-k are its, else derived from the shapes)",
    )
    p.add_argument("--json", default=None, help="write the figures and their context to this result file")
    p.add_argument("--plot", default=None, help="save the loss curves as this PNG (needs matplotlib)")
    args = p.parse_args(argv)
    train_gpt_moe.check_model_args(args, _fail)
    if args.steps < 1:
        _fail(f"--steps must be >= 1, got {args.steps}")
    if args.warmup < 0:
        _fail(f"--warmup must be >= 0, got {args.warmup}")
    names = [d.strip() for d in args.dispatchers.split(",") if d.strip()]
    unknown = [d for d in names if d not in DISPATCHERS]
    if not names or unknown:
        _fail(f"--dispatchers {args.dispatchers!r}: each must be one of {', '.join(DISPATCHERS)}")
    if len(set(names)) != len(names):
        _fail(f"--dispatchers {args.dispatchers!r} names a dispatcher twice")
    args.dispatcher_list = names
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _fail("runs in one process on one GPU (EP 1): start it with python, not torchrun")
    args.dtype = args.dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    args.torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    args.mok_cfg = mok_config_for(args)
    return args


def mok_config_for(args: argparse.Namespace) -> MokConfig | None:
    """The MoK config for the model: ``--mok-config``'s (or by default Kimi-K2's, where the shapes are its) kernel
    settings with the model section rewritten to ``--experts``, as at EP 1 only the expert count differs from the
    full model; None lets the dispatcher derive settings from the shapes."""
    from megatron_mok.config import MokConfigError, load_config, parse_config

    name = args.mok_config or DEFAULT_MOK_CONFIG
    try:
        cfg = load_config(name)
    except MokConfigError as exc:
        _fail(f"--mok-config: {exc}")
    m = cfg.model
    if (m.hidden_size, m.moe_ffn_hidden_size, m.moe_router_topk) != (args.hidden, args.ffn, args.topk):
        if args.mok_config is None:
            return None
        _fail(
            f"--mok-config {name} is for hidden {m.hidden_size} ffn {m.moe_ffn_hidden_size} top-{m.moe_router_topk}, "
            f"not hidden {args.hidden} ffn {args.ffn} top-{args.topk}"
        )
    model = {
        "name": f"{m.name}-x{args.experts}",
        "hidden_size": m.hidden_size,
        "moe_ffn_hidden_size": m.moe_ffn_hidden_size,
        "num_moe_experts": args.experts,
        "moe_router_topk": m.moe_router_topk,
    }
    return parse_config({"model": model, "kernel": dataclasses.asdict(cfg.kernel)}, cfg.source)


def _init_process_group(cuda: bool) -> tuple[bool, bool]:
    """A one-rank process group and Megatron's parallel state, each unless the caller (a test process) has it
    already; returns which of the two were made here, to be destroyed here."""
    from megatron_mok.testing import init_one_rank

    return init_one_rank("nccl" if cuda else "gloo")


def _destroy_process_group(made_group: bool, made_state: bool) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if made_state:
        parallel_state.destroy_model_parallel()
    if made_group:
        dist.destroy_process_group()


def run_dispatcher(
    name: str,
    args: argparse.Namespace,
    device: torch.device,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    pos: torch.Tensor,
    causal: torch.Tensor,
) -> dict[str, Any]:
    """Build the model for ``name``, train it on ``batches`` (warm-up, then timed) and return its figures."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    model = train_gpt_moe.build_model(name, 1, args, device, args.mok_cfg if name == "mok" else None)
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    start = torch.cuda.Event(enable_timing=True) if cuda else None
    end = torch.cuda.Event(enable_timing=True) if cuda else None
    losses: list[float] = []
    times: list[float] = []
    # the host's clock around each iteration too: on a GPU a cross-check that the events saw all of its work
    wall: list[float] = []
    for i, (inp, labels) in enumerate(batches):
        t = time.perf_counter()
        if start is not None:
            start.record()
        loss = train_gpt_moe.train_step(model, opt, inp, labels, pos, causal, 1)
        if end is not None and start is not None:
            end.record()
            # the iteration boundary, the only synchronisation: all of this iteration's work, on every stream,
            # is done before the next one starts
            torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - t) * 1e3
        losses.append(float(loss))  # the iteration is over: reading the loss waits for nothing
        if i >= args.warmup:
            times.append(start.elapsed_time(end) if end is not None and start is not None else wall_ms)
            wall.append(wall_ms)
    median = statistics.median(times)
    res: dict[str, Any] = {
        "dispatcher": name,
        "ms_per_iter": median,
        "ms_min": min(times),
        "ms_max": max(times),
        "iter_ms": times,
        "wall_ms_per_iter": statistics.median(wall),
        "tokens_per_s": args.batch * args.seq / (median / 1e3),
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "build_s": build_s,
        "params": params,
        "losses": losses,
    }
    backends = sorted(
        {str(m.token_dispatcher.last_backend) for m in model.modules() if hasattr(m, "token_dispatcher")}
        if name == "mok"
        else set()
    )
    if backends:
        res["backend"] = ",".join(backends)
    # free this model (and its optimizer state) before the next one is built: the next peak is its own
    del model, opt, loss
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return res


def summary_table(results: list[dict[str, Any]]) -> str:
    """One row per dispatcher: time per iteration, throughput, peak memory, speed-up over alltoall, backend."""
    base = next((r for r in results if r["dispatcher"] == BASELINE), None)
    lines = [
        f"{'dispatcher':12s} {'ms/iter':>9s} {'min-max':>17s} {'tokens/s/GPU':>13s} {'peak GiB':>9s} "
        f"{'vs ' + BASELINE:>12s}  backend"
    ]
    for r in results:
        spread = f"{r['ms_min']:.2f}-{r['ms_max']:.2f}"
        peak = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else "-"
        ratio = f"{r['speedup_vs_alltoall']:.3f}x" if base else "-"
        lines.append(
            f"{r['dispatcher']:12s} {r['ms_per_iter']:9.2f} {spread:>17s} {r['tokens_per_s']:13,.0f} {peak:>9s} "
            f"{ratio:>12s}  {r.get('backend', '-')}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    import megatron_mok
    from megatron_mok.testing import install_cpu_alltoall_shim

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    made = _init_process_group(cuda)
    install_cpu_alltoall_shim()
    megatron_mok.register()
    if cuda:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    try:
        # the same data for every dispatcher, made once on the device before any timing
        gen = torch.Generator().manual_seed(args.seed)
        batches = [train_gpt_moe.synthetic_batch(gen, args, device) for _ in range(args.warmup + args.steps)]
        pos, causal = train_gpt_moe.attention_inputs(args, device)
        gpu = torch.cuda.get_device_name(device) if cuda else "CPU"
        mok_cfg = args.mok_cfg.source if args.mok_cfg is not None else "derived from the shapes"
        print(
            f"GPT-MoE: hidden {args.hidden}, expert ffn {args.ffn}, {args.experts} experts top-{args.topk}, "
            f"{args.layers} layers, {args.heads} heads, seq {args.seq} x micro-batch {args.batch}, vocab {args.vocab}, "
            f"{args.dtype}, EP 1 | {gpu} | torch {torch.__version__} | {args.warmup} warm-up + {args.steps} timed "
            f"iterations | mok config: {mok_cfg}",
            flush=True,
        )
        results = []
        for name in args.dispatcher_list:
            results.append(run_dispatcher(name, args, device, batches, pos, causal))
            r = results[-1]
            print(
                f"  {name}: built in {r['build_s']:.1f} s ({r['params']:,} parameters), {r['ms_per_iter']:.2f} ms/iter",
                flush=True,
            )
    finally:
        _destroy_process_group(*made)
    base = next((r for r in results if r["dispatcher"] == BASELINE), None)
    for r in results:
        r["speedup_vs_alltoall"] = base["ms_per_iter"] / r["ms_per_iter"] if base else None
    curves = {r["dispatcher"]: r["losses"] for r in results}
    steps = args.warmup + args.steps
    gap = (
        max(max(c[i] for c in curves.values()) - min(c[i] for c in curves.values()) for i in range(steps))
        if len(curves) > 1
        else None
    )
    print(summary_table(results))
    mok = next((r for r in results if r["dispatcher"] == "mok"), None)
    if cuda and mok is not None and mok.get("backend") != "kernel":
        print(f"note: mok ran the {mok.get('backend')} backend on this GPU, not the MoK kernel (see its log line)")
    backends = [mok["backend"]] if mok is not None else []
    print(f"loss per iteration (warm-up included, {steps} iterations):")
    print(train_gpt_moe.loss_table(curves, backends, gap))
    if args.plot:
        print(train_gpt_moe.plot_curves(curves, args.plot), flush=True)
    if args.json:
        shape = dict(
            hidden=args.hidden,
            ffn=args.ffn,
            experts=args.experts,
            topk=args.topk,
            layers=args.layers,
            heads=args.heads,
            vocab=args.vocab,
            seq=args.seq,
            batch=args.batch,
        )
        write_result(
            args.json,
            "train_throughput",
            results,
            shape=shape,
            ep=1,
            dtype=args.dtype,
            steps=args.steps,
            warmup=args.warmup,
            lr=args.lr,
            seed=args.seed,
            tokens_per_iter=args.batch * args.seq,
            mok_config=mok_cfg,
            max_loss_gap=gap,
        )
    return results


if __name__ == "__main__":
    main()
