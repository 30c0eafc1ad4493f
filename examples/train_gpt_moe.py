"""Train a small Megatron-Core GPT-MoE with ``mok`` and with Megatron's ``alltoall`` from one seed.

Megatron-Core's own GPTModel (local spec, MoE in every layer), optimizer-free plain Adam on
synthetic next-token data; prints both loss curves and their largest gap.

    python examples/train_gpt_moe.py --ep 2 --steps 50          # CPU (gloo) or GPU (NCCL)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if TYPE_CHECKING:
    from megatron_mok.config import MokConfig

CLIP_GRAD = 1.0  # Megatron's default --clip-grad


def build_model(
    dispatcher: str, ep: int, args: argparse.Namespace, device: torch.device, mok_config: MokConfig | None = None
) -> torch.nn.Module:
    """Megatron-Core's GPTModel (local spec, a MoE in every layer) from ``args``' shapes, seeded with ``args.seed``
    so every dispatcher starts from the same weights; ``mok_config`` sets the MoK kernel settings
    (None: the dispatcher picks them for the model's shapes)."""
    from megatron.core.models.gpt import GPTModel

    from megatron_mok.testing import gpt_moe_layer_spec, moe_transformer_config

    cfg = moe_transformer_config(
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_experts=args.experts,
        topk=args.topk,
        ep_size=ep,
        dispatcher=dispatcher,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        dtype=args.torch_dtype,
    )
    if mok_config is not None:
        cfg.mok_config = mok_config
    spec = gpt_moe_layer_spec(args.experts)
    torch.manual_seed(args.seed)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
        position_embedding_type="rope",
    )
    if args.torch_dtype == torch.bfloat16:
        # as Megatron's Float16Module: every parameter in bf16 (the norms are built in fp32; CUDA's
        # layer_norm, unlike the CPU one, rejects bf16 activations with fp32 weights)
        model = model.bfloat16()
    return model.to(device)


def synthetic_batch(
    gen: torch.Generator, args: argparse.Namespace, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next micro-batch of synthetic data from ``gen``: inputs and labels, [batch, seq] each.

    The label of a token is a fixed function of the token (an affine map modulo the vocabulary), replaced by a random
    token one time in ten: every batch teaches the same task, so the loss moves only as the model learns the map (a
    small vocabulary within a few dozen steps), with no jumps from batch to batch. Drawn on the host from ``gen``, so
    every dispatcher (and every device) sees the same data."""
    inputs = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    labels = (inputs * 31 + 7) % args.vocab
    noise = torch.rand(args.batch, args.seq, generator=gen) < 0.1
    labels = torch.where(noise, torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen), labels)
    return inputs.to(device), labels.to(device)


def attention_inputs(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [batch, seq] and the causal attention mask [1, 1, seq, seq] (True: masked out)."""
    pos = torch.arange(args.seq, device=device).unsqueeze(0).expand(args.batch, -1)
    causal = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool, device=device), 1)[None, None]
    return pos, causal


def is_expert_param(name: str) -> bool:
    """An expert weight: one rank's own (EP), not averaged over the ranks."""
    return "experts" in name


def clip_grad_norm(model: torch.nn.Module, ws: int) -> None:
    """Scale the gradients down to a global norm of at most CLIP_GRAD, as Megatron's optimizer does by default:
    without it Adam's first steps on a freshly initialised wide model blow up. The norm is the whole model's over
    the EP ranks (the shared parameters' gradients are already averaged, so they count once), so every rank scales
    by the same factor and the shared parameters stay equal."""
    grads = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    if not grads:
        return
    expert = [g for name, g in grads if is_expert_param(name)]
    shared = [g for name, g in grads if not is_expert_param(name)]
    zero = grads[0][1].new_zeros((), dtype=torch.float32)
    expert_sq = sum((g.float().square().sum() for g in expert), zero)
    if ws > 1:
        torch.distributed.all_reduce(expert_sq)
    total = (expert_sq + sum((g.float().square().sum() for g in shared), zero)).sqrt()
    # no host read of the norm: clamp the factor on the device
    scale = (CLIP_GRAD / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_([g for _, g in grads], scale)


def train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    inp: torch.Tensor,
    labels: torch.Tensor,
    pos: torch.Tensor,
    causal: torch.Tensor,
    ws: int,
) -> torch.Tensor:
    """One training iteration (forward, loss, backward, gradient clipping, optimizer step); returns the loss, still
    on the device, so a caller that times the step decides when to synchronise."""
    loss = model(inp, pos, attention_mask=causal, labels=labels).float().mean()
    opt.zero_grad()
    loss.backward()
    # expert-parallel DP: non-expert grads are averaged over the EP ranks (same as Megatron DDP)
    if ws > 1:
        for name, p in model.named_parameters():
            if p.grad is not None and not is_expert_param(name):
                torch.distributed.all_reduce(p.grad)
                p.grad /= ws
    clip_grad_norm(model, ws)
    opt.step()
    return loss.detach()


def train(rank: int, ws: int, args) -> None:
    import megatron_mok
    from megatron_mok.testing import install_cpu_alltoall_shim

    warnings.filterwarnings("ignore")
    megatron_mok.register()
    install_cpu_alltoall_shim()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    curves, backends = {}, {}
    for dispatcher in ("alltoall", "mok"):
        model = build_model(dispatcher, ws, args, device)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        gen = torch.Generator().manual_seed(args.seed + 17 * rank)  # same data for both runs
        pos, causal = attention_inputs(args, device)
        losses = []
        for _ in range(args.steps):
            inp, labels = synthetic_batch(gen, args, device)
            losses.append(float(train_step(model, opt, inp, labels, pos, causal, ws)))
        curves[dispatcher] = losses
        param_dtypes = sorted({str(p.dtype) for p in model.parameters()})
        if dispatcher == "mok":
            backends = sorted(
                {m.token_dispatcher.last_backend for m in model.modules() if hasattr(m, "token_dispatcher")}
            )
    gap = max(abs(a - b) for a, b in zip(curves["alltoall"], curves["mok"]))
    if rank == 0:
        print(loss_table(curves, backends, gap), flush=True)
        if args.plot:
            print(plot_curves(curves, args.plot), flush=True)
    if args.out:
        with open(f"{args.out}.{rank}", "w") as f:
            json.dump({**curves, "max_gap": gap, "mok_backend": backends, "param_dtypes": param_dtypes}, f)


def loss_table(curves: dict[str, list[float]], backends: list, gap: float | None, rows: int = 10) -> str:
    """The loss curves side by side (every n-th step, the last one always), and their largest gap (None: not
    shown, as for a single curve); the columns follow ``curves``' order."""
    names = list(curves)
    n = len(curves[names[0]])
    steps = sorted({*range(0, n, max(1, n // rows)), n - 1})
    backend_note = f"   (mok backend: {', '.join(map(str, backends))})" if "mok" in curves else ""
    lines = [f"{'step':>6}" + "".join(f" {name:>12}" for name in names) + backend_note]
    lines += [f"{i:>6}" + "".join(f" {curves[name][i]:>12.6f}" for name in names) for i in steps]
    if gap is not None:
        lines.append(f"largest gap between the curves over {n} steps: {gap:.3e}")
    return "\n".join(lines)


def plot_curves(curves: dict[str, list[float]], path: str) -> str:
    """The loss curves as a PNG (needs matplotlib: pip install 'megatron-mok[plot]'); returns the line to print."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no plot: matplotlib is not installed (pip install 'megatron-mok[plot]'); {path} not written"
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, (name, losses) in enumerate(curves.items()):
        ax.plot(losses, label=name, linestyle="-" if i == 0 else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"loss curves: {path}"


MODEL_SIZES = ("layers", "hidden", "ffn", "experts", "topk", "heads", "vocab", "seq", "batch")


def check_model_args(args, fail) -> None:
    """The model's options (sizes, top-k, heads, learning rate), shared with benchmarks/train_throughput.py: the first
    bad one through ``fail`` as one line."""
    for name in MODEL_SIZES:
        if getattr(args, name) < 1:
            fail(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.topk > args.experts:
        fail(f"--topk {args.topk} exceeds --experts {args.experts}")
    if args.hidden % args.heads:
        fail(f"--heads {args.heads} does not divide --hidden {args.hidden}")
    if not args.lr > 0:
        fail(f"--lr must be > 0, got {args.lr}")


def _fail(msg: str) -> None:
    """One line naming the problem, exit status 2, before any process starts."""
    print(f"train_gpt_moe.py: {msg}", file=sys.stderr)
    raise SystemExit(2)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=32)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--heads", type=int, default=4, help="attention heads (must divide --hidden)")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="write full loss curves to OUT.<rank> (json)")
    p.add_argument("--plot", default=None, help="save both loss curves as this PNG (needs matplotlib)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16 on a GPU runs the MoK kernel")
    args = p.parse_args(argv)
    for name in ("ep", "steps"):
        if getattr(args, name) < 1:
            _fail(f"--{name} must be >= 1, got {getattr(args, name)}")
    check_model_args(args, _fail)
    if args.experts % args.ep:
        _fail(f"--ep {args.ep} does not divide --experts {args.experts}")
    args.torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    from megatron_mok.testing import spawn

    spawn(train, args.ep, args, backend="nccl" if torch.cuda.is_available() else "gloo")


if __name__ == "__main__":
    main()
