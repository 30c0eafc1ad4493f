"""GPU tests of the FP8 block-scaled grouped GEMM unit (csrc/mok/gemm/fp8_gemm.cuh) against the numerics
oracle megatron_mok.fp8.fp8_linear (same block scales, fp32 accumulation per 128-wide K block)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def f8(kernel):  # kernel (conftest.py): skips without a GPU or the MoK library
    from megatron_mok.kernel import gemm as fp8_gemm

    return fp8_gemm


def _problem(counts, N, K, seed, pad=0):
    from megatron_mok import fp8

    g = torch.Generator().manual_seed(seed)
    rows = sum(counts) + pad
    x = torch.randn(rows, K, generator=g) * torch.rand(rows, 1, generator=g) * 4  # rows of different scale
    xq, xs = fp8.quantize_act_1x128(x)
    ws_ = [torch.randn(N, K, generator=g) / K**0.5 for _ in counts]
    wq, wsc = zip(*[fp8.quantize_weight_128x128(w) for w in ws_])
    dev = torch.device("cuda")
    return x, ws_, xq.to(dev), xs.to(dev), [t.to(dev) for t in wq], [t.to(dev) for t in wsc]


@pytest.mark.parametrize(
    "counts,N,K",
    [
        ([300, 0, 128, 77, 513], 384, 512),  # empty expert, exact and ragged 128-row tiles
        ([1], 128, 128),  # one row, one tile, one K block
        ([1000, 24], 256, 1024),
        ([3000, 1100], 1024, 512),  # 264 tiles > 132 SMs: several tiles per CTA, 4 K blocks vs 6 stages
    ],
)
def test_fp8_grouped_gemm_matches_the_oracle(f8, counts, N, K):
    from megatron_mok import fp8

    x, w, xq, xs, wq, wsc = _problem(counts, N, K, seed=len(counts) * 7 + K, pad=5)
    guard = torch.full((xq.shape[0], N), 3.0, dtype=torch.bfloat16, device="cuda")
    out = f8.fp8_grouped_gemm(xq, xs, wq, wsc, counts, out=guard.clone())
    torch.cuda.synchronize()
    a = 0
    for e, c in enumerate(counts):
        b = a + c
        if c:
            want = fp8.fp8_linear(xq[a:b].cpu(), xs[a:b].cpu(), wq[e].cpu(), wsc[e].cpu())
            got = out[a:b].float().cpu()
            # bf16 output rounding (2^-8 relative) on top of fp32 summation-order differences
            torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-3 * want.abs().max().item())
            # and the whole FP8 recipe against the unquantised fp32 product
            exact = x[a:b] @ w[e].t()
            assert (got - exact).norm() <= 0.08 * exact.norm(), "fp8 error vs fp32 larger than the recipe gives"
        a = b
    assert torch.equal(out[a:], guard[a:]), "wrote rows past the last expert"


def test_fp8_grouped_gemm_bad_inputs_are_clear_errors(f8):
    _, _, xq, xs, wq, wsc = _problem([64], 128, 256, seed=1)
    with pytest.raises(ValueError, match="(?i)float8_e4m3fn"):
        f8.fp8_grouped_gemm(xq.float(), xs, wq, wsc, [64])
    with pytest.raises(ValueError, match="xs must be"):
        f8.fp8_grouped_gemm(xq, xs[:, :1].contiguous(), wq, wsc, [64])
    with pytest.raises(ValueError, match="counts sum to 65 rows, x has 64"):
        f8.fp8_grouped_gemm(xq, xs, wq, wsc, [65])
    with pytest.raises(ValueError, match="one entry per expert"):
        f8.fp8_grouped_gemm(xq, xs, wq, wsc, [32, 32])
