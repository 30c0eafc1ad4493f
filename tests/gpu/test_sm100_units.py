"""The sm_100a MXFP8 grouped expert GEMM against the MXFP8 recipe (megatron_mok/mxfp8.py): runs on a
Blackwell GPU only (skipped on the H200, where it cannot run; tests/test_sm100_compile.py compiles it)."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import mxfp8

pytestmark = pytest.mark.gpu


def _blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


@pytest.mark.skipif(not _blackwell(), reason="needs a Blackwell (sm_100) GPU")
@pytest.mark.parametrize("rows", [[300, 0, 128, 1000], [4096]])
def test_mxfp8_grouped_gemm_matches_the_recipe(rows):
    from megatron_mok.kernel.mxfp8 import quantize_mx_rows
    from megatron_mok.kernel.sm100 import mxfp8_grouped_gemm

    g = torch.Generator(device="cuda").manual_seed(len(rows))
    N, K = 512, 1024
    xs = [torch.randn((m, K), generator=g, device="cuda").bfloat16() for m in rows]
    ws = [(torch.randn((N, K), generator=g, device="cuda") / K**0.5).bfloat16() for _ in rows]
    a, sfa, b, sfb, want = [], [], [], [], []
    for x, w in zip(xs, ws):
        qa, sa = quantize_mx_rows(x, "sm100")
        qb, sb = quantize_mx_rows(w, "sm100")
        a.append(qa), sfa.append(sa), b.append(qb), sfb.append(sb)
        want.append(mxfp8.mxfp8_linear(*mxfp8.quantize_mx_rows(x), *mxfp8.quantize_mx_rows(w)))
    got = mxfp8_grouped_gemm(a, sfa, b, sfb)
    for m, y, r in zip(rows, got, want):
        assert y.shape == (m, N)
        if m:
            err = ((y.float() - r).norm() / r.norm()).item()
            assert err < 1e-2, f"{m} rows: rel err {err:.3e} vs the MXFP8 recipe"


@pytest.mark.skipif(_blackwell(), reason="this is a Blackwell GPU")
def test_sm100_unit_refuses_other_gpus_clearly():
    from megatron_mok.kernel.errors import MokKernelError
    from megatron_mok.kernel.sm100 import mxfp8_grouped_gemm

    a = torch.zeros((128, 128), dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.zeros(mxfp8.sm100_sf_bytes(128, 4), dtype=torch.uint8, device="cuda")
    with pytest.raises(MokKernelError, match="need a Blackwell sm_100 GPU"):
        mxfp8_grouped_gemm([a], [s], [a], [s])
