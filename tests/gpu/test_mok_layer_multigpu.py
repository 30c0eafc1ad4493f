"""GPU, >= 2 GPUs (skipped otherwise): the Megatron MoE layer with ``mok`` over real EP (one process per
GPU, torch symmetric memory, the forward kernel launched per rank) equals Megatron's alltoall layer."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 GPUs (real EP)"),
]


def _layer_worker(rank: int, world: int, out_dir: str) -> None:
    from megatron_mok.config import parse_config
    from megatron_mok.testing import build_moe_layer, moe_transformer_config

    os.environ["MOK_BACKEND"] = "kernel"
    H, F, E, K = 1024, 512, 4 * world, 2
    kw = dict(hidden_size=H, ffn_hidden_size=F, num_experts=E, topk=K, ep_size=world, dtype=torch.bfloat16)
    torch.manual_seed(0)
    base = build_moe_layer(moe_transformer_config(dispatcher="alltoall", **kw)).cuda()
    tc = moe_transformer_config(dispatcher="mok", **kw)
    tc.mok_config = parse_config(
        {
            "model": {
                "name": "g",
                "hidden_size": H,
                "moe_ffn_hidden_size": F,
                "num_moe_experts": E,
                "moe_router_topk": K,
            },
            "kernel": {"comm_sms": 8, "ring_slots": 3, "minibatch_tokens": 256},
        },
        "multigpu-test",
    )
    mok = build_moe_layer(tc).cuda()
    mok.load_state_dict(base.state_dict())
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    x = torch.randn(512, 2, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    res = {}
    for name, layer in (("alltoall", base), ("mok", mok)):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        for _ in range(2):  # two calls: the symmetric buffers and epochs are reused
            out, _ = layer(xi)
        out.float().sum().backward()
        res[name] = (out.float(), xi.grad.float())
    errs = [float((res["mok"][i] - res["alltoall"][i]).norm() / res["alltoall"][i].norm()) for i in range(2)]
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(f"{mok.token_dispatcher.last_backend} {errs[0]} {errs[1]}")


def test_layer_real_ep_equals_alltoall(tmp_path):
    from megatron_mok import kernel
    from megatron_mok.testing import spawn

    if not kernel.is_available():
        pytest.skip(kernel.unavailable_reason())
    world = min(torch.cuda.device_count(), 4)
    spawn(_layer_worker, world, str(tmp_path), backend="nccl")
    for r in range(world):
        backend, e_out, e_grad = (tmp_path / f"rank{r}").read_text().split()
        assert backend == "kernel", backend
        assert float(e_out) < 1e-2 and float(e_grad) < 2e-2, (r, e_out, e_grad)
