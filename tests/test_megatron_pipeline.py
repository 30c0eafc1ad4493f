"""CPU, gloo, pipeline parallelism 2: Megatron's own 1F1B schedule (``get_forward_backward_func``, several
microbatches) over a small GPTModel with a MoE in every layer gives the same per-microbatch losses, the same
load-balancing losses and every parameter's gradient on each stage through ``mok`` layers as through
Megatron's ``alltoall`` layers (same weights, same data).

Two process layouts: PP 2 alone (one rank per stage, EP 1), and PP 2 x EP 2 on four processes, where each
stage's expert-parallel group folds over its data-parallel ranks and MoK's collectives run between the
stages' point-to-point exchanges.

Megatron-Core 0.19's pipeline point-to-point code runs over gloo once ``install_cpu_alltoall_shim`` has
mapped ``torch.cuda.current_device()`` (where it allocates its receive buffers) to the CPU and made
``torch.cuda.synchronize()`` a no-op. One CUDA dependency is left: the schedule allocates its token counter
with a literal ``device="cuda"``. :class:`_CudaFactoriesOnCpu` (a ``TorchFunctionMode`` active only around
the schedule call) places such tensors on the CPU instead; nothing else in the schedule is changed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_mok.testing import assert_grad_close, free_port, gpt_moe_layer_spec, moe_transformer_config

TOL = dict(rtol=1e-5, atol=1e-6)
LAYERS, VOCAB, SEQ, MICRO_BATCH, MICROBATCHES = 4, 128, 16, 2, 4


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Tensor factories asked for ``device="cuda"`` allocate on the CPU (a CPU-only torch has no CUDA)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _stage_model(dispatcher: str, ep: int) -> torch.nn.Module:
    """This pipeline stage's part of a GPTModel (local spec, a MoE in every layer, untied output layer)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = moe_transformer_config(
        ep_size=ep,
        dispatcher=dispatcher,
        num_layers=LAYERS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
    )
    spec = gpt_moe_layer_spec(config.num_moe_experts)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )


def _microbatches(dp_rank: int) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's microbatches; both stages of a pipeline draw the same ones."""
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    tokens = torch.randint(0, VOCAB, (MICROBATCHES, MICRO_BATCH, SEQ + 1), generator=gen)
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    return [dict(tokens=t[:, :-1], labels=t[:, 1:], positions=positions, causal=causal) for t in tokens]


def _loss(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's three-value loss convention: summed token loss, token count, and what to report."""
    total = output.float().sum()
    tokens = torch.tensor(output.numel(), dtype=torch.int)
    return total, tokens, {"lm loss": total.detach() / tokens}


def _forward_step(data: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
    batch = next(data)
    output = model(batch["tokens"], batch["positions"], attention_mask=batch["causal"], labels=batch["labels"])
    return output, _loss


def _run(dispatcher: str, ep: int, state: dict[str, torch.Tensor] | None) -> tuple[torch.nn.Module, list, dict]:
    """One 1F1B pass over the microbatches: the stage model, the last stage's reported losses and the
    load-balancing losses Megatron's MoE tracker recorded on this stage."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    torch.manual_seed(1234)
    model = _stage_model(dispatcher, ep)
    if state is not None:
        model.load_state_dict(state)
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    schedule = get_forward_backward_func()
    assert schedule is schedules.forward_backward_pipelining_without_interleaving  # 1F1B, not a fallback
    with _CudaFactoriesOnCpu():
        reported = schedule(
            forward_step_func=_forward_step,
            data_iterator=iter(_microbatches(parallel_state.get_data_parallel_rank())),
            model=[model],
            num_microbatches=MICROBATCHES,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
        )
    aux = {name: entry.values.clone() for name, entry in tracker.metrics.items()}
    tracker.clear()
    return model, reported, aux


def _compare(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ep = world_size // 2
    try:
        parallel_state.initialize_model_parallel(1, 2, expert_model_parallel_size=ep)
        import megatron_cpu_shim

        megatron_cpu_shim.install()
        import megatron_mok

        megatron_mok.register()
        stage = parallel_state.get_pipeline_model_parallel_rank()
        where = f"rank {rank} (stage {stage})"
        base, base_losses, base_aux = _run("alltoall", ep, None)
        mok, mok_losses, mok_aux = _run("mok", ep, base.state_dict())
        layers = [m for m in mok.modules() if type(m).__name__ == "MokMoELayer"]
        assert len(layers) == LAYERS // 2, f"{where}: {len(layers)} MoK layers"
        if parallel_state.is_pipeline_last_stage():
            assert len(base_losses) == len(mok_losses) == MICROBATCHES
            for i, (a, b) in enumerate(zip(base_losses, mok_losses)):
                torch.testing.assert_close(
                    b["lm loss"], a["lm loss"], **TOL, msg=lambda m, i=i: f"{where}: microbatch {i} loss {m}"
                )
        else:
            assert base_losses == mok_losses == []
        assert base_aux.keys() == mok_aux.keys() == {"load_balancing_loss"}, f"{where}: {base_aux.keys()}"
        for name, want in base_aux.items():
            # one entry per layer of the whole model, recorded by this stage's layers only
            assert int(want.count_nonzero()) == LAYERS // 2, f"{where}: {name} {want}"
            torch.testing.assert_close(mok_aux[name], want, **TOL, msg=lambda m, n=name: f"{where}: {n} {m}")
        got = dict(mok.named_parameters())
        assert got.keys() == dict(base.named_parameters()).keys()
        for name, p in base.named_parameters():
            assert p.grad is not None, f"{where}: {name} has no gradient under alltoall"
            q = got[name].grad
            assert q is not None, f"{where}: {name} has no gradient under mok"
            assert_grad_close(q, p.grad, f"{where}: {name} grad")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2], ids=["pp2", "pp2_ep2"])
def test_pipeline_1f1b_equals_alltoall(ep: int) -> None:
    import torch.multiprocessing as mp

    world_size = 2 * ep
    mp.spawn(_compare, args=(world_size, free_port()), nprocs=world_size, join=True)
