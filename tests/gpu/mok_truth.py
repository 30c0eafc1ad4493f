"""Dense torch fp32 ground truth for the MoK forward kernel and input generators (GPU tests, bench)."""

from __future__ import annotations

import contextlib
import math

import torch

from megatron_mok.activation import PLAIN, swiglu, swiglu_backward


def make_experts(R, L, H, F, device, gen, strided=False):
    """w1[q][e] [2F, H] (rows 0..F-1 gate, F..2F-1 up), w2[q][e] [H, F]; bf16, scaled for unit-ish outputs."""
    w1, w2 = [], []
    for _q in range(R):
        if strided:  # views into one stacked tensor with padding between rows (unit inner stride)
            big1 = torch.randn((L, 2 * F, H + 64), generator=gen, device=device) / math.sqrt(H)
            big2 = torch.randn((L, H, F + 64), generator=gen, device=device) / math.sqrt(F)
            b1, b2 = big1.bfloat16(), big2.bfloat16()
            w1.append([b1[e, :, :H] for e in range(L)])
            w2.append([b2[e, :, :F] for e in range(L)])
        else:
            w1.append(
                [(torch.randn((2 * F, H), generator=gen, device=device) / math.sqrt(H)).bfloat16() for _ in range(L)]
            )
            w2.append([(torch.randn((H, F), generator=gen, device=device) / math.sqrt(F)).bfloat16() for _ in range(L)])
    return w1, w2


def make_routing(T, K, E, mode, device, gen):
    """topk_idx [T, K] int32 and weights [T, K] float32 for a routing mode."""
    if T == 0:
        return (
            torch.empty((0, K), dtype=torch.int32, device=device),
            torch.empty((0, K), dtype=torch.float32, device=device),
        )
    if mode in ("uniform", "minus1"):
        p = torch.ones((T, E), device=device)
    elif mode == "skewed":
        p = (1.0 / torch.arange(1, E + 1, device=device, dtype=torch.float32) ** 1.3).expand(T, E).contiguous()
    elif mode == "empty":  # only every third expert is ever chosen
        p = torch.zeros((T, E), device=device)
        p[:, ::3] = 1.0
    elif mode == "one":
        p = None
    else:
        raise ValueError(mode)
    if p is None:
        idx = torch.full((T, K), E // 2, dtype=torch.int64, device=device)  # every slot -> one expert
    else:
        kk = min(K, int((p[0] > 0).sum()))
        idx = torch.multinomial(p, kk, replacement=False, generator=gen)
        if kk < K:
            idx = torch.cat([idx, torch.full((T, K - kk), -1, dtype=torch.int64, device=device)], 1)
    if mode == "minus1":
        drop = torch.rand((T, K), generator=gen, device=device) < 0.25
        idx = torch.where(drop, torch.full_like(idx, -1), idx)
        idx[: max(1, T // 10)] = -1  # some tokens with no valid slot at all
    w = torch.rand((T, K), generator=gen, device=device) + 0.1
    w = w / w.sum(1, keepdim=True)
    return idx.to(torch.int32).contiguous(), w.float().contiguous()


def make_routings(Ts, K, E, mode, device, gen):
    """make_routing for each rank's token count in Ts (drawn in rank order): (idx list, weight list)."""
    idx, wts = [], []
    for T in Ts:
        i, w = make_routing(T, K, E, mode, device, gen)
        idx.append(i)
        wts.append(w)
    return idx, wts


def make_backward_case(R, L, H, F, K, Ts, mode, seed):
    """A seeded emulated-EP backward case on the GPU, drawn in a fixed order: x (bf16 per rank), routing
    (make_routings), experts (make_experts), output gradients. Returns (x, idx, wts, w1, w2, grad_out)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    x = [torch.randn((T, H), generator=gen, device=dev).bfloat16() for T in Ts]
    idx, wts = make_routings(Ts, K, R * L, mode, dev, gen)
    w1, w2 = make_experts(R, L, H, F, dev, gen)
    go = [torch.randn((T, H), generator=gen, device=dev).bfloat16() for T in Ts]
    return x, idx, wts, w1, w2, go


@contextlib.contextmanager
def _no_tf32():
    """fp32 matmuls in full precision on the GPU (restores the caller's setting)."""
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32


def _topk_sum(x, topk_idx, topk_weight, combs):
    """out[r] = bf16(sum_k w[t, k] * combine[r][t, k]) in fp32, k ascending, slots with idx -1 skipped:
    the kernel's final weighted sum."""
    outs = []
    for r in range(len(x)):
        valid = (topk_idx[r] >= 0).float() * topk_weight[r]
        acc = torch.zeros((x[r].shape[0], x[r].shape[1]), dtype=torch.float32, device=x[r].device)
        for k in range(topk_idx[r].shape[1]):  # k order, fp32
            acc += valid[:, k : k + 1] * combs[r][:, k].float()
        outs.append(acc.bfloat16())
    return outs


@torch.no_grad()
def ground_truth(x, topk_idx, topk_weight, w1, w2):
    """Returns (out[r], combine[r], tokens_per_expert[q]) with the kernel's numerics (fp32 math, bf16 roundings)."""
    R, L = len(x), len(w1[0])
    with _no_tf32():
        combs = [
            torch.zeros((t.shape[0], i.shape[1], t.shape[1]), dtype=torch.bfloat16, device=t.device)
            for t, i in zip(x, topk_idx)
        ]
        tpe = [torch.zeros((L,), dtype=torch.int32, device=x[0].device) for _ in range(R)]
        for q in range(R):
            for e in range(L):
                g = q * L + e
                W1 = w1[q][e].float()
                W2 = w2[q][e].float()
                F = W2.shape[1]
                cnt = 0
                for r in range(R):
                    tt, kk = torch.nonzero(topk_idx[r] == g, as_tuple=True)
                    if tt.numel() == 0:
                        continue
                    cnt += tt.numel()
                    h = x[r][tt].float() @ W1.t()
                    gg, uu = h[:, :F], h[:, F:]
                    a = (gg * torch.sigmoid(gg) * uu).bfloat16().float()
                    combs[r][tt, kk] = (a @ W2.t()).bfloat16()
                tpe[q][e] = cnt
        return _topk_sum(x, topk_idx, topk_weight, combs), combs, tpe


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    if b.numel() == 0:
        return 0.0
    den = b.norm().item()
    num = (a - b).norm().item()
    if den == 0.0:
        return num
    return num / den


@torch.no_grad()
def ground_truth_fp8(x, topk_idx, topk_weight, w1, w2, glu=None):
    """The FP8 recipe (megatron_mok.fp8: 1 x 128 activation / 128 x 128 weight block scales, fp32
    accumulation one K block at a time, bf16 y) applied row by row as the FP8 kernel does.
    Returns (out[r], combine[r], h[q]): h[q] is owner q's fp32 fc1 output [rows, 2F] in layout order
    (expert, then source rank, token, k), what the kernel keeps as saved h."""
    from megatron_mok import fp8

    R, L = len(x), len(w1[0])
    combs = [
        torch.zeros((t.shape[0], i.shape[1], t.shape[1]), dtype=torch.bfloat16, device=t.device)
        for t, i in zip(x, topk_idx)
    ]
    hs = []
    for q in range(R):
        hq = []
        for e in range(L):
            g = q * L + e
            w1q, w1s = fp8.quantize_weight_128x128(w1[q][e])
            w2q, w2s = fp8.quantize_weight_128x128(w2[q][e])
            for r in range(R):
                tt, kk = torch.nonzero(topk_idx[r] == g, as_tuple=True)
                if tt.numel() == 0:
                    continue
                xq, xs = fp8.quantize_act_1x128(x[r][tt])
                h = fp8.fp8_linear(xq, xs, w1q, w1s)
                hq.append(h)
                a = swiglu(h, glu or PLAIN)
                aq, as_ = fp8.quantize_act_1x128(a)
                combs[r][tt, kk] = fp8.fp8_linear(aq, as_, w2q, w2s).bfloat16()
        F2 = 2 * w2[q][0].shape[1]
        hs.append(torch.cat(hq) if hq else torch.zeros((0, F2), device=x[0].device))
    return _topk_sum(x, topk_idx, topk_weight, combs), combs, hs


@torch.no_grad()
def exact_fp32(x, topk_idx, topk_weight, w1, w2, glu=None):
    """The MoE layer in fp32 from the bf16 inputs, no intermediate roundings (error yardstick)."""
    R, L = len(x), len(w1[0])
    with _no_tf32():
        outs = [torch.zeros((t.shape[0], t.shape[1]), dtype=torch.float32, device=t.device) for t in x]
        for q in range(R):
            for e in range(L):
                g = q * L + e
                for r in range(R):
                    tt, kk = torch.nonzero(topk_idx[r] == g, as_tuple=True)
                    if tt.numel() == 0:
                        continue
                    h = x[r][tt].float() @ w1[q][e].float().t()
                    a = swiglu(h, glu or PLAIN)
                    y = a @ w2[q][e].float().t()
                    outs[r].index_add_(0, tt, y * topk_weight[r][tt, kk].unsqueeze(1))
        return outs


@torch.no_grad()
def ground_truth_fp8_backward(x, topk_idx, topk_weight, w1, w2, grad_out, combine, saved_h, glu=None):
    """The FP8 dgrad recipe the backward kernel follows (``kernel.dtype fp8``), row by row in layout order
    from the kernel's own saved fc1 output ``saved_h[q]`` (bf16 [rows, 2F], layout order) and forward
    ``combine[r]`` [T, K, H]:

    * gy = bf16(w * grad_out), quantised 1 x 128; dA = gy @ W2 through the e4m3 W2^T (fp32 accumulation);
    * SwiGLU backward in fp32 from h, dH rounded to bf16, then quantised 1 x 128; dX = dH @ W1 through the
      e4m3 W1^T, rounded to bf16 per (token, k) and summed over k in fp32;
    * wgrad from the bf16 operands in fp32: dW2 = gy^T act (act = bf16(silu(g) * u)), dW1 = dH^T x;
    * grad_w[t, k] = <grad_out[t], combine[t, k]> in fp32.

    Returns (grad_x[r] bf16, grad_w[r] fp32, dW1[q][e] fp32, dW2[q][e] fp32)."""
    from megatron_mok import fp8

    R, L = len(x), len(w1[0])
    bufs = [
        torch.zeros((t.shape[0], i.shape[1], t.shape[1]), dtype=torch.bfloat16, device=t.device)
        for t, i in zip(x, topk_idx)
    ]
    dw1 = [[None] * L for _ in range(R)]
    dw2 = [[None] * L for _ in range(R)]
    with _no_tf32():
        for q in range(R):
            row = 0
            for e in range(L):
                g = q * L + e
                w1q, w1s = fp8.quantize_weight_128x128(w1[q][e])
                w2q, w2s = fp8.quantize_weight_128x128(w2[q][e])
                d1 = torch.zeros(w1[q][e].shape, dtype=torch.float32, device=x[0].device)
                d2 = torch.zeros(w2[q][e].shape, dtype=torch.float32, device=x[0].device)
                for r in range(R):
                    tt, kk = torch.nonzero(topk_idx[r] == g, as_tuple=True)
                    n = tt.numel()
                    if n == 0:
                        continue
                    h = saved_h[q][row : row + n].float()
                    row += n
                    gy = (topk_weight[r][tt, kk, None] * grad_out[r][tt].float()).bfloat16().float()
                    gq, gs = fp8.quantize_act_1x128(gy)
                    d_act = fp8.fp8_linear(gq, gs, w2q.t().contiguous(), w2s.t().contiguous())
                    dh = swiglu_backward(h, d_act, glu or PLAIN).bfloat16().float()
                    hq, hs = fp8.quantize_act_1x128(dh)
                    dx = fp8.fp8_linear(hq, hs, w1q.t().contiguous(), w1s.t().contiguous())
                    bufs[r][tt, kk] = dx.bfloat16()
                    act = swiglu(h, glu or PLAIN).bfloat16().float()
                    d2 += gy.t() @ act
                    d1 += dh.t() @ x[r][tt].float()
                dw1[q][e], dw2[q][e] = d1, d2
    gx, gw = [], []
    for r in range(R):
        valid = topk_idx[r] >= 0
        acc = torch.zeros(x[r].shape, dtype=torch.float32, device=x[r].device)
        for k in range(topk_idx[r].shape[1]):
            acc += valid[:, k : k + 1].float() * bufs[r][:, k].float()
        gx.append(acc.bfloat16())
        dots = (grad_out[r].float()[:, None, :] * combine[r].float()).sum(-1)
        gw.append(torch.where(valid, dots, torch.zeros_like(dots)))
    return gx, gw, dw1, dw2


def exact_fp32_grads(x, topk_idx, topk_weight, w1, w2, grad_out):
    """Gradients of the unquantised fp32 layer (bf16 inputs, no intermediate roundings) by autograd:
    (grad_x[r], grad_w[r], dW1[q][e], dW2[q][e]), all fp32 (error yardstick of the FP8 backward)."""
    R, L = len(x), len(w1[0])
    with _no_tf32(), torch.enable_grad():
        xs = [t.float().requires_grad_() for t in x]
        ws = [t.float().requires_grad_() for t in topk_weight]
        W1 = [[w.float().requires_grad_() for w in per] for per in w1]
        W2 = [[w.float().requires_grad_() for w in per] for per in w2]
        loss = torch.zeros((), device=x[0].device)
        for r in range(R):
            out = torch.zeros(x[r].shape, dtype=torch.float32, device=x[r].device)
            for q in range(R):
                for e in range(L):
                    tt, kk = torch.nonzero(topk_idx[r] == q * L + e, as_tuple=True)
                    if tt.numel() == 0:
                        continue
                    F = w2[q][e].shape[1]
                    h = xs[r][tt] @ W1[q][e].t()
                    y = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ W2[q][e].t()
                    out = out.index_add(0, tt, y * ws[r][tt, kk, None])
            loss = loss + (out * grad_out[r].float()).sum()
        loss.backward()
    zero = lambda t: t.grad if t.grad is not None else torch.zeros_like(t)  # noqa: E731
    return (
        [zero(t) for t in xs],
        [zero(t) for t in ws],
        [[zero(w) for w in per] for per in W1],
        [[zero(w) for w in per] for per in W2],
    )
