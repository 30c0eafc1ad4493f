"""The MXFP8 recipe (megatron_mok/mxfp8.py, the Blackwell path's oracle) on CPU, and its sm_100 scale
layout against CUTLASS's own (a host-only CuTe probe compiled with nvcc)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from megatron_mok import mxfp8


def test_exponent_rounds_up_at_every_edge():
    a = torch.tensor([0.0, 448.0, 449.0, 896.0, 1.0, 448 * 2.0**-127, 448 * 2.0**-126, 3.0e38, float(2**-140)])
    b = mxfp8.e8m0_exponent(a).tolist()
    assert b == [0, 127, 128, 128, 119, 0, 1, 247, 0]
    s = mxfp8.e8m0_to_float(torch.tensor(b, dtype=torch.uint8))
    assert (a * (1 / 448.0) <= s * (1 + 2**-23)).all(), "a scale below amax / 448 would saturate"


def test_rows_round_trip_within_e4m3_rounding_and_never_saturate():
    torch.manual_seed(0)
    x = torch.randn(64, 512) * torch.logspace(-20, 20, 512, base=2.0)
    q, b = mxfp8.quantize_mx_rows(x)
    assert q.dtype == torch.float8_e4m3fn and b.shape == (64, 16) and b.dtype == torch.uint8
    scale = mxfp8.e8m0_to_float(b).repeat_interleave(32, dim=1)
    assert (x.abs() / scale <= 448.0 * (1 + 2**-20)).all()
    d = mxfp8.dequantize_mx_rows(q, b)
    # e4m3: 3 mantissa bits -> half an ulp is 2^-4 relative; subnormals (below 2^-6 of the scale) 2^-10 absolute
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    assert ((d - x).abs() <= bound * (1 + 1e-6)).all()
    assert 1e-3 < ((d - x).norm() / x.norm()).item() < 0.05


def test_values_on_the_grid_are_exact_and_zero_blocks_stay_zero():
    grid = torch.tensor([448.0, -256.0, 1.5, -0.015625, 0.0, 2.0**-9] * 5 + [448.0, 3.0])
    x = torch.stack([grid * 2.0**-30, grid, grid * 2.0**20, torch.zeros(32)])
    q, b = mxfp8.quantize_mx_rows(x)
    assert torch.equal(mxfp8.dequantize_mx_rows(q, b), x)
    assert b.flatten().tolist() == [97, 127, 147, 0]


def test_bad_rows_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8.quantize_mx_rows(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="2-D"):
        mxfp8.quantize_mx_rows(torch.zeros(32))
    with pytest.raises(TypeError, match="floating"):
        mxfp8.quantize_mx_rows(torch.zeros(2, 32, dtype=torch.int32))


def test_mxfp8_linear_tracks_the_fp32_product():
    torch.manual_seed(1)
    x, w = torch.randn(48, 256), torch.randn(80, 256) / 16
    y = mxfp8.mxfp8_linear(*mxfp8.quantize_mx_rows(x), *mxfp8.quantize_mx_rows(w))
    assert 1e-3 < ((y - x @ w.t()).norm() / (x @ w.t()).norm()).item() < 0.08


def test_sm100_layout_is_a_bijection_onto_its_atoms():
    for M, nk in ((1, 1), (130, 5), (256, 16), (7, 224)):
        b = torch.randint(1, 255, (M, nk), dtype=torch.uint8)
        flat = mxfp8.to_sm100_sf_layout(b)
        assert flat.numel() == mxfp8.sm100_sf_bytes(M, nk) and flat.numel() % 512 == 0
        r = torch.arange(M).unsqueeze(1).expand(M, nk)
        k = torch.arange(nk).unsqueeze(0).expand(M, nk)
        off = mxfp8.sm100_sf_offset(r, k, nk).flatten()
        assert off.unique().numel() == M * nk and torch.equal(flat[off], b.flatten())
        assert int((flat != 0).sum()) == M * nk  # the rest is padding


def _cutlass_include():
    from megatron_mok.kernel.build import cutlass_include

    return cutlass_include()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (host-only compile, no GPU)")
def test_sm100_layout_matches_cutlass(tmp_path):
    inc = _cutlass_include()
    if inc is None:
        pytest.skip("CUTLASS headers (nvidia-cutlass wheel) not installed")
    src = os.path.join(os.path.dirname(__file__), "..", "csrc", "mok", "sm100", "sf_layout_probe.cu")
    exe = tmp_path / "probe"
    subprocess.run(["nvcc", "-std=c++17", f"-I{inc}", src, "-o", str(exe)], check=True, capture_output=True)
    for M, K in ((130, 160), (256, 512), (7, 96), (384, 7168)):
        out = subprocess.run([str(exe), str(M), str(K)], check=True, capture_output=True, text=True).stdout.split()
        v = torch.tensor([int(t) for t in out]).view(-1, 3)
        assert v.shape[0] == M * (K // 32)
        assert torch.equal(mxfp8.sm100_sf_offset(v[:, 0], v[:, 1], K // 32), v[:, 2]), (M, K)
