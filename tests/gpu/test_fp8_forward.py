"""GPU tests of the FP8 forward megakernel (kernel.dtype fp8: e4m3, 1 x 128 activation and 128 x 128
weight block scales, quantisation fused into the pull dispatch and the SwiGLU epilogue).

Oracle: the same recipe in PyTorch (mok_truth.ground_truth_fp8 over megatron_mok.fp8). The kernel's
pulled x rows are quantised bit-identically; the SwiGLU output differs from the oracle's by a few fp32
ulps (fast exp), which can move an e4m3 rounding, so combine / out are compared at 2e-2 relative.
Against the unquantised fp32 layer the error must stay within what the recipe gives (< 8%) and be
real quantisation error (> 1e-3: the FP8 path really ran).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from emulated import mok_forward_emulated  # noqa: E402
from mok_truth import exact_fp32, ground_truth, ground_truth_fp8, make_experts, make_routings, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu


def _inputs(R, L, H, F, K, Ts, mode, seed):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    x = [
        (
            torch.randn((T, H), generator=gen, device=dev) * (1 + 3 * torch.rand((T, 1), generator=gen, device=dev))
        ).bfloat16()
        for T in Ts
    ]
    idx, wts = make_routings(Ts, K, R * L, mode, dev, gen)
    w1, w2 = make_experts(R, L, H, F, dev, gen)
    return x, idx, wts, w1, w2


CASES = [
    # R, L, H, F, K, Ts, mode, comm, slots, minibatch
    (1, 4, 256, 256, 2, [300], "uniform", 2, 3, 256),
    (1, 3, 512, 384, 4, [700], "skewed", 2, 2, 256),  # ring wraps (slots < minibatches)
    (2, 3, 384, 128, 4, [200, 333], "minus1", 2, 3, 128),  # H % 256 = 128: half-empty last fc2 n-tile
    (4, 2, 256, 256, 2, [64, 0, 130, 257], "empty", 1, 2, 128),
    (8, 1, 128, 128, 1, [40] * 8, "one", 1, 2, 64),
    (1, 8, 7168, 2048, 8, [1024], "uniform", 16, 3, 2560),  # the Kimi-K2 per-GPU shape (8192 rows)
    # comm_sms 0: the in-SM pull quantises on the producer warpgroups' spare warps
    (1, 3, 512, 384, 4, [700], "skewed", 0, 2, 128),
    (4, 2, 256, 256, 2, [64, 0, 130, 257], "empty", 0, 2, 64),
    (1, 8, 7168, 2048, 8, [1024], "uniform", 0, 3, 2048),
]


@pytest.mark.parametrize("R,L,H,F,K,Ts,mode,comm,slots,mb", CASES)
def test_fp8_forward_matches_the_fp8_recipe(kernel, R, L, H, F, K, Ts, mode, comm, slots, mb):
    from megatron_mok.kernel.quant import quantize_expert_weights

    x, idx, wts, w1, w2 = _inputs(R, L, H, F, K, Ts, mode, seed=R * 31 + H)
    q8 = quantize_expert_weights(w1, w2)
    rows = sum(Ts) * K
    saved = [torch.full((max(rows, 1), 2 * F), 7.0, dtype=torch.bfloat16, device="cuda") for _ in range(R)]
    out, comb, tpe = mok_forward_emulated(
        x, idx, wts, w1, w2, comm_sms=comm, ring_slots=slots, minibatch_tokens=mb, fp8=q8, saved_h=saved
    )
    torch.cuda.synchronize()
    r_out, r_comb, r_h = ground_truth_fp8(x, idx, wts, w1, w2)
    _, _, r_tpe = ground_truth(x, idx, wts, w1, w2)
    exact = exact_fp32(x, idx, wts, w1, w2)
    for q in range(R):
        assert torch.equal(tpe[q].cpu(), r_tpe[q].cpu()), f"tokens_per_expert rank {q}"
        n = r_h[q].shape[0]
        if n:
            e_h = rel_err(saved[q][:n], r_h[q])
            assert e_h < 1e-2, f"owner {q}: saved fc1 output rel err {e_h:.3e} vs the fp8 recipe"
        assert torch.equal(saved[q][n:], torch.full_like(saved[q][n:], 7.0)), "saved h written past the rows"
    for r in range(R):
        assert torch.isfinite(out[r].float()).all() and torch.isfinite(comb[r].float()).all()
        unused = idx[r] < 0
        if unused.any():
            assert (comb[r][unused] == 0).all(), f"rank {r}: combine rows of idx==-1 slots must be zero"
        if Ts[r] == 0:
            continue
        e_c = rel_err(comb[r], r_comb[r])
        e_o = rel_err(out[r], r_out[r])
        assert e_c < 2e-2 and e_o < 2e-2, f"rank {r}: vs fp8 recipe combine {e_c:.3e} out {e_o:.3e}"
        if (idx[r] >= 0).any():
            e_x = rel_err(out[r], exact[r])
            assert 1e-3 < e_x < 0.08, f"rank {r}: fp8 output rel err vs fp32 {e_x:.3e} out of the recipe's range"


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[6]])
@pytest.mark.parametrize("offset,clamp", [(1.0, None), (0.0, 0.5), (-0.5, 0.5)])
def test_fp8_forward_glu_variants_match_the_recipe(kernel, case, offset, clamp):
    """Megatron's clamped / offset SwiGLU in the FP8 fc1 epilogue (and the kept h stays the raw fc1 output)."""
    from megatron_mok.activation import Glu
    from megatron_mok.kernel.quant import quantize_expert_weights

    R, L, H, F, K, Ts, mode, comm, slots, mb = case
    glu = Glu(offset=offset, clamp=clamp)
    x, idx, wts, w1, w2 = _inputs(R, L, H, F, K, Ts, mode, seed=R * 37 + H)
    q8 = quantize_expert_weights(w1, w2)
    saved = [torch.full((max(1, sum(Ts) * K), 2 * F), 7.0, dtype=torch.bfloat16, device="cuda") for _ in range(R)]
    out, comb, _ = mok_forward_emulated(
        x, idx, wts, w1, w2, comm_sms=comm, ring_slots=slots, minibatch_tokens=mb, fp8=q8, saved_h=saved, glu=glu
    )
    torch.cuda.synchronize()
    r_out, r_comb, r_h = ground_truth_fp8(x, idx, wts, w1, w2, glu)
    plain_out, _, _ = ground_truth_fp8(x, idx, wts, w1, w2)
    for q in range(R):
        n = r_h[q].shape[0]
        if n:
            assert rel_err(saved[q][:n], r_h[q]) < 1e-2, f"owner {q}: saved fc1 output"
    for r in range(R):
        if Ts[r] == 0 or not (idx[r] >= 0).any():
            continue
        e_c, e_o = rel_err(comb[r], r_comb[r]), rel_err(out[r], r_out[r])
        assert e_c < 2e-2 and e_o < 2e-2, f"rank {r} {glu.describe()}: combine {e_c:.3e} out {e_o:.3e}"
        assert rel_err(out[r], plain_out[r]) > 0.1, f"rank {r} {glu.describe()}: no different from the plain SwiGLU"


def test_fp8_forward_reads_only_the_e4m3_weights(kernel):
    """With fp8 weights the bf16 masters give only the sizes: they are neither read by the kernel nor checked
    per tensor on every call (host time); zeroed, column-strided masters give the same bits."""
    from megatron_mok.kernel.quant import quantize_expert_weights

    x, idx, wts, w1, w2 = _inputs(2, 2, 256, 256, 2, [300, 200], "uniform", seed=9)
    q8 = quantize_expert_weights(w1, w2)
    kw = dict(comm_sms=2, ring_slots=2, minibatch_tokens=128, fp8=q8)
    o0, c0, _ = mok_forward_emulated(x, idx, wts, w1, w2, **kw)
    z1 = [[torch.zeros((t.shape[1], t.shape[0]), dtype=t.dtype, device=t.device).t() for t in r] for r in w1]
    z2 = [[torch.zeros_like(t) for t in r] for r in w2]
    o1, c1, _ = mok_forward_emulated(x, idx, wts, z1, z2, **kw)
    for r in range(2):
        assert torch.equal(o0[r], o1[r]) and torch.equal(c0[r], c1[r])
    with pytest.raises(ValueError, match="w1 and w2 must be non-empty lists"):
        mok_forward_emulated(x, idx, wts, w1, [w2[0], w2[1][:1]], **kw)


def test_fp8_forward_error_is_reported_vs_bf16(kernel):
    """The same layer through the bf16 and the fp8 kernel against fp32: fp8 error bounded, bf16 smaller."""
    from megatron_mok.kernel.quant import quantize_expert_weights

    R, L, H, F, K = 2, 4, 1024, 512, 4
    x, idx, wts, w1, w2 = _inputs(R, L, H, F, K, [1024, 1024], "uniform", seed=5)
    kw = dict(comm_sms=4, ring_slots=3, minibatch_tokens=512)
    o16, _, _ = mok_forward_emulated(x, idx, wts, w1, w2, **kw)
    o8, _, _ = mok_forward_emulated(x, idx, wts, w1, w2, fp8=quantize_expert_weights(w1, w2), **kw)
    exact = exact_fp32(x, idx, wts, w1, w2)
    for r in range(R):
        e16, e8 = rel_err(o16[r], exact[r]), rel_err(o8[r], exact[r])
        print(f"rank {r}: rel err vs fp32: bf16 kernel {e16:.3e}, fp8 kernel {e8:.3e}")
        assert e16 < e8 < 0.08


def test_fp8_weight_cache_requantizes_only_changed_weights(kernel):
    from megatron_mok.kernel.quant import Fp8WeightCache

    w = (torch.randn(256, 384, device="cuda") / 20).bfloat16()
    cache = Fp8WeightCache()
    q1, s1 = cache.get(w)
    q2, _ = cache.get(w)
    assert q2 is q1, "unchanged weight was re-quantised"
    with torch.no_grad():
        w.mul_(2)  # an optimizer step: bumps the version counter
    q3, s3 = cache.get(w)
    assert q3 is not q1 and torch.allclose(s3, 2 * s1)


def test_fp8_bad_inputs_are_clear_errors(kernel):
    from megatron_mok.kernel.quant import quantize_expert_weights

    x, idx, wts, w1, w2 = _inputs(1, 2, 256, 256, 2, [64], "uniform", seed=1)
    q8 = quantize_expert_weights(w1, w2)
    kw = dict(comm_sms=1, ring_slots=2, minibatch_tokens=64)
    bad = quantize_expert_weights(w1, w2)
    bad.w1s[0][1] = bad.w1s[0][1][:1].contiguous()
    with pytest.raises(ValueError, match=r"w1_scale\[1\] must be Float \[4, 2\]"):
        mok_forward_emulated(x, idx, wts, w1, w2, fp8=bad, **kw)
    with pytest.raises(ValueError, match="Fp8ExpertWeights"):
        mok_forward_emulated(x, idx, wts, w1, w2, fp8=(q8.w1q, q8.w1s), **kw)
    x2, idx2, wts2, w12, w22 = _inputs(1, 2, 192, 256, 2, [64], "uniform", seed=1)  # H = 192: not whole blocks
    with pytest.raises(ValueError, match="multiples of 128"):
        mok_forward_emulated(x2, idx2, wts2, w12, w22, fp8=q8, **kw)


@pytest.mark.parametrize("N,K,strided", [(256, 384, False), (128, 128, False), (4096, 7168, False), (512, 256, True)])
def test_fp8_weight_quantisation_kernel_is_bit_identical_to_the_oracle(kernel, N, K, strided):
    from megatron_mok import fp8
    from megatron_mok.kernel.quant import quantize_weight

    g = torch.Generator(device="cuda").manual_seed(N + K)
    big = torch.randn((N, K + (64 if strided else 0)), generator=g, device="cuda") / 30
    big[:128, :128] = 0  # an all-zero block: the tiny scale
    big[-1, -1] = 1e4  # one block with a very different range
    w = big.bfloat16()[:, :K]
    q, s = quantize_weight(w)
    want_q, want_s = fp8.quantize_weight_128x128(w)
    assert torch.equal(s, want_s), "block scales differ from the oracle"
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), "e4m3 values differ from the oracle"
    with pytest.raises(ValueError, match="multiples of 128"):
        quantize_weight(w[:, :100])
