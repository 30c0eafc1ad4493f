"""CPU: the FP8 block-scaled recipe (the oracle of the FP8 kernel path, forward, dgrad and wgrad) and its error bounds."""

from __future__ import annotations

import pytest
import torch

from megatron_mok import fp8


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_block_scales_shapes_and_round_trip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g) * torch.logspace(-3, 3, 512)  # very different block ranges
    q, s = fp8.quantize_act_1x128(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 4)
    assert float(q.float().abs().max()) <= fp8.E4M3_MAX  # no saturation
    assert _rel(fp8.dequantize_act(q, s), x) < 0.04  # e4m3 has 3 mantissa bits: ~2^-4 relative
    w = torch.randn(256, 384, generator=g)
    wq, ws = fp8.quantize_weight_128x128(w)
    assert ws.shape == (2, 3)
    assert _rel(fp8.dequantize_weight(wq, ws), w) < 0.04
    zq, zs = fp8.quantize_act_1x128(torch.zeros(2, 128))
    assert torch.isfinite(zs).all() and float(zq.float().abs().sum()) == 0.0


def test_fp8_linear_equals_dequantized_matmul():
    g = torch.Generator().manual_seed(1)
    xq, xs = fp8.quantize_act_1x128(torch.randn(32, 256, generator=g))
    wq, ws = fp8.quantize_weight_128x128(torch.randn(128, 256, generator=g))
    want = fp8.dequantize_act(xq, xs) @ fp8.dequantize_weight(wq, ws).t()
    assert _rel(fp8.fp8_linear(xq, xs, wq, ws), want) < 1e-6


def test_fp8_expert_ffn_error_vs_fp32_is_bounded():
    g = torch.Generator().manual_seed(2)
    H, F = 512, 256
    x = torch.randn(200, H, generator=g)
    w1 = torch.randn(2 * F, H, generator=g) / H**0.5
    w2 = torch.randn(H, F, generator=g) / F**0.5
    h = x @ w1.t()
    ref = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ w2.t()
    err = _rel(fp8.fp8_expert_ffn(x, w1, w2), ref)
    assert 1e-3 < err < 0.08, err  # really quantized, and within the recipe's expected error


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.quantize_act_1x128(torch.randn(4, 100))
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.quantize_weight_128x128(torch.randn(100, 128))
    with pytest.raises(TypeError, match="floating"):
        fp8.quantize_act_1x128(torch.ones(4, 128, dtype=torch.int32))


def test_fp8_weight_cache_follows_optimizer_steps_through_param_data():
    """Megatron writes updated weights through ``param.data`` (no version bump): the cache must still
    re-quantise after an optimizer step, and keep its copy between steps (micro-batches)."""
    from megatron_mok.kernel.quant import Fp8WeightCache, weights_changed

    p = torch.nn.Parameter(torch.randn(128, 256))
    cache = Fp8WeightCache()
    q0, s0 = cache.get(p)
    assert cache.get(p)[0] is q0  # unchanged: one quantisation per step
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()  # the global step post-hook invalidates the cache
    q1, _ = cache.get(p)
    assert q1 is not q0
    torch.testing.assert_close(q1.float(), fp8.quantize_weight_128x128(p.detach())[0].float())
    with torch.no_grad():
        p.data.copy_(torch.randn(128, 256))  # Megatron-style update: p._version does not move ...
    assert cache.get(p)[0] is q1  # ... so without a step the cache cannot see it: weights_changed() says so
    weights_changed()
    q2, s2 = cache.get(p)
    assert q2 is not q1
    torch.testing.assert_close(s2, fp8.quantize_weight_128x128(p.detach())[1])


def test_block_quantisation_of_the_transpose_is_the_transposed_quantisation():
    """What lets the FP8 dgrad read W^T without re-quantising: same 128 x 128 blocks, same scales."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 384, generator=g) * torch.logspace(-2, 2, 384)
    q, s = fp8.quantize_weight_128x128(w)
    qt, st = fp8.quantize_weight_128x128(w.t().contiguous())
    assert torch.equal(st, s.t()) and torch.equal(qt.float(), q.float().t())


def _fp32_ffn_with_grads(H: int, F: int, T: int, seed: int):
    """One expert's SwiGLU FFN in fp32 by autograd on random data: (x, w1, w2 with their .grad, gy, y)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).requires_grad_()
    w1 = (torch.randn(2 * F, H, generator=g) / H**0.5).requires_grad_()
    w2 = (torch.randn(H, F, generator=g) / F**0.5).requires_grad_()
    gy = torch.randn(T, H, generator=g)
    h = x @ w1.t()
    y = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ w2.t()
    y.backward(gy)
    return x, w1, w2, gy, y


def test_fp8_expert_ffn_backward_error_vs_fp32_autograd_is_bounded():
    x, w1, w2, gy, _ = _fp32_ffn_with_grads(512, 256, 300, seed=4)
    dx, dw1, dw2 = fp8.fp8_expert_ffn_backward(x.detach(), w1.detach(), w2.detach(), gy)
    for name, got, want in (("dx", dx, x.grad), ("dw1", dw1, w1.grad), ("dw2", dw2, w2.grad)):
        err = _rel(got, want)
        assert err < 0.12, f"{name}: rel err {err:.3e}"
    assert _rel(dx, x.grad) > 1e-3  # dgrad really quantised


def test_swiglu_backward_matches_autograd():
    g = torch.Generator().manual_seed(5)
    h = torch.randn(7, 256, generator=g, dtype=torch.float64).requires_grad_()
    d = torch.randn(7, 128, generator=g, dtype=torch.float64)
    (torch.nn.functional.silu(h[:, :128]) * h[:, 128:]).backward(d)
    torch.testing.assert_close(fp8.swiglu_backward(h.detach(), d).double(), h.grad)


def test_fp8_expert_set_is_handed_back_until_a_weight_or_a_step_changes():
    """Fp8WeightCache.experts keeps its whole answer for the same weights; any change asks again."""
    from megatron_mok.kernel.quant import Fp8WeightCache, weights_changed

    w1 = [[torch.randn(256, 128) for _ in range(2)]]
    w2 = [[torch.randn(128, 128) for _ in range(2)]]
    cache = Fp8WeightCache()
    a = cache.experts(w1, w2)
    assert cache.experts([list(w1[0])], [list(w2[0])]) is a  # new lists, same tensors: the same answer
    t = cache.experts(w1, w2, transposed=True)
    assert t is not a and t.w1tq is not None and cache.experts(w1, w2, transposed=True) is t
    weights_changed()  # an optimizer step
    b = cache.experts(w1, w2)
    assert b is not a
    with torch.no_grad():
        w2[0][1].add_(1.0)  # an in-place update outside a step: its version moves
    c = cache.experts(w1, w2)
    assert c is not b and c.w1q[0][0] is b.w1q[0][0]  # only the changed weight was quantised again
    torch.testing.assert_close(c.w2s[0][1], fp8.quantize_weight_128x128(w2[0][1])[1])
    w1[0][0] = torch.randn(256, 128)  # another tensor
    d = cache.experts(w1, w2)
    assert d is not c
    torch.testing.assert_close(d.w1s[0][0], fp8.quantize_weight_128x128(w1[0][0])[1])


def test_token_block_quantisation_is_the_transposed_row_quantisation_and_pads_with_zeros():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(256, 384, generator=g) * torch.logspace(-3, 3, 256).unsqueeze(1)
    q, s = fp8.quantize_tokens_128x1(x)
    qt, st = fp8.quantize_act_1x128(x.t().contiguous())
    assert torch.equal(s, st.t()) and torch.equal(q.float(), qt.float().t())
    q, s = fp8.quantize_tokens_128x1(x[:200])  # padded to 256 tokens with zero rows
    assert q.shape == (256, 384) and s.shape == (2, 384)
    assert not q[200:].float().any()
    assert torch.equal(s[0], st.t()[0])  # the first block is all real tokens


def test_fp8_wgrad_equals_the_dequantised_product():
    g = torch.Generator().manual_seed(7)
    gy, a = torch.randn(300, 256, generator=g), torch.randn(300, 384, generator=g)
    (gq, gs), (aq, as_) = fp8.quantize_tokens_128x1(gy), fp8.quantize_tokens_128x1(a)
    deq = lambda q, s: q.float() * s.repeat_interleave(fp8.BLOCK, dim=0)  # noqa: E731
    want = deq(gq, gs).t() @ deq(aq, as_)
    torch.testing.assert_close(fp8.fp8_wgrad(gq, gs, aq, as_), want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="must share their padded token count"):
        fp8.fp8_wgrad(gq, gs, aq[:128], as_[:1])


@pytest.mark.parametrize("H,F,T", [(512, 256, 300), (1024, 512, 1000)])
def test_fp8_wgrad_error_vs_fp32_is_no_worse_than_the_forward(H, F, T):
    """DeepSeek-V3's wgrad recipe (both operands e4m3 per 128 tokens of a column): dW1 and dW2 against fp32 autograd
    within the forward output's own error (x 1.05), and really quantised (above the bf16 wgrad's error)."""
    x, w1, w2, gy, y = _fp32_ffn_with_grads(H, F, T, seed=H + T)
    fwd_err = _rel(fp8.fp8_expert_ffn(x.detach(), w1.detach(), w2.detach()), y.detach())
    args = (x.detach(), w1.detach(), w2.detach(), gy)
    _, dw1, dw2 = fp8.fp8_expert_ffn_backward(*args, wgrad="fp8")
    _, bw1, bw2 = fp8.fp8_expert_ffn_backward(*args, wgrad="bf16")
    for name, got, bf, want in (("dw1", dw1, bw1, w1.grad), ("dw2", dw2, bw2, w2.grad)):
        err = _rel(got, want)
        assert err <= 1.05 * fwd_err, f"{name}: FP8 wgrad rel err {err:.3e} vs the forward's {fwd_err:.3e}"
        assert err > 1.1 * _rel(bf, want), f"{name}: the FP8 wgrad is no less exact than the bf16 one"
    with pytest.raises(ValueError, match="wgrad must be 'bf16' or 'fp8', got 'fp16'"):
        fp8.fp8_expert_ffn_backward(*args, wgrad="fp16")


def test_token_major_operands_and_the_grouped_wgrad_oracle_match_per_expert_wgrads():
    """The FP8 wgrad GEMM unit's operand layout (experts' tokens padded to 128 and laid back to back, token-contiguous)
    and its oracle: each expert's block equals fp8_wgrad of that expert's rows alone; an expert without tokens is 0."""
    g = torch.Generator().manual_seed(8)
    counts = [200, 0, 128, 37]
    dh, x = torch.randn(sum(counts), 256, generator=g), torch.randn(sum(counts), 384, generator=g)
    a, sa, padded = fp8.token_major_operand(dh, counts)
    b, sb, padded_b = fp8.token_major_operand(x, counts)
    assert padded == padded_b == [256, 0, 128, 128]
    assert a.shape == (256, 512) and sa.shape == (4, 256) and b.shape == (384, 512) and sb.shape == (4, 384)
    assert a.is_contiguous() and a.dtype == torch.float8_e4m3fn
    got = fp8.fp8_wgrad_grouped(a, sa, b, sb, padded)
    start = 0
    for e, c in enumerate(counts):
        assert got[e].shape == (256, 384)
        if c == 0:
            assert not got[e].any()
        else:
            want = fp8.fp8_wgrad(
                *fp8.quantize_tokens_128x1(dh[start : start + c]), *fp8.quantize_tokens_128x1(x[start : start + c])
            )
            assert torch.equal(got[e], want), e
            exact = dh[start : start + c].t() @ x[start : start + c]
            assert _rel(got[e], exact) < 0.08
        start += c
    with pytest.raises(ValueError, match="cannot hold expert segments"):
        fp8.token_major_operand(dh, [400, 0, 0, 0])
    with pytest.raises(ValueError, match="not a multiple of 128"):
        fp8.fp8_wgrad_grouped(a, sa, b, sb, [200, 0, 128, 184])
