"""GPU, >= 2 GPUs (skipped otherwise): the Megatron MoE layer with ``mok`` over real EP (one process per
GPU, torch symmetric memory, the forward and backward kernels launched per rank) equals Megatron's
alltoall layer: outputs, input gradients and every parameter gradient."""

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
        grads = {n: p.grad.float().clone() for n, p in layer.named_parameters() if p.grad is not None}
        res[name] = (out.float(), xi.grad.float(), grads)
    errs = [float((res["mok"][i] - res["alltoall"][i]).norm() / res["alltoall"][i].norm()) for i in range(2)]
    gb, gm = res["alltoall"][2], res["mok"][2]
    assert set(gb) == set(gm), (sorted(gb), sorted(gm))
    gerr = max(float((gm[n] - gb[n]).norm() / gb[n].norm().clamp_min(1e-6)) for n in gb)
    from megatron_mok.backend import _KERNEL_BACKENDS

    bwd = [str(b.last_backward).replace(" ", "_") for b in _KERNEL_BACKENDS.values()]
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(f"{mok.token_dispatcher.last_backend} {errs[0]} {errs[1]} {gerr} {'|'.join(map(str, bwd))}")


def test_layer_real_ep_equals_alltoall(tmp_path):
    from megatron_mok import kernel
    from megatron_mok.testing import spawn

    if not kernel.is_available():
        pytest.skip(kernel.unavailable_reason())
    world = min(torch.cuda.device_count(), 4)
    spawn(_layer_worker, world, str(tmp_path), backend="nccl")
    for r in range(world):
        backend, e_out, e_grad, e_wgrad, bwd = (tmp_path / f"rank{r}").read_text().split(maxsplit=4)
        assert backend == "kernel", backend
        assert "per-rank_launch" in bwd, f"rank {r}: backward ran {bwd!r}, not the per-rank kernel"
        assert float(e_out) < 1e-2 and float(e_grad) < 2e-2 and float(e_wgrad) < 3e-2, (r, e_out, e_grad, e_wgrad)
