"""CPU: the host-side checks of KeptRows (the forward's kept expert input / SwiGLU rows) and of the
backward's use of them; the kernels themselves are tested in tests/gpu/test_kept_rows.py."""

from __future__ import annotations

import pytest
import torch

from megatron_mok.kernel import KeptRows
from megatron_mok.kernel.backward import _kept_or_new

CPU = torch.device("cpu")


def _fail(msg: str) -> None:
    raise ValueError(msg)


def test_allocate_rounds_rows_up_to_whole_minibatches():
    k = KeptRows.allocate(2, 1000, 64, 32, 128, CPU)
    assert k.rows == 1024 and k.x.shape == (2, 1024, 64) and k.act.shape == (2, 1024, 32)
    assert k.x.dtype == torch.bfloat16 and not k.filled
    k.check(2, 64, 32, 128, CPU, _fail)  # consistent: no error
    with pytest.raises(ValueError, match="allocated for minibatch 128, this launch uses 64"):
        k.check(2, 64, 32, 64, CPU, _fail)
    with pytest.raises(ValueError, match=r"kept x must be \[3, 1024, 64\]"):
        k.check(3, 64, 32, 128, CPU, _fail)


def test_backward_refuses_rows_no_forward_laid_out():
    k = KeptRows.allocate(1, 512, 64, 32, 128, CPU)
    with pytest.raises(ValueError, match="never laid out by a forward launch"):
        _kept_or_new(k, 1, 512, 64, 32, True, CPU, _fail)
    k.filled = True
    xl, act = _kept_or_new(k, 1, 500, 64, 32, True, CPU, _fail)
    assert xl[0].data_ptr() == k.x.data_ptr() and act[0].data_ptr() == k.act.data_ptr()  # views, no copy
    assert xl[0].shape == (500, 64) and act[0].shape == (500, 32)
    _, own = _kept_or_new(k, 1, 500, 64, 32, False, CPU, _fail)  # recompute: act is the backward's own
    assert own[0].data_ptr() != k.act.data_ptr()
    with pytest.raises(ValueError, match="hold 512 rows per owner, the backward needs 600"):
        _kept_or_new(k, 1, 600, 64, 32, True, CPU, _fail)
    with pytest.raises(ValueError, match="need 2 parts"):
        _kept_or_new(k, 2, 500, 64, 32, True, CPU, _fail)
    bad = KeptRows(k.x.float(), k.act, 128, filled=True)
    with pytest.raises(ValueError, match="contiguous bf16"):
        _kept_or_new(bad, 1, 500, 64, 32, True, CPU, _fail)
