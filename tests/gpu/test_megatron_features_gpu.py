"""GPU, EP 1, bf16: the Megatron feature matrix of tests/test_megatron_features.py through the MoK kernel. Each feature
builds a ``mok`` layer and an ``alltoall`` layer from Megatron's own spec with the same weights; the output, the
input gradient, every parameter gradient and the buffers (expert bias, token counts) agree within bf16 noise (the
two round differently: MoK applies the router probabilities after fc2 in fp32). The features whose experts MoK fuses
run the kernel; the ones it hands to Megatron's experts (GeGLU, ReLU) run those."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from mok_truth import rel_err  # noqa: E402
from test_megatron_features import FEATURES  # noqa: E402

pytestmark = pytest.mark.gpu

H, FFN = 256, 128  # sizes the kernel tiles (multiples of 64)
TOL = 2e-2  # relative Frobenius error, bf16
UNFUSED = {"geglu_unfused", "relu_unfused"}


def _compare(name: str) -> list[str]:
    from megatron_mok.testing import build_moe_layer, moe_transformer_config

    over = dict(FEATURES[name])
    swiglu = over.pop("swiglu", True)
    if "moe_shared_expert_intermediate_size" in over:
        over["moe_shared_expert_intermediate_size"] = FFN
    kw = dict(hidden_size=H, ffn_hidden_size=FFN, num_experts=8, topk=2, dtype=torch.bfloat16, swiglu=swiglu, **over)
    torch.manual_seed(1234)
    base = build_moe_layer(moe_transformer_config(dispatcher="alltoall", **kw)).cuda()
    mok = build_moe_layer(moe_transformer_config(dispatcher="mok", **kw)).cuda()
    mok.load_state_dict(base.state_dict())
    torch.manual_seed(7)
    x = torch.randn(300, 2, H, device="cuda", dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_a, _ = base(xa)
    out_b, _ = mok(xb)
    grad = torch.randn_like(out_a)
    out_a.backward(grad)
    out_b.backward(grad)
    torch.cuda.synchronize()
    bad = []
    # the fused features ran the kernel; the others ran Megatron's experts between MoK's pull and push
    d = mok.token_dispatcher
    ran = d.last_backend if d.fused else "megatron experts"
    want = "megatron experts" if name in UNFUSED else "kernel"
    if ran != want:
        bad.append(f"{name}: ran {ran!r}, expected {want!r}")
    pairs = {"output": (out_b, out_a), "input grad": (xb.grad, xa.grad)}
    pa, pb = dict(base.named_parameters()), dict(mok.named_parameters())
    for pname, p in pa.items():
        if p.grad is not None:
            pairs[f"{pname} grad"] = (pb[pname].grad, p.grad)
    buffers = dict(mok.named_buffers())
    for bname, b in base.named_buffers():
        pairs[bname] = (buffers[bname], b)
    for what, (got, ref) in pairs.items():
        if got is None:
            bad.append(f"{name}: {what}: missing")
        elif not rel_err(got, ref) < TOL:
            bad.append(f"{name}: {what}: rel err {rel_err(got, ref):.3e}")
    return bad


def _worker(rank: int, ws: int) -> None:
    from megatron.core import tensor_parallel

    import megatron_mok

    megatron_mok.register()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    bad = [line for name in FEATURES for line in _compare(name)]
    assert not bad, "features that differ from alltoall on the GPU:\n" + "\n".join(bad)


def test_features_through_the_kernel_equal_megatron_alltoall(kernel):
    from megatron_mok.testing import spawn

    spawn(_worker, 1, backend="nccl")
