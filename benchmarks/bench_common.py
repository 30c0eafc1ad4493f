"""Helpers shared by the benchmarks: CUDA-event timing (megatron_mok.timing, also the tuner's), medians and ratios of
interleaved rounds, the synthetic MoE inputs, and the Megatron-Core baseline (alltoall dispatcher + SequentialMLP at
EP = 1)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_mok.timing import cuda_pipelined_ms as pipelined  # noqa: E402,F401  (re-exported to the benches)
from megatron_mok.timing import cuda_times_ms as timeit  # noqa: E402,F401

PEAK = 760.0  # TFLOP/s: dense bf16 GEMM measured on the H200, the reference for "fraction of peak"


def med(v: list[float]) -> float:
    """The median of a few rounds' values (the upper one of an even count)."""
    return sorted(v)[len(v) // 2]


def median_range(v: list[float]) -> tuple[float, float, float]:
    """Median, min and max of a few rounds' values."""
    return med(v), min(v), max(v)


def round_ratios(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """Median, min and max over interleaved rounds of num[i] / den[i] (times of the same round)."""
    return median_range([a / b for a, b in zip(num, den)])


def make_inputs(H: int, F: int, K: int, L: int, T: int, seed: int = 0, grad: bool = False):
    """x [T, H], top-k indices [T, K] int32 (distinct experts), weights [T, K] fp32 (softmax of the chosen
    scores), w1 [L, 2F, H] / w2 [L, H, F] bf16 (scaled), and with grad=True an output gradient [T, H]."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    x = torch.randn((T, H), generator=g, device=dev).bfloat16()
    scores = torch.rand((T, L), generator=g, device=dev)
    idx = torch.topk(scores, K, dim=1).indices.to(torch.int32).contiguous()  # uniform-ish, distinct experts
    w = torch.softmax(torch.gather(scores, 1, idx.long()), dim=1).float().contiguous()
    w1 = (torch.randn((L, 2 * F, H), generator=g, device=dev) / H**0.5).bfloat16()
    w2 = (torch.randn((L, H, F), generator=g, device=dev) / F**0.5).bfloat16()
    if not grad:
        return x, idx, w, w1, w2
    go = torch.randn((T, H), generator=g, device=dev).bfloat16()
    return x, idx, w, w1, w2, go


def mcore_setup(H: int, F: int, K: int, L: int, port: str = "29533"):
    """Megatron-Core SequentialMLP (L experts, SwiGLU, bf16) and MoEAlltoAllTokenDispatcher at EP = 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", port)
        dist.init_process_group("nccl", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=8,
        ffn_hidden_size=F,
        moe_ffn_hidden_size=F,
        num_moe_experts=L,
        moe_router_topk=K,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        bf16=True,
        params_dtype=torch.bfloat16,
        add_bias_linear=False,
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=False,
        perform_initialization=False,
    )
    pgc = get_default_pg_collection()
    experts = SequentialMLP(
        L, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear), pg_collection=pgc
    )
    experts = experts.cuda().bfloat16()
    disp = MoEAlltoAllTokenDispatcher(
        num_local_experts=L, local_expert_indices=list(range(L)), config=cfg, pg_collection=pgc
    )
    return experts, disp


def mcore_layer(H: int, F: int, K: int, L: int, w1, w2, idx, w, port: str = "29533"):
    """Megatron's SequentialMLP + alltoall dispatcher at EP = 1 carrying MoK's expert weights (w1, w2), and
    MoK's top-k routing (idx, w) as Megatron's dense routing map and probabilities: the same layer, Megatron's
    way. Returns (experts, dispatcher, routing_map, probs)."""
    experts, disp = mcore_setup(H, F, K, L, port)
    with torch.no_grad():
        for e in range(L):
            experts.local_experts[e].linear_fc1.weight.copy_(w1[e])
            experts.local_experts[e].linear_fc2.weight.copy_(w2[e])
    T = idx.shape[0]
    routing_map = torch.zeros((T, L), dtype=torch.bool, device="cuda")
    routing_map.scatter_(1, idx.long(), True)
    probs = torch.zeros((T, L), dtype=torch.float32, device="cuda")
    probs.scatter_(1, idx.long(), w)
    return experts, disp, routing_map, probs


def mcore_forward(experts, disp, x, routing_map, probs):
    hs, pp = disp.dispatch_preprocess(x, routing_map, probs)
    hs, pp = disp.token_dispatch(hs, pp)
    hs, tpe, pp = disp.dispatch_postprocess(hs, pp)
    out, _ = experts(hs, tpe, pp)
    out = disp.combine_preprocess(out)
    out = disp.token_combine(out)
    return disp.combine_postprocess(out)


class GpuSampler:
    """SM clock (MHz) and board power (W) from ``nvidia-smi -lms`` in the background, so a benchmark can
    say whether two timings ran at the same clocks: under the H200's power limit a ratio of two kernels
    is also a ratio of their clocks. ``window(t0, t1)`` averages the samples taken between two
    ``time.monotonic()`` stamps; None without nvidia-smi."""

    def __init__(self, period_ms: int = 20, device: int = 0) -> None:
        self.samples: list[tuple[float, float, float]] = []
        cmd = ["nvidia-smi", "-i", str(device), "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]
        try:
            self._proc = subprocess.Popen([*cmd, f"-lms={period_ms}"], stdout=subprocess.PIPE, text=True)
        except OSError:
            self._proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                clk, pw = (float(v) for v in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.monotonic(), clk, pw))

    def window(self, t0: float, t1: float) -> tuple[float, float] | None:
        got = [(c, w) for t, c, w in list(self.samples) if t0 <= t <= t1]
        if not got:
            return None
        return sum(c for c, _ in got) / len(got), sum(w for _, w in got) / len(got)

    def close(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
