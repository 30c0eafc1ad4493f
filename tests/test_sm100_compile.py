"""The Blackwell (sm_100a) MXFP8 expert GEMM unit compiles here, on a CPU-only machine, into tcgen05
block-scaled MMAs (it cannot run on the H200: tests/gpu/test_sm100_units.py runs it on a Blackwell GPU)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_mok.kernel import build

pytestmark = pytest.mark.skipif(
    build.find_nvcc() is None or build.cutlass_include() is None, reason="needs nvcc and the CUTLASS headers"
)


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:  # triton ships one that knows sm_100
        import triton

        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return str(cand) if cand.is_file() else None
    except ImportError:
        return None


def test_mxfp8_grouped_gemm_compiles_for_sm100a(tmp_path):
    cubin = build.compile_only(tmp_path / "mxfp8.cubin", source="sm100/mxfp8_grouped_gemm.cu")
    assert cubin.stat().st_size > 10_000
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump to read the sm_100a SASS (compile checked only)")
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    assert "UTCQMMA" in sass, "no tcgen05 block-scaled MMA (UTCQMMA) in the sm_100a code"
    assert "UTMALDG" in sass, "operands are not loaded by TMA"
