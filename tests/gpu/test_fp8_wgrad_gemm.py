"""GPU tests of the FP8 weight-gradient GEMM unit (csrc/mok/gemm/fp8_wgrad_gemm.cuh) against its oracle
megatron_mok.fp8.fp8_wgrad_grouped (same 128-token block scales, fp32 sums of each block's exact e4m3 products)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gemm(kernel):  # kernel (conftest.py): skips without a GPU or the MoK library
    from megatron_mok.kernel import gemm

    return gemm


def _problem(counts, M, N, seed, extra_blocks=0):
    """Token rows of two operands (dH-like [T, M], x-like [T, N]) with rows of different scale, their token-major
    e4m3 operands, and extra_blocks x 128 trailing token columns of noise no expert owns (must not be read)."""
    from megatron_mok import fp8

    g = torch.Generator().manual_seed(seed)
    T = sum(counts)
    ra = torch.randn(T, M, generator=g) * torch.rand(T, 1, generator=g) * 4
    rb = torch.randn(T, N, generator=g) * torch.rand(1, N, generator=g) * 2
    a, sa, padded = fp8.token_major_operand(ra, counts)
    b, sb, _ = fp8.token_major_operand(rb, counts)
    if extra_blocks:
        na, nsa, _ = fp8.token_major_operand(
            torch.randn(128 * extra_blocks, M, generator=g) * 100, [128 * extra_blocks]
        )
        nb, nsb, _ = fp8.token_major_operand(
            torch.randn(128 * extra_blocks, N, generator=g) * 100, [128 * extra_blocks]
        )
        a, sa = torch.cat([a, na], 1).contiguous(), torch.cat([sa, nsa]).contiguous()
        b, sb = torch.cat([b, nb], 1).contiguous(), torch.cat([sb, nsb]).contiguous()
    dev = torch.device("cuda")
    return ra, rb, padded, a, sa, b, sb, [t.to(dev) for t in (a, sa, b, sb)]


def _assert_matches(got, want, exact=None):
    # the tensor cores sum a block's products in their own order and precision; the promotion adds in fp32
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
    if exact is not None:  # and the whole recipe against the unquantised fp32 product
        assert (got - exact).norm() <= 0.08 * exact.norm(), "fp8 wgrad error vs fp32 larger than the recipe gives"


@pytest.mark.parametrize(
    "counts,M,N,extra",
    [
        ([200, 0, 384, 77], 256, 384, 1),  # an expert without tokens, padded blocks, unowned trailing columns
        ([1], 128, 128, 0),  # one token: one tile, one K block
        ([2048], 256, 256, 0),  # 16 K blocks through the 6-stage ring
        ([128, 250], 1536, 1536, 0),  # 288 tiles > 132 SMs: several tiles per CTA
    ],
)
def test_fp8_wgrad_gemm_matches_the_oracle(gemm, counts, M, N, extra):
    from megatron_mok import fp8

    ra, rb, padded, a, sa, b, sb, dev_ops = _problem(counts, M, N, seed=M + N + len(counts), extra_blocks=extra)
    guard = [torch.full((M, N), 3.0, device="cuda") for _ in counts]
    tpe = torch.tensor(counts, dtype=torch.int32, device="cuda")  # the tokens, unpadded, on the device
    out = gemm.fp8_wgrad_gemm(*dev_ops, tpe, out=guard)
    torch.cuda.synchronize()
    assert [o.data_ptr() for o in out] == [g.data_ptr() for g in guard], "not the buffers given"
    want = fp8.fp8_wgrad_grouped(a, sa, b, sb, padded)
    start = 0
    for e, c in enumerate(counts):
        got = out[e].cpu()
        if c == 0:
            assert not got.any(), "an expert without tokens must get a zero gradient"
        else:
            _assert_matches(got, want[e], ra[start : start + c].t() @ rb[start : start + c])
        start += c


def test_fp8_wgrad_gemm_accumulates_into_the_buffers_and_leaves_tokenless_experts(gemm):
    from megatron_mok import fp8

    counts = [300, 0, 128]
    _, _, padded, a, sa, b, sb, dev_ops = _problem(counts, 256, 128, seed=11)
    g = torch.Generator().manual_seed(12)
    before = [torch.randn(256, 128, generator=g) for _ in counts]
    bufs = [t.cuda() for t in before]
    tpe = torch.tensor(counts, dtype=torch.int32, device="cuda")
    gemm.fp8_wgrad_gemm(*dev_ops, tpe, out=bufs, accumulate=True)
    torch.cuda.synchronize()
    want = fp8.fp8_wgrad_grouped(a, sa, b, sb, padded)
    assert torch.equal(bufs[1].cpu(), before[1]), "accumulating touched an expert without tokens"
    for e in (0, 2):
        _assert_matches(bufs[e].cpu(), before[e] + want[e])
    # and all experts without tokens: nothing to launch, nothing changes
    kept = [t.clone() for t in bufs]
    gemm.fp8_wgrad_gemm(*dev_ops, [0, 0, 0], out=bufs, accumulate=True)  # host counts
    torch.cuda.synchronize()
    assert all(torch.equal(t, k) for t, k in zip(bufs, kept))


def test_fp8_wgrad_gemm_bad_inputs_are_clear_errors(gemm):
    from megatron_mok.kernel import MokKernelError, check_pending_errors

    _, _, padded, *_, (a, sa, b, sb) = _problem([128, 128], 128, 256, seed=3)
    with pytest.raises(ValueError, match="(?i)float8_e4m3fn"):
        gemm.fp8_wgrad_gemm(a.float(), sa, b, sb, padded)
    with pytest.raises(ValueError, match="sa must be"):
        gemm.fp8_wgrad_gemm(a, sa[:1].contiguous(), b, sb, padded)
    with pytest.raises(ValueError, match=r"padded to 128 each, need 384 token columns; a has 256"):
        gemm.fp8_wgrad_gemm(a, sa, b, sb, [100, 129])
    with pytest.raises(ValueError, match="one entry per expert"):
        gemm.fp8_wgrad_gemm(a, sa, b, sb, [128, 128], out=[torch.zeros(128, 256, device="cuda")])
    with pytest.raises(ValueError, match="needs the buffers"):
        gemm.fp8_wgrad_gemm(a, sa, b, sb, padded, accumulate=True)
    with pytest.raises(ValueError, match=r"out\[1\] must be"):
        outs = [torch.zeros(128, 256, device="cuda"), torch.zeros(128, 256, device="cuda").bfloat16()]
        gemm.fp8_wgrad_gemm(a, sa, b, sb, padded, out=outs)
    # device counts whose blocks run past the token columns: the kernel says so (read lazily, like the megakernels')
    gemm.fp8_wgrad_gemm(a, sa, b, sb, torch.tensor([128, 129], dtype=torch.int32, device="cuda"))
    with pytest.raises(MokKernelError, match="expert 1's 128-padded tokens end at column 384, but a and b hold 256"):
        check_pending_errors(wait=True)
    gemm.fp8_wgrad_gemm(a, sa, b, sb, torch.tensor([128, -5], dtype=torch.int32, device="cuda"))
    with pytest.raises(MokKernelError, match=r"local expert 1 has a negative token count \(-5\)"):
        check_pending_errors(wait=True)


_MANY = [(e * 37) % 300 if e % 3 else 0 for e in range(200)]  # 200 experts, every third without tokens


@pytest.mark.parametrize(
    "counts,F,stride",
    [([200, 0, 384, 77], 256, 0), ([1], 128, 0), ([0, 0], 128, 0), ([1000, 24, 513], 384, 128), (_MANY, 128, 0)],
    ids=["ragged", "one-token", "no-tokens", "strided-rows", "200-experts"],
)
def test_token_quantiser_matches_the_oracle_and_feeds_the_unit(gemm, counts, F, stride):
    """Layout-order rows (counts on the device) -> the unit's operand: the scales bit-identical to the oracle's, the
    e4m3 values within one e4m3 step (the kernel's 1 / scale is a refined approximate reciprocal: an ulp apart at
    most), zero padding in each expert's last block; and the unit on the quantiser's output matches the oracle."""
    from megatron_mok import fp8

    g = torch.Generator().manual_seed(F + len(counts))
    rows = torch.randn(sum(counts) + 3, F, generator=g) * torch.logspace(-2, 2, F)  # 3 rows owned by no expert
    dev_rows = torch.zeros(rows.shape[0], F + stride, dtype=torch.bfloat16, device="cuda")[:, :F]  # row stride F + pad
    dev_rows.copy_(rows.bfloat16())
    q, s = gemm.quantize_tokens(dev_rows, torch.tensor(counts, dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    assert q.shape == (F, gemm.token_major_capacity(rows.shape[0], len(counts))) and s.shape[1] == F
    want_q, want_s, padded = fp8.token_major_operand(rows.bfloat16().float(), counts)  # the kernel reads bf16 rows
    ktot = sum(padded)
    assert torch.equal(s[: ktot // 128].cpu(), want_s), "scales differ from the oracle's"
    if not ktot:
        return
    got, want = q[:, :ktot].cpu().float(), want_q.float()
    diff = (got - want).abs()
    assert float((diff > 0).float().mean()) < 1e-3, "more than rare one-ulp differences in the e4m3 values"
    # one e4m3 step at the larger of the two magnitudes: 2^(exponent - 3), subnormals 2^-9
    step = torch.exp2(torch.floor(torch.log2(torch.maximum(got.abs(), want.abs()).clamp_min(2.0**-6))) - 3)
    assert bool((diff <= step).all()), "an e4m3 value off by more than one step"
    b_rows = torch.randn(rows.shape[0], 128, generator=g)
    b, sb = gemm.quantize_tokens(b_rows.cuda().bfloat16(), counts)  # counts from the host this time
    out = gemm.fp8_wgrad_gemm(q, s, b, sb, counts)
    wb, wsb, _ = fp8.token_major_operand(b_rows.bfloat16().float(), counts)
    for got_e, want_e in zip(out, fp8.fp8_wgrad_grouped(want_q, want_s, wb, wsb, padded)):
        _assert_matches(got_e.cpu(), want_e)


def test_token_quantiser_reports_counts_that_do_not_fit_the_rows(gemm):
    from megatron_mok.kernel import MokKernelError, check_pending_errors

    rows = torch.randn(300, 128, device="cuda").bfloat16()
    _, s = gemm.quantize_tokens(rows, torch.tensor([200, 101], dtype=torch.int32, device="cuda"))
    with pytest.raises(MokKernelError, match="local expert 1's rows end at row 301, but the rows hold 300"):
        check_pending_errors(wait=True)
    assert torch.isnan(s).all(), "scales of counts that do not fit must poison a wgrad that uses them"
    gemm.quantize_tokens(rows, torch.tensor([-1, 3], dtype=torch.int32, device="cuda"))
    with pytest.raises(MokKernelError, match=r"local expert 0 has a negative token count \(-1\)"):
        check_pending_errors(wait=True)
    with pytest.raises(ValueError, match="300 rows cannot hold expert segments of"):
        gemm.quantize_tokens(rows, [200, 101])
    # no rows at all (a null data pointer): nothing to quantise, and no error
    q, s = gemm.quantize_tokens(
        torch.empty(0, 128, dtype=torch.bfloat16, device="cuda"), torch.zeros(2, dtype=torch.int32, device="cuda")
    )
    check_pending_errors(wait=True)
    assert q.shape == (128, gemm.token_major_capacity(0, 2)) and s.shape == (q.shape[1] // 128, 128)
