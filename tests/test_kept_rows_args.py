"""CPU: the host side of KeptRows (the forward's kept expert input / SwiGLU rows) and of the backward's use of them;
the kernels themselves are tested in tests/gpu/test_kept_rows.py, the operators' checks of the buffers in
tests/gpu/test_operator_checks.py."""

from __future__ import annotations

import pytest
import torch

from megatron_mok.kernel import KeptRows
from megatron_mok.kernel.backward import _kept_or_new

CPU = torch.device("cpu")


def test_allocate_rounds_rows_up_to_whole_minibatches():
    k = KeptRows.allocate(1000, 64, 32, 128, CPU)
    assert k.rows == 1024 and k.x.shape == (1024, 64) and k.act.shape == (1024, 32)
    assert k.x.dtype == torch.bfloat16 and k.act.dtype == torch.bfloat16 and not k.filled
    assert KeptRows.allocate(0, 64, 32, 128, CPU).rows == 128  # at least one minibatch


def test_backward_refuses_rows_no_forward_laid_out():
    k = KeptRows.allocate(512, 64, 32, 128, CPU)
    with pytest.raises(ValueError, match="never laid out by a forward launch"):
        _kept_or_new(k, 512, 64, 32, True, CPU)
    k.filled = True
    xl, act = _kept_or_new(k, 500, 64, 32, True, CPU)
    assert xl.data_ptr() == k.x.data_ptr() and act.data_ptr() == k.act.data_ptr()  # views, no copy
    assert xl.shape == (500, 64) and act.shape == (500, 32)
    _, own = _kept_or_new(k, 500, 64, 32, False, CPU)  # recompute: act is the backward's own
    assert own.data_ptr() != k.act.data_ptr()
    with pytest.raises(ValueError, match=r"the backward needs \[>= 600, 64\]"):
        _kept_or_new(k, 600, 64, 32, True, CPU)
    with pytest.raises(ValueError, match=r"\[>= 500, 128\]"):
        _kept_or_new(k, 500, 128, 32, True, CPU)


def test_forward_refuses_rows_of_another_minibatch():
    from megatron_mok.kernel import PeerBuffers, mok_forward

    k = KeptRows.allocate(512, 64, 32, 128, CPU)
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    idx = torch.zeros(8, 2, dtype=torch.int32)
    w1, w2 = [torch.zeros(64, 64, dtype=torch.bfloat16)], [torch.zeros(64, 32, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="allocated for minibatch 128, this launch uses 64"):
        bufs = PeerBuffers.local(CPU)
        mok_forward(bufs, x, idx, idx.float(), w1, w2, comm_sms=1, ring_slots=2, minibatch_tokens=64, keep=k)
