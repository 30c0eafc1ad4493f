"""benchmarks/bench_ceilings.py: its ratios and the layer-path share from given round times (CPU), its refusals."""

from __future__ import annotations

import pytest
from load_script import load_script


def _times() -> dict[str, list[float]]:
    """Three rounds of every variant bench_ceilings times (ms)."""
    t = {
        "dense_bf16": [8.0, 8.4, 8.2],
        "dense_fp8": [5.0, 5.4, 5.2],
        "grouped_fp8": [6.0, 6.3, 6.6],
        "dense_fp8_block": [6.0, 6.2, 6.5],
        "dense_bf16_backward": [16.0, 16.0, 16.0],
        "dense_bf16_wgrad": [8.0, 8.0, 8.0],
        "dense_fp8_block_backward": [12.0, 12.5, 12.8],
        "dense_fp8_block_wgrad": [6.4, 6.4, 6.4],
        "router": [0.5, 0.5, 0.5],
    }
    for kind, fwd, bwd in (("bf16", 10.0, 20.0), ("fp8", 6.5, 16.0)):
        t[f"{kind}_kernel_forward"] = [fwd] * 3
        t[f"{kind}_kernel_backward"] = [bwd] * 3
        t[f"{kind}_layer_forward"] = [fwd + 0.6, fwd + 0.7, fwd + 0.8]
        t[f"{kind}_layer_forward_backward"] = [fwd + bwd + 1.0] * 3
        t[f"{kind}_kernel_forward_queued"] = [fwd - 0.2] * 3
        t[f"{kind}_layer_forward_queued"] = [fwd + 0.3] * 3
        t[f"{kind}_own_path_share"] = [0.02, 0.05, 0.01] if kind == "bf16" else [0.03, 0.04, 0.03]
        t[f"{kind}_own_path_share_queued"] = [0.01, 0.01, 0.02]
    t["router_queued"] = [0.45] * 3
    return t


def test_ratios_are_medians_of_per_round_ratios(capsys):
    bench = load_script("bench_ceilings", "benchmarks")
    res = bench.report("s", _times(), 5.0e12, {"bf16": {"out": 3e-3}, "fp8": {"out": 6e-2}})
    r = res["ratios"]
    assert r["kernel bf16 forward of dense bf16"]["median"] == pytest.approx(0.82)
    assert r["kernel fp8 forward of dense fp8"]["min"] == pytest.approx(5.0 / 6.5)
    assert r["kernel fp8 forward of dense fp8"]["max"] == pytest.approx(5.4 / 6.5)
    assert r["kernel fp8 forward of grouped fp8"]["median"] == pytest.approx(6.3 / 6.5)
    assert r["kernel fp8 backward speedup"]["median"] == pytest.approx(20.0 / 16.0)
    # the recipe's own ceilings: the block-scaled dense GEMM against the rowwise one, the FP8 backward GEMMs
    assert r["kernel fp8 forward of dense fp8 block"]["median"] == pytest.approx(6.2 / 6.5)
    assert r["dense fp8 block of dense fp8"]["median"] == pytest.approx(5.0 / 6.0)
    assert r["dense fp8 block of dense fp8"]["min"] == pytest.approx(5.2 / 6.5)
    assert r["dense fp8 block backward speedup"]["median"] == pytest.approx(16.0 / 12.5)
    assert r["dense fp8 block wgrad speedup"]["median"] == pytest.approx(1.25)
    # the layer's own path: the median (range) of the rounds' shares, not a difference of the layer, router and
    # kernel timings
    assert r["layer own path bf16"] == {"median": 0.02, "min": 0.01, "max": 0.05}
    assert r["layer own path fp8"]["max"] == pytest.approx(0.04)
    assert r["layer own path bf16_queued"]["median"] == pytest.approx(0.01)
    out = capsys.readouterr().out
    assert "SUMMARY s FP8 recipe: dense FP8 with 1x128 / 128x128 block scales (cuBLAS) runs at 83.3% (80.0-87.1)" in out
    assert "the wgrad pair alone (1x128 along the tokens on both operands) -> 1.25x (1.25-1.25)" in out
    assert "SUMMARY s layer path, per call: Megatron's router 0.500 ms" in out
    assert "bf16 2.0% (1.0-5.0) | fp8 3.0% (3.0-4.0) (target <= 3%)" in out
    assert "own_path_share" not in out  # shares are not timings: no row of the ms table
    assert "SUMMARY s layer path, queued: Megatron's router 0.450 ms" in out
    assert "SUMMARY s errors vs fp32, fp8: out 6.00e-02" in out


def test_unknown_slice_is_refused():
    bench = load_script("bench_ceilings", "benchmarks")
    with pytest.raises(SystemExit, match="--slices: unknown qwen; known: kimi-k2, deepseek-v3"):
        bench.main(["--slices", "qwen"])
