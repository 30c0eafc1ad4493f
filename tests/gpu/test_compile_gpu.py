"""GPU: ``torch.compile(fullgraph=True)`` of a MoK layer on the kernel backend (bf16, EP 1), forward and backward:
no graph break, and the outputs and every gradient equal to eager calls bit for bit (the compiled graph calls the
same operators). tests/test_compile.py checks the tracing on CPU with the operators' fake implementations."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_compiled_layer_equals_eager(kernel):
    import torch._dynamo

    from megatron_mok.function import mok_moe
    from megatron_mok.kernel_backend import KernelBackend
    from megatron_mok.plan import MokPlan, RingSpec
    from megatron_mok.transport import EmulatedTransport, _Exchange

    T, H, F, K, L = 1024, 512, 256, 4, 4
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(7)
    x = torch.randn((T, H), generator=g, device=dev).bfloat16()
    idx = torch.topk(torch.rand((T, L), generator=g, device=dev), K, dim=1).indices.int()
    w = torch.rand((T, K), generator=g, device=dev)
    w1 = [torch.nn.Parameter((torch.randn((2 * F, H), generator=g, device=dev) / H**0.5).bfloat16()) for _ in range(L)]
    w2 = [torch.nn.Parameter((torch.randn((H, F), generator=g, device=dev) / F**0.5).bfloat16()) for _ in range(L)]
    go = torch.randn((T, H), generator=g, device=dev).bfloat16()
    backend = KernelBackend(comm_sms=0, backward_comm_sms=4)
    plan = MokPlan(EmulatedTransport(0, _Exchange(1)), L, RingSpec(256, 2))

    def run(x, w, w1, w2):
        return mok_moe(x, idx, w, w1, w2, plan, backend)

    def step(fn):
        for p in (*w1, *w2):
            p.grad = None
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xi, wi, w1, w2)
        out.backward(go)
        torch.cuda.synchronize()
        return out.detach(), xi.grad, wi.grad, [p.grad.clone() for p in (*w1, *w2)]

    want = step(run)
    torch._dynamo.reset()
    got = step(torch.compile(run, fullgraph=True))
    got_again = step(torch.compile(run, fullgraph=True))  # the compiled graph reused
    kernel.check_last_error()
    for a, b, c in zip(got[:3], want[:3], got_again[:3]):
        assert torch.equal(a, b) and torch.equal(c, b)
    for a, b in zip(got[3], want[3]):
        assert torch.equal(a, b)
