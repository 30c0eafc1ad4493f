"""Fixtures shared by the GPU tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def kernel():
    """megatron_mok.kernel, or a skip where no CUDA device or no built MoK operator library is at hand."""
    import megatron_mok.kernel as k

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not k.is_available():
        pytest.skip(f"MoK kernel unavailable: {k.unavailable_reason()}")
    return k


@pytest.fixture(scope="module")
def bk(kernel):
    """megatron_mok.kernel.backward, or a skip where the kernels cannot run (the ``kernel`` fixture)."""
    from megatron_mok.kernel import backward

    return backward


@pytest.fixture(autouse=True)
def _no_error_record_outlives_its_test():
    """Zero every live kernel error record after each test. A test that provokes a kernel error keeps its buffers, and
    their set record, alive through the exception's traceback (a reference cycle, until the next collection), and
    ``check_last_error`` reads every live record: a later test would see the earlier test's error as its own."""
    yield
    if torch.cuda.is_available():
        from megatron_mok.kernel import errors

        torch.cuda.synchronize()
        for err, _message in errors._live_records():
            err.zero_()
