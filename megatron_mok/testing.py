"""Helpers to build small Megatron MoE layers with MoK (tests, examples, benchmarks).

``install_cpu_alltoall_shim`` lets Megatron-Core's own ``alltoall`` dispatcher run on a CPU-only
machine (its CUDA side-stream calls become no-ops) so it can serve as the oracle there; it changes
nothing when CUDA is present and is only for test / example processes.

Megatron-Core's stock ``TopKRouter.gating`` moves its weight to CUDA unconditionally; the
:class:`PortableTopKRouter` here computes the same logits wherever the weight lives, so a whole
MoE layer runs on CPU (gloo) as well as on GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _router_base():
    from megatron.core.transformer.moe.router import TopKRouter

    return TopKRouter


def make_portable_router() -> type:
    TopKRouter = _router_base()
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    class PortableTopKRouter(TopKRouter):
        """TopKRouter whose gating runs on the weight's own device (CPU or GPU)."""

        def gating(self, input: torch.Tensor) -> torch.Tensor:
            if self.weight.device != input.device:
                self.weight.data = self.weight.data.to(input.device)
            dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
            return router_gating_linear(input, self.weight, self.bias, dtype)

    return PortableTopKRouter


def make_fixed_router(route: Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]) -> type:
    """A router whose routing comes from ``route(tokens [T, H], num_experts, topk) -> (probs, map)``.

    Used to force routings (skewed, empty experts, all tokens to one expert) on both the
    dispatcher under test and the baseline. Probs stay differentiable through ``tokens``.
    """
    Base = make_portable_router()

    class FixedRouter(Base):  # type: ignore[misc, valid-type]
        def forward(self, input: torch.Tensor, padding_mask: torch.Tensor | None = None):
            flat = input.reshape(-1, input.shape[-1])
            return route(flat, self.config.num_moe_experts, self.config.moe_router_topk)

    return FixedRouter


def moe_transformer_config(
    *,
    hidden_size: int = 64,
    ffn_hidden_size: int = 32,
    num_experts: int = 8,
    topk: int = 2,
    ep_size: int = 1,
    dispatcher: str = "mok",
    dtype: torch.dtype = torch.float32,
    swiglu: bool = True,
    **overrides: Any,
):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=1,
        hidden_size=hidden_size,
        num_attention_heads=4,
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=ffn_hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        moe_router_dtype="fp32",
        use_cpu_initialization=True,
        add_bias_linear=False,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=ep_size,
        moe_router_load_balancing_type="none",
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_moe_layer(config: Any, router: type | None = None, grouped_gemm: bool = False) -> torch.nn.Module:
    """A Megatron ``MoELayer`` from the local (no-TE) spec; ``mok`` configs give a MokMoELayer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from . import register

    register()
    spec = get_gpt_layer_local_submodules(num_experts=config.num_moe_experts, moe_grouped_gemm=grouped_gemm).mlp
    submodules = spec.keywords["submodules"] if hasattr(spec, "keywords") else spec
    submodules = dataclasses.replace(submodules, router=router or make_portable_router())
    return MoELayer(config, submodules)


def init_one_rank(backend: str = "nccl") -> tuple[bool, bool]:
    """This process as the only rank of a process group (on an address of its own: a MASTER_PORT in the environment
    may belong to another job; with NCCL on GPU 0) and Megatron's parallel state (TP = PP = EP = 1), each unless it
    exists already. Returns which of the two were made here (for a caller that tears down what it made)."""
    from megatron.core import parallel_state

    made_group = not dist.is_initialized()
    if made_group:
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    made_state = not parallel_state.model_parallel_is_initialized()
    if made_state:
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    return made_group, made_state


def gpt_moe_layer_spec(num_experts: int) -> Any:
    """Megatron's local (no-TE) GPT layer spec with a MoE of SequentialMLP experts, its router the portable one (a GPT
    model that runs on CPU over gloo as well as on a GPU)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    mlp = spec.submodules.mlp
    moe = dataclasses.replace(mlp.keywords["submodules"], router=make_portable_router())
    spec.submodules.mlp = type(mlp)(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": moe})
    return spec


def assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = 1e-5) -> None:
    """Gradients through a whole model: elementwise, the absolute tolerance relative to the gradient's largest entry.
    fp32 sums taken in another order (MoK's top-k sum against Megatron's unpermute) differ by up to ~1e-6 of that
    entry, also where contributions cancel, so a relative tolerance alone fails on noise there; a fixed absolute one
    would let whole gradients of ~1e-6 (a mean loss over a few tokens) pass unchecked."""
    atol = rtol * float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what} {m}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, backend: str) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    if backend == "nccl":  # one GPU per rank (NCCL refuses two ranks on one device)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world_size)
        fn(rank, world_size, *args)
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        finally:
            dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args: Any, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes with Megatron's
    parallel state initialised (TP=PP=1, EP=world_size). ``fn`` must be importable (top level)."""
    import torch.multiprocessing as mp

    mp.spawn(_spawn_entry, args=(world_size, free_port(), fn, args, backend), nprocs=world_size, join=True)


# ---- Megatron alltoall on CPU -------------------------------------------------------------


class _NoStream:
    def wait_stream(self, _s) -> None:
        pass

    def record_event(self):
        return _NoEvent()

    def synchronize(self) -> None:
        pass

    def __eq__(self, other) -> bool:
        return isinstance(other, _NoStream)

    def __hash__(self) -> int:
        return 0


class _NoEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, *_a) -> None:
        pass


def install_cpu_alltoall_shim() -> None:
    """Let Megatron's ``alltoall`` dispatcher run on CPU/gloo (see the class docs above); no-op with CUDA."""
    if torch.cuda.is_available() or getattr(torch.cuda, "_mok_cpu_shim", False):
        return
    stream = _NoStream()
    torch.cuda.Stream = lambda *a, **k: stream  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: stream  # type: ignore[assignment]
    torch.cuda.stream = lambda _s: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]  # Megatron's checkpoint writer waits
    original = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        as_list = lambda s: s.tolist() if hasattr(s, "tolist") else s  # noqa: E731
        return original(
            output, input, as_list(output_split_sizes), as_list(input_split_sizes), group=group, async_op=async_op
        )

    dist.all_to_all_single = all_to_all_single
    # attention dropout forks Megatron's CUDA RNG tracker; there is no CUDA RNG on CPU
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]
    torch.cuda._mok_cpu_shim = True  # type: ignore[attr-defined]
