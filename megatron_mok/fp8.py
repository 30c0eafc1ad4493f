"""FP8 (e4m3) with fine-grained block scales, as DeepSeek-V3 trains on Hopper: the numerics oracle
of the MoK FP8 kernel path (``kernel.dtype: fp8``: the fused forward kernel, the backward kernel's FP8 dgrad, and
the block-scaled grouped GEMM units ``megatron_mok.kernel.gemm``), and of the FP8 wgrad the backward kernel is
still to fuse (``fp8_expert_ffn_backward(..., wgrad="fp8")``).

* activations: one fp32 scale per 1 x 128 block of a row (quantized where rows are produced: in the
  kernel, fused into pull dispatch for x and into the SwiGLU epilogue for fc2's input);
* weights: one fp32 scale per 128 x 128 block;
* GEMMs accumulate in fp32, the scale of each 128-wide K block applied to its partial sum; outputs bf16.

Scales map each block's absolute maximum to the e4m3 maximum (448), so no value saturates:
``scale = max(amax * fp32(1 / 448), 1e-12)`` and ``q = e4m3(x * (1 / scale))`` (round to nearest even), all in
fp32 -- the kernel computes exactly this, so its quantised rows are bit-identical to these.
"""

from __future__ import annotations

import torch

from .activation import PLAIN, Glu, swiglu, swiglu_backward

BLOCK = 128
E4M3_MAX = 448.0
_TINY = 1e-12  # all-zero blocks get a tiny scale instead of a division by zero
# amax * fp32(1/448), not amax / 448: torch's CUDA division by a scalar multiplies by the reciprocal
# while the CPU divides, so this is the one form that is the same bits on CPU, GPU and in the kernels
_INV_MAX = 1.0 / E4M3_MAX


def _check_blocks(t: torch.Tensor, name: str, dims: tuple[int, ...]) -> None:
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    for d in dims:
        if t.shape[d] % BLOCK:
            raise ValueError(f"{name}: dimension {d} of shape {tuple(t.shape)} must be a multiple of {BLOCK}")


def quantize_act_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (e4m3 [T, H], fp32 scales [T, H / 128]) with x ~= q * scale (per 1 x 128 block)."""
    if x.dim() != 2:
        raise ValueError(f"activations must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    _check_blocks(x, "activations", (1,))
    T, H = x.shape
    blocks = x.float().view(T, H // BLOCK, BLOCK)
    scale = (blocks.abs().amax(dim=2) * _INV_MAX).clamp_min(_TINY)
    q = (blocks * torch.reciprocal(scale).unsqueeze(2)).to(torch.float8_e4m3fn).view(T, H)
    return q, scale


def quantize_weight_128x128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], fp32 scales [N / 128, K / 128]) with w ~= q * scale (per block)."""
    if w.dim() != 2:
        raise ValueError(f"weights must be 2-D [out, in], got shape {tuple(w.shape)}")
    _check_blocks(w, "weights", (0, 1))
    N, K = w.shape
    blocks = w.float().view(N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) * _INV_MAX).clamp_min(_TINY)
    q = (blocks * torch.reciprocal(scale)[:, None, :, None]).to(torch.float8_e4m3fn).view(N, K)
    return q, scale


def quantize_tokens_128x1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N] -> (e4m3 [Tp, N], fp32 scales [Tp / 128, N]): one scale per 128 x 1 block (128 consecutive tokens of
    one column), the scaling block along the token dimension -- the K of a weight gradient. T is padded with zero
    rows to Tp, a multiple of 128 (an expert's rows are padded so). The blocks are ``quantize_act_1x128``'s of x^T:
    that quantisation, transposed back."""
    if x.dim() != 2:
        raise ValueError(f"token rows must be 2-D [tokens, features], got shape {tuple(x.shape)}")
    T, N = x.shape
    Tp = -(-T // BLOCK) * BLOCK
    padded_t = torch.zeros((N, Tp), dtype=torch.float32, device=x.device)
    padded_t[:, :T] = x.float().t()
    q, scale = quantize_act_1x128(padded_t)
    return q.t().contiguous(), scale.t().contiguous()


def fp8_wgrad(gq: torch.Tensor, gs: torch.Tensor, aq: torch.Tensor, as_: torch.Tensor) -> torch.Tensor:
    """fp32 dW = g^T @ a [N, K] summed over tokens, from 128 x 1 block-scaled g [Tp, N] and a [Tp, K]
    (``quantize_tokens_128x1``): one 128-token block at a time, its exact e4m3 products summed in fp32 and scaled by
    the outer product of the block's scales (a per-row and a per-column scale: unlike the forward's, the factor
    differs along both dimensions of the output tile)."""
    Tp, N = gq.shape
    if aq.shape[0] != Tp or gs.shape != (Tp // BLOCK, N) or as_.shape != (Tp // BLOCK, aq.shape[1]):
        raise ValueError(
            f"fp8_wgrad: g {tuple(gq.shape)} / scales {tuple(gs.shape)} and a {tuple(aq.shape)} / scales "
            f"{tuple(as_.shape)} must share their padded token count, one scale per 128 tokens and column"
        )
    dw = torch.zeros((N, aq.shape[1]), dtype=torch.float32, device=gq.device)
    for tb in range(Tp // BLOCK):
        sl = slice(tb * BLOCK, (tb + 1) * BLOCK)
        part = gq[sl].float().t() @ aq[sl].float()
        dw += part * gs[tb].unsqueeze(1) * as_[tb].unsqueeze(0)
    return dw


def token_major_operand(rows: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The FP8 weight-gradient GEMM's operand (``megatron_mok.kernel.gemm.fp8_wgrad_gemm``) from token rows [T, F] whose
    experts' segments lie back to back (counts[e] rows each): every segment quantised with ``quantize_tokens_128x1``
    (padded to a multiple of 128 tokens with zeros) and laid out token-contiguous, segments back to back. Returns
    (e4m3 [F, Ktot], fp32 scales [Ktot / 128, F], the padded counts)."""
    if rows.dim() != 2 or sum(counts) > rows.shape[0] or min(counts, default=0) < 0:
        raise ValueError(f"token rows {tuple(rows.shape)} cannot hold expert segments of {list(counts)} rows")
    qs, ss, padded = [], [], []
    start = 0
    for c in counts:
        if c:
            q, sc = quantize_tokens_128x1(rows[start : start + c])
            qs.append(q.t())
            ss.append(sc)
        padded.append(-(-c // BLOCK) * BLOCK)
        start += c
    F = rows.shape[1]
    if not qs:
        return rows.new_empty((F, 0), dtype=torch.float8_e4m3fn), rows.new_empty((0, F), dtype=torch.float32), padded
    return torch.cat(qs, dim=1).contiguous(), torch.cat(ss, dim=0).contiguous(), padded


def fp8_wgrad_grouped(
    a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, counts: list[int]
) -> list[torch.Tensor]:
    """Per expert e the fp32 a_e @ b_e^T over its token columns (``fp8_wgrad`` on each segment) from the token-
    contiguous operands of ``token_major_operand``: a [M, Ktot], b [N, Ktot], counts padded to multiples of 128."""
    out, col = [], 0
    for c in counts:
        if c % BLOCK:
            raise ValueError(f"fp8_wgrad_grouped: {c} tokens is not a multiple of {BLOCK}")
        cols, blocks = slice(col, col + c), slice(col // BLOCK, (col + c) // BLOCK)
        out.append(fp8_wgrad(a[:, cols].t(), sa[blocks], b[:, cols].t(), sb[blocks]))
        col += c
    return out


def dequantize_act(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(BLOCK, dim=1)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)


def fp8_linear(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """fp32 y = x @ w^T from block-scaled operands, one K block at a time (the kernel's order)."""
    T, K = xq.shape
    N = wq.shape[0]
    if wq.shape[1] != K:
        raise ValueError(f"fp8_linear: x has K={K}, w has K={wq.shape[1]}")
    y = torch.zeros((T, N), dtype=torch.float32, device=xq.device)
    ws_rows = ws.repeat_interleave(BLOCK, dim=0)  # [N, K / 128]
    for kb in range(K // BLOCK):
        sl = slice(kb * BLOCK, (kb + 1) * BLOCK)
        part = xq[:, sl].float() @ wq[:, sl].float().t()  # exact products of e4m3 values, fp32 sum
        y += part * xs[:, kb : kb + 1] * ws_rows[:, kb].unsqueeze(0)
    return y


def fp8_expert_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, glu: Glu = PLAIN) -> torch.Tensor:
    """One expert's fc1 -> SwiGLU -> fc2 with the FP8 recipe; x [T, H], w1 [2F, H], w2 [H, F]; bf16 out."""
    xq, xs = quantize_act_1x128(x)
    w1q, w1s = quantize_weight_128x128(w1)
    h = fp8_linear(xq, xs, w1q, w1s)
    act = swiglu(h, glu)
    aq, as_ = quantize_act_1x128(act)  # fused into the SwiGLU epilogue in the kernel
    w2q, w2s = quantize_weight_128x128(w2)
    return fp8_linear(aq, as_, w2q, w2s).to(torch.bfloat16)


def fp8_expert_ffn_backward(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, gy: torch.Tensor, glu: Glu = PLAIN, wgrad: str = "bf16"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dx [T, H], dw1 [2F, H], dw2 [H, F], fp32) of ``fp8_expert_ffn`` for the output
    gradient gy [T, H], with the FP8 recipe the backward kernel follows:

    * dgrad in FP8: dA = gy @ W2 and dX = dH @ W1 quantise gy / dH per 1 x 128 block along their K
      (H / 2F) and read the weights transposed. A 128 x 128 block quantisation of W^T is the transpose
      of W's (same blocks, same amax), so W^T's e4m3 copy and scales are ``wq.t()`` / ``ws.t()``;
    * the SwiGLU backward in fp32 from the forward's fc1 output h;
    * wgrad (token dimension as K), dW2 = gy^T act and dW1 = dH^T x in fp32: ``wgrad="bf16"`` (the backward kernel's)
      from bf16 operands; ``wgrad="fp8"`` (DeepSeek-V3's recipe) from e4m3 operands with one scale per 128
      tokens of each column (``quantize_tokens_128x1``, ``fp8_wgrad``).
    """
    if wgrad not in ("bf16", "fp8"):
        raise ValueError(f"wgrad must be 'bf16' or 'fp8', got {wgrad!r}")
    xq, xs = quantize_act_1x128(x)
    w1q, w1s = quantize_weight_128x128(w1)
    w2q, w2s = quantize_weight_128x128(w2)
    h = fp8_linear(xq, xs, w1q, w1s)  # forward fc1, as fp8_expert_ffn
    act = swiglu(h, glu)
    gyq, gys = quantize_act_1x128(gy)
    d_act = fp8_linear(gyq, gys, w2q.t().contiguous(), w2s.t().contiguous())  # [T, F] = gy @ W2
    dh = swiglu_backward(h, d_act, glu)
    dhq, dhs = quantize_act_1x128(dh)
    dx = fp8_linear(dhq, dhs, w1q.t().contiguous(), w1s.t().contiguous())  # [T, H] = dH @ W1
    if wgrad == "fp8":
        return (
            dx,
            fp8_wgrad(*quantize_tokens_128x1(dh), *quantize_tokens_128x1(x)),
            fp8_wgrad(*quantize_tokens_128x1(gy), *quantize_tokens_128x1(act)),
        )
    bf = torch.bfloat16
    dw2 = gy.to(bf).float().t() @ act.to(bf).float()
    dw1 = dh.to(bf).float().t() @ x.to(bf).float()
    return dx, dw1, dw2
