"""CPU-only CI check: the MoK megakernel compiles for sm_90a (needs nvcc + nvidia-cutlass headers; runs nothing)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.nvcc


def test_kernel_compiles_for_sm90a(tmp_path):
    from megatron_mok.kernel import build

    if build.find_nvcc() is None:
        pytest.skip("nvcc not found")
    if build.cutlass_include() is None:
        pytest.skip("CUTLASS headers not found (pip install --no-deps nvidia-cutlass==4.2.0.0)")
    out = build.compile_only(tmp_path / "mok.cubin")
    data = out.read_bytes()
    assert len(data) > 0
    # the fused kernel is in the cubin
    assert b"mok_forward_kernel" in data
    # and the FP8 block-scaled GEMM unit (issue #5)
    assert b"mok_fp8_gemm_kernel" in data
