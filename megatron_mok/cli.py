"""``mok``: command-line entry of megatron-mok.

mok info                       which backend runs here, bundled configs
mok layer [--config NAME] [--ep N] [--tokens T] [--dtype bf16|fp32] [--check]
                               run one MoE layer (forward + backward) with the mok dispatcher;
                               --check compares it with Megatron's own dispatcher
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

# Megatron-Core's import-time notes about optional packages (Transformer Engine, Apex, absl) are not the user's
# business here; set before any rank imports Megatron (spawned ranks import this module first).
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|absl\.logging).*", category=UserWarning)


def _info(_args: argparse.Namespace) -> None:
    import megatron_mok
    from megatron_mok.config import bundled_configs, load_config

    print(f"megatron-mok {megatron_mok.__version__}")
    print(f"backend: {megatron_mok.backend_info()}")
    for name in bundled_configs():
        c = load_config(name)
        k = c.kernel
        print(
            f"  {name:18s} hidden {c.model.hidden_size:5d} ffn {c.model.moe_ffn_hidden_size:5d} "
            f"experts {c.model.num_moe_experts:4d} top-{c.model.moe_router_topk}  | {k.dtype} {k.arch} "
            f"comm/compute SMs {k.comm_sms}/{k.compute_sms}{' (in-SM pull)' if k.comm_sms == 0 else ''} "
            f"ring {k.ring_slots}x{k.minibatch_tokens}"
        )


#: --check: relative (Frobenius) error of the output and the input gradient against Megatron's alltoall layer on
#: the same weights (fp32: rounding only; bf16: the bf16 operands of the two implementations' different sums)
CHECK_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}


def _layer_worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    import torch

    from megatron_mok.config import load_config
    from megatron_mok.testing import build_moe_layer, install_cpu_alltoall_shim, moe_transformer_config

    warnings.filterwarnings("ignore")
    cfg = load_config(args.config)
    m = cfg.model
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    device = (
        torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)

    def make(dispatcher: str):
        tc = moe_transformer_config(
            hidden_size=m.hidden_size,
            ffn_hidden_size=m.moe_ffn_hidden_size,
            num_experts=m.num_moe_experts,
            topk=m.moe_router_topk,
            ep_size=world_size,
            dispatcher=dispatcher,
            dtype=dtype,
        )
        tc.mok_config = cfg
        torch.manual_seed(0)
        return build_moe_layer(tc).to(device)

    layer = make("mok")
    torch.manual_seed(1 + rank)
    x = torch.randn(args.tokens, 1, m.hidden_size, device=device, dtype=dtype, requires_grad=True)
    t0 = time.perf_counter()
    out, _ = layer(x)
    out.float().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    stats = layer.token_dispatcher.last_plan.stats if layer.token_dispatcher.last_plan else {}
    msg = (
        f"[rank {rank}/{world_size}] {cfg.model.name} tokens {args.tokens} -> rows pulled {stats.get('rows')} "
        f"in {stats.get('minibatches')} minibatches through {cfg.kernel.ring_slots} ring slots; "
        f"|out| {out.float().norm():.4f} |dx| {x.grad.float().norm():.4f} ({dt * 1e3:.1f} ms fwd+bwd)"
    )
    if args.check:
        install_cpu_alltoall_shim()
        base = make("alltoall")
        base.load_state_dict(layer.state_dict())
        xb = x.detach().clone().requires_grad_()
        ob, _ = base(xb)
        ob.float().sum().backward()
        err = ((ob.float() - out.float()).norm() / ob.float().norm().clamp_min(1e-30)).item()
        gerr = ((xb.grad.float() - x.grad.float()).norm() / xb.grad.float().norm().clamp_min(1e-30)).item()
        tol = CHECK_TOLERANCE[args.dtype]
        verdict = "PASS" if err <= tol and gerr <= tol else "FAIL"
        msg += (
            f"; vs Megatron {type(base.token_dispatcher).__name__}: relative error out {err:.2e}, dx {gerr:.2e} "
            f"(tolerance {tol:.0e}): {verdict}"
        )
        if verdict == "FAIL":
            raise RuntimeError(msg)
    print(msg, flush=True)


def _layer(args: argparse.Namespace) -> None:
    import megatron_mok
    from megatron_mok.testing import spawn

    print(f"backend: {megatron_mok.backend_info()}", flush=True)
    import torch

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    try:
        spawn(_layer_worker, args.ep, args, backend=backend)
    except torch.multiprocessing.ProcessRaisedException as exc:
        if args.verbose:
            raise
        # the rank's own exception, once, without the spawn wrapper's traceback (--verbose shows it)
        last = [ln for ln in str(exc).strip().splitlines() if ln.strip()][-1]
        _fail(f"rank {exc.error_index} failed: {last}")


def _tune(args: argparse.Namespace) -> None:
    from megatron_mok.tuner import tune

    ints = lambda s: [int(v) for v in s.split(",")] if s else None  # noqa: E731
    tune(
        args.config,
        ep=args.ep,
        tokens=args.tokens,
        out=args.out,
        comm_sms=ints(args.comm_sms),
        minibatches=ints(args.minibatch),
        slots=ints(args.ring_slots),
        iters=args.iters,
    )


def _fail(msg: str) -> None:
    """One line naming the problem, exit status 2, before any process starts."""
    print(f"mok: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _check_args(args: argparse.Namespace) -> None:
    """The layer / tune arguments, checked before anything runs: the config exists and is valid, the EP size
    divides its experts and fits one NVLink domain, the counts are positive."""
    from megatron_mok.config import MAX_EP_RANKS, MokConfigError, load_config

    if args.ep < 1:
        _fail(f"--ep must be >= 1, got {args.ep}")
    if args.ep > MAX_EP_RANKS:
        _fail(
            f"--ep {args.ep} exceeds one NVLink domain ({MAX_EP_RANKS} GPUs); across domains use Megatron's flex dispatcher"
        )
    if args.tokens < 1:
        _fail(f"--tokens must be >= 1, got {args.tokens}")
    if getattr(args, "iters", 1) < 1:
        _fail(f"--iters must be >= 1, got {args.iters}")
    try:
        cfg = load_config(args.config)
    except (MokConfigError, OSError) as exc:
        _fail(f"--config {args.config!r}: {exc}")
    experts = cfg.model.num_moe_experts
    if experts % args.ep:
        _fail(f"--ep {args.ep} does not divide the {experts} experts of config {cfg.model.name!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="mok", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="backend and bundled configs").set_defaults(fn=_info)
    lp = sub.add_parser("layer", help="run one MoE layer with the mok dispatcher")
    lp.add_argument("--config", default="tiny-test", help="bundled config name or YAML path (default: tiny-test)")
    lp.add_argument("--ep", type=int, default=2, help="expert-parallel ranks (processes)")
    lp.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    lp.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32")
    lp.add_argument(
        "--check", action="store_true", help="compare with Megatron's alltoall layer: PASS / FAIL (exit 2) by tolerance"
    )
    lp.add_argument("--verbose", action="store_true", help="full tracebacks of a failing rank")
    lp.set_defaults(fn=_layer)
    tp = sub.add_parser("tune", help="tune the kernel settings of a config on this GPU")
    tp.add_argument("--config", required=True, help="bundled config name or YAML path")
    tp.add_argument("--ep", type=int, required=True, help="expert-parallel size the model will train with")
    tp.add_argument("--tokens", type=int, default=8192, help="tokens per GPU per layer call")
    tp.add_argument("--out", default=None, help="write the tuned YAML here")
    tp.add_argument("--comm-sms", default=None, help="comma list (default 4,8,12,16,20,24)")
    tp.add_argument("--minibatch", default=None, help="comma list (default: 1x, 2x, 4x the two-wave minimum)")
    tp.add_argument("--ring-slots", default=None, help="comma list (default 2,3,4)")
    tp.add_argument("--iters", type=int, default=5)
    tp.set_defaults(fn=_tune)
    args = parser.parse_args(argv)
    if args.cmd in ("layer", "tune"):
        _check_args(args)
    args.fn(args)


if __name__ == "__main__":
    main()
