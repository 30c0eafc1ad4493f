"""The MoE layer's plain per-token math with autograd: the definition the reference is checked against."""

from __future__ import annotations

import torch

from megatron_mok.activation import swiglu


def dense_grads(xs, idx, ws, w1, w2, R):
    """Per-token definition with autograd: out[t] = sum_k w[t,k] * fc2(swiglu(fc1(x[t])))."""
    xx = [x.clone().requires_grad_() for x in xs]
    ww = [w.clone().requires_grad_() for w in ws]
    a = [w.clone().requires_grad_() for w in w1]
    b = [w.clone().requires_grad_() for w in w2]
    outs, loss = [], 0
    for r in range(R):
        o = torch.zeros_like(xx[r])
        for k in range(idx[r].shape[1]):
            for e in idx[r][:, k].unique().tolist():
                sel = idx[r][:, k] == e
                if e >= 0:
                    o = o.index_add(
                        0, sel.nonzero().flatten(), ww[r][sel, k, None] * (swiglu(xx[r][sel] @ a[e].t()) @ b[e].t())
                    )
        outs.append(o)
        loss = loss + (o * (r + 1)).sum() + (o**2).sum()
    if loss.requires_grad:  # (no token anywhere: no graph, every gradient zero)
        loss.backward()
    z = lambda t, like: t if t is not None else torch.zeros_like(like)  # noqa: E731
    return (
        outs,
        [z(x.grad, x) for x in xx],
        [z(w.grad, w) for w in ww],
        [z(t.grad, t) for t in a],
        [z(t.grad, t) for t in b],
    )
