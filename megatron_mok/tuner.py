"""``mok tune``: search the SM split, minibatch size and ring slots for a config on this GPU.

The search times the fused forward kernel on a per-GPU slice of the model: ``num_experts / ep``
local experts, ``tokens`` tokens of top-k routing spread evenly over them (what a balanced EP rank
receives). Every candidate is checked against the two-GEMM-waves rule and the config validation;
the fastest one is written as a YAML with the original model section. The config's ``kernel.dtype``
picks the kernel that is timed (``fp8``: the FP8 forward kernel, weights quantised once beforehand).
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import torch
import yaml

from .config import MokConfig, load_config, min_minibatch_tokens, parse_config
from .timing import cuda_times_ms


def candidate_grid(cfg: MokConfig, comm_sms: list[int] | None, minibatches: list[int] | None, slots: list[int] | None):
    k = cfg.kernel
    # 0: the in-SM pull (no comm SM); a candidate only where the backward has its own comm SMs set
    comm = comm_sms or ([0] if k.backward_comm_sms else []) + [4, 8, 12, 16, 20, 24]
    ring = slots or [2, 3, 4]
    for c in comm:
        base = min_minibatch_tokens(
            cfg.model.moe_ffn_hidden_size, k.num_sms - c, k.gemm_tile_m, k.gemm_tile_n, k.minibatch_align
        )
        mbs = minibatches or sorted({base, 2 * base, 4 * base})
        for mb, s in itertools.product(mbs, ring):
            yield c, mb, s


def tune(
    config: str,
    *,
    ep: int,
    tokens: int,
    out: str | Path | None = None,
    comm_sms: list[int] | None = None,
    minibatches: list[int] | None = None,
    slots: list[int] | None = None,
    iters: int = 5,
    warmup: int = 2,
    log: Any = print,
) -> tuple[MokConfig, list[dict]]:
    from . import kernel

    cfg = load_config(config)
    if cfg.kernel.dtype not in ("bf16", "fp8"):
        raise ValueError(f"mok tune: kernel.dtype {cfg.kernel.dtype!r} has no kernel on this GPU (bf16, fp8)")
    if not kernel.is_available():
        raise RuntimeError(f"mok tune needs a GPU that runs the MoK kernel: {kernel.unavailable_reason()}")
    m = cfg.model
    if m.num_moe_experts % ep:
        raise ValueError(f"--ep {ep} does not divide num_moe_experts={m.num_moe_experts}")
    L, H, F, K = m.num_moe_experts // ep, m.hidden_size, m.moe_ffn_hidden_size, m.moe_router_topk
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(tokens, H, generator=g).to(dev, torch.bfloat16)
    idx = torch.randint(0, L, (tokens, K), generator=g).to(dev, torch.int32)  # balanced over local experts
    w = torch.rand(tokens, K, generator=g).to(dev)
    w1 = [(torch.randn(2 * F, H, generator=g) / H**0.5).to(dev, torch.bfloat16) for _ in range(L)]
    w2 = [(torch.randn(H, F, generator=g) / F**0.5).to(dev, torch.bfloat16) for _ in range(L)]
    extra = {}
    if cfg.kernel.dtype == "fp8":
        from .kernel.quant import quantize_expert_weights

        extra["fp8"] = quantize_expert_weights([w1], [w2])
    bufs = kernel.PeerBuffers.local(dev)
    flops = 2 * tokens * K * H * 3 * F
    rows = []
    log(
        f"tuning {m.name} ({cfg.kernel.dtype}): {L} local experts (EP {ep}), {tokens} tokens x top-{K} = "
        f"{tokens * K} rows, H {H}, F {F}"
    )
    for c, mb, s in candidate_grid(cfg, comm_sms, minibatches, slots):
        try:
            cfg.replace_kernel(comm_sms=c, minibatch_tokens=mb, ring_slots=s)
        except ValueError as exc:
            log(f"  skip comm {c} mb {mb} slots {s}: {exc}")
            continue

        def run(c=c, mb=mb, s=s):
            kernel.mok_forward(
                bufs, x, idx, w, w1, w2, comm_sms=c, ring_slots=s, minibatch_tokens=mb, check=False, **extra
            )

        try:
            run()
            kernel.check_last_error()
            ms = cuda_times_ms(run, iters, warmup)[0]
        except Exception as exc:  # noqa: BLE001 - a candidate the kernel rejects is skipped, not fatal
            log(f"  skip comm {c} mb {mb} slots {s}: {exc}")
            continue
        rows.append({"comm_sms": c, "minibatch_tokens": mb, "ring_slots": s, "ms": ms, "tflops": flops / ms / 1e9})
        log(f"  comm {c:3d}  minibatch {mb:6d}  slots {s}:  {ms:8.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s")
    if not rows:
        raise RuntimeError("no candidate ran")
    best = min(rows, key=lambda r: r["ms"])
    tuned = cfg.replace_kernel(
        comm_sms=best["comm_sms"], minibatch_tokens=best["minibatch_tokens"], ring_slots=best["ring_slots"]
    )
    log(
        f"best: comm_sms {best['comm_sms']}, minibatch {best['minibatch_tokens']}, slots {best['ring_slots']}: "
        f"{best['ms']:.3f} ms ({best['tflops']:.1f} TFLOP/s)"
    )
    if out is not None:
        raw = {"model": dataclasses.asdict(tuned.model), "kernel": dataclasses.asdict(tuned.kernel)}
        header = (
            f"# Tuned by `mok tune` on {torch.cuda.get_device_name()} for {m.name}: EP {ep}, {tokens} tokens/GPU.\n"
            f"# Best forward {best['ms']:.3f} ms ({best['tflops']:.1f} TFLOP/s) of {len(rows)} candidates.\n"
        )
        Path(out).write_text(header + yaml.safe_dump(raw, sort_keys=False))
        parse_config(yaml.safe_load(Path(out).read_text()), str(out))  # what we wrote loads back
        log(f"wrote {out}")
    return tuned, rows
