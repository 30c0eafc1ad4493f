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
