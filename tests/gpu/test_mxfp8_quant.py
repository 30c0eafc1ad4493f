"""The MXFP8 quantiser of the Blackwell path (csrc/mok/quant/mxfp8_quant.cuh, arch-neutral) on the H200: bit for
bit the recipe of megatron_mok/mxfp8.py, scales row-major and in the sm_100 MMA layout."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import mxfp8

pytestmark = pytest.mark.gpu


def _rows(M: int, H: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    mag = torch.logspace(-30, 30, M, base=2.0, device="cuda").unsqueeze(1)  # many binades, one per row
    x = (torch.randn((M, H), generator=g, device="cuda") * mag).bfloat16()
    x[0, :32] = 0  # an all-zero block
    x[1, 32:64] = 448.0  # a block whose amax / 448 is exactly a power of two
    x[2, :] = 1e-38  # tiny: the scale clamps at the bottom of UE8M0
    return x


@pytest.mark.parametrize("M,H", [(1, 32), (130, 160), (257, 7168), (64, 2048)])
def test_mx_rows_match_the_recipe(M, H):
    from megatron_mok.kernel.mxfp8 import quantize_mx_rows

    x = _rows(max(M, 3), H, seed=M + H)[:M]
    q, b = quantize_mx_rows(x, "row")
    rq, rb = mxfp8.quantize_mx_rows(x)
    assert torch.equal(b, rb), "UE8M0 exponents differ from the recipe"
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), "e4m3 elements differ from the recipe"
    q2, sf = quantize_mx_rows(x, "sm100")
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(sf, mxfp8.to_sm100_sf_layout(rb)), "scales in the sm_100 layout differ"


def test_mx_rows_strided_view_and_errors():
    from megatron_mok.kernel.mxfp8 import quantize_mx_rows

    big = _rows(40, 256, seed=3)
    q, b = quantize_mx_rows(big[:, :128])  # row stride 256
    rq, rb = mxfp8.quantize_mx_rows(big[:, :128])
    assert torch.equal(b, rb) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mx_rows(big[:, :48].contiguous()[:, :40].contiguous())
    with pytest.raises(ValueError, match="(?i)bfloat16"):
        quantize_mx_rows(big.float())
    with pytest.raises(ValueError, match="scale_layout"):
        quantize_mx_rows(big, "col")
    with pytest.raises(ValueError, match="unit inner stride"):
        quantize_mx_rows(big[:, ::2])  # [40, 128] with inner stride 2
