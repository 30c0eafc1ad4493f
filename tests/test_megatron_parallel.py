"""CPU, gloo, 2 processes: a ``mok`` layer under tensor parallelism 2 with sequence parallelism (expert-tensor
parallelism 1, the expert-parallel group folded over the TP ranks: EP 2) equals Megatron's ``alltoall`` layer --
output, input gradient and every parameter gradient."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_mok.testing import build_moe_layer, free_port, moe_transformer_config

TOL = dict(rtol=1e-5, atol=1e-6)


def _tp2_sp(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        parallel_state.initialize_model_parallel(2, 1, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
        import megatron_cpu_shim

        megatron_cpu_shim.install()
        over = dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1)
        torch.manual_seed(0)
        base = build_moe_layer(moe_transformer_config(ep_size=2, dispatcher="alltoall", **over))
        mok = build_moe_layer(moe_transformer_config(ep_size=2, dispatcher="mok", **over))
        assert type(mok).__name__ == "MokMoELayer"
        mok.load_state_dict(base.state_dict())
        torch.manual_seed(100 + rank)
        x = torch.randn(6, 2, 64)  # this rank's sequence shard
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_a, _ = base(xa)
        out_b, _ = mok(xb)
        torch.testing.assert_close(out_b, out_a, **TOL)
        grad = torch.randn_like(out_a)
        out_a.backward(grad)
        out_b.backward(grad)
        torch.testing.assert_close(xb.grad, xa.grad, **TOL)
        got = dict(mok.named_parameters())
        for name, p in base.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(got[name].grad, p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_and_sequence_parallel_equal_alltoall():
    import torch.multiprocessing as mp

    mp.spawn(_tp2_sp, args=(2, free_port()), nprocs=2, join=True)
