"""CPU: ``torch.compile(fullgraph=True)`` traces a MoK layer on the kernel backend, forward and backward, without a
graph break: the operators' fake implementations stand in for the CUDA ones (meta tensors), AOTAutograd included
(``aot_eager``). The GPU test (tests/gpu/test_compile_gpu.py) runs the compiled layer against eager calls."""

from __future__ import annotations

import pytest
import torch

from megatron_mok.function import mok_moe
from megatron_mok.kernel import ops
from megatron_mok.kernel_backend import KernelBackend
from megatron_mok.plan import MokPlan, RingSpec
from megatron_mok.transport import EmulatedTransport, _Exchange

T, H, F, K, L = 64, 128, 128, 2, 2


@pytest.fixture
def layer(monkeypatch):
    """(inputs, function) of a bf16 MoK layer on meta tensors: its operators run their fake implementations."""
    monkeypatch.setattr(ops, "load", lambda which="sm90": "")  # nothing to build: meta tensors need no library
    meta = torch.device("meta")

    def t(*shape, dtype=torch.bfloat16, grad=True):
        return torch.empty(shape, dtype=dtype, device=meta, requires_grad=grad)

    inputs = (
        t(T, H),
        torch.empty((T, K), dtype=torch.int32, device=meta),
        t(T, K, dtype=torch.float32),
        [t(2 * F, H) for _ in range(L)],
        [t(H, F) for _ in range(L)],
    )
    backend = KernelBackend(comm_sms=0, backward_comm_sms=2, check=False)
    plan = MokPlan(EmulatedTransport(0, _Exchange(1)), L, RingSpec(64, 2))

    def run(x, idx, w, w1, w2):
        return mok_moe(x, idx, w, w1, w2, plan, backend)

    run(*inputs)  # the eager call that sets up the backend's buffers, as a training step's first call does
    return inputs, run


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_layer_compiles_without_graph_breaks(layer, compiler):
    import torch._dynamo

    torch._dynamo.reset()
    (x, idx, w, w1, w2), run = layer
    out = torch.compile(run, fullgraph=True, backend=compiler)(x, idx, w, w1, w2)
    assert out.shape == (T, H) and out.device.type == "meta"
    out.sum().backward()
    assert x.grad.shape == (T, H) and w.grad.shape == (T, K)
    assert all(p.grad.shape == p.shape for p in (*w1, *w2))


def test_pending_error_records_are_not_read_while_tracing(layer, monkeypatch):
    """Earlier eager launches leave error records pending in the lazy reader; a traced backward must not read them
    (a data-dependent branch on a host copy breaks ``fullgraph=True``): the next eager call does."""
    import torch._dynamo

    from megatron_mok.kernel import errors

    class Pending:
        def poll(self, wait: bool = False) -> None:
            raise AssertionError("an error record was read while tracing")

    monkeypatch.setattr(errors, "_lazy", {0: Pending()})
    torch._dynamo.reset()
    (x, idx, w, w1, w2), run = layer
    out = torch.compile(run, fullgraph=True, backend="aot_eager")(x, idx, w, w1, w2)
    out.sum().backward()
    assert x.grad.shape == (T, H)
    with pytest.raises(AssertionError, match="read while tracing"):
        errors.check_pending_errors()  # eager calls still read them
