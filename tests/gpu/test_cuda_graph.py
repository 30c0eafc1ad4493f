"""GPU: MoK launches captured in CUDA graphs (torch.cuda.graph) replay what an eager call computes.

A captured launch's host table (tensor maps, rank table) is read by the graph's copy node on every
replay, so it must be the graph's own, never a pooled staging slot that later eager launches refill: the
tests run eager launches of other shapes between replays and change the static inputs in place. The
kernels are deterministic, so replays must equal eager calls bit for bit.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from emulated import mok_backward_emulated, mok_forward_emulated  # noqa: E402
from mok_truth import make_experts, make_routings  # noqa: E402

pytestmark = pytest.mark.gpu

KW = dict(comm_sms=0, ring_slots=2, minibatch_tokens=256)


def _inputs(R, L, H, F, K, Ts, seed):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    x = [torch.randn((T, H), generator=gen, device=dev).bfloat16() for T in Ts]
    idx, wts = make_routings(Ts, K, R * L, "skewed", dev, gen)
    w1, w2 = make_experts(R, L, H, F, dev, gen)
    return x, idx, wts, w1, w2


def _churn(kernel, seed: int) -> None:
    """Eager launches of another shape (they refill the pooled staging slots)."""
    x, idx, wts, w1, w2 = _inputs(1, 2, 256, 128, 2, [77 + seed], seed)
    for _ in range(3):
        mok_forward_emulated(x, idx, wts, w1, w2, **KW)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_forward_graph_replays_equal_eager_calls(kernel, dtype):
    """EP 1, the layer's launch (EP > 1 launches meet their peers under a new epoch each call: not capturable)."""
    from megatron_mok.kernel.quant import quantize_expert_weights

    R, L, H, F, K = 1, 3, 512, 256, 4
    Ts = [300]
    x, idx, wts, w1, w2 = _inputs(R, L, H, F, K, Ts, seed=6)
    extra = {"fp8": quantize_expert_weights(w1, w2)} if dtype == "fp8" else {}

    def call(check):
        return mok_forward_emulated(x, idx, wts, w1, w2, check=check, **KW, **extra)

    ref_out, ref_comb, _ = call(True)  # also the warm-up: workspace and error record exist before capture
    ref_out, ref_comb = [t.clone() for t in ref_out], [t.clone() for t in ref_comb]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, comb, _ = call("lazy")
    for step in range(3):
        _churn(kernel, step)
        if step == 2:  # new values in the static inputs: the replay must compute on them
            for t in x:
                t.copy_(torch.randn_like(t, dtype=torch.float32).bfloat16())
            ref_out, ref_comb, _ = call(True)
            ref_out, ref_comb = [t.clone() for t in ref_out], [t.clone() for t in ref_comb]
        g.replay()
        torch.cuda.synchronize()
        kernel.check_last_error()
        for r in range(R):
            assert torch.equal(out[r], ref_out[r]), f"replay {step}: out[{r}] differs from the eager call"
            assert torch.equal(comb[r], ref_comb[r]), f"replay {step}: combine[{r}] differs"
    del g
    gc.collect()
    _churn(kernel, 9)  # the graph's retired staging buffer is freed by this launch: nothing breaks
    kernel.check_last_error()


def test_forward_graph_keeps_its_workspace_when_eager_calls_grow_theirs(kernel):
    """Eager launches share one cached workspace, reallocated when a launch needs more; a captured launch
    must not be on it: here a larger eager call frees the cached buffer after the capture and new
    allocations filled with garbage take its memory before the replay."""
    L, H, F, K = 3, 512, 256, 4
    x, idx, wts, w1, w2 = _inputs(1, L, H, F, K, [300], seed=21)
    kw = dict(KW, minibatch_tokens=128)  # a small workspace at capture

    ref_out, ref_comb, _ = mok_forward_emulated(x, idx, wts, w1, w2, **kw)
    ref_out, ref_comb = [t.clone() for t in ref_out], [t.clone() for t in ref_comb]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, comb, _ = mok_forward_emulated(x, idx, wts, w1, w2, check="lazy", **kw)
    big = _inputs(1, 4, 1024, 512, 8, [2000], seed=22)  # needs a larger workspace: the cache grows
    mok_forward_emulated(*big, **dict(KW, minibatch_tokens=1024, ring_slots=3))
    torch.cuda.synchronize()
    # new allocations of every size class take the freed memory
    junk = [
        torch.full((n,), float("nan"), device="cuda") for n in (1 << 14, 1 << 16, 1 << 18, 1 << 20) for _ in range(16)
    ]
    g.replay()
    torch.cuda.synchronize()
    kernel.check_last_error()
    assert torch.equal(out[0], ref_out[0]) and torch.equal(comb[0], ref_comb[0])
    assert all(bool(torch.isnan(j).all()) for j in junk), "the replay wrote into memory it does not own"


def test_backward_graph_replay_equals_eager_call(kernel, bk):
    R, L, H, F, K = 1, 2, 512, 256, 4
    Ts = [300]
    x, idx, wts, w1, w2 = _inputs(R, L, H, F, K, Ts, seed=11)
    gen = torch.Generator(device="cuda").manual_seed(12)
    gos = [torch.randn((T, H), generator=gen, device="cuda").bfloat16() for T in Ts]
    rows = sum(Ts) * K
    hbuf = [torch.empty((rows, 2 * F), dtype=torch.bfloat16, device="cuda") for _ in range(R)]
    _, comb, _ = mok_forward_emulated(x, idx, wts, w1, w2, saved_h=hbuf, **KW)
    kw = dict(comm_sms=2, ring_slots=2, minibatch_tokens=256, saved_h=hbuf)
    ref = mok_backward_emulated(gos, x, idx, wts, comb, w1, w2, **kw)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = mok_backward_emulated(gos, x, idx, wts, comb, w1, w2, check="lazy", **kw)
    _churn(kernel, 1)
    g.replay()
    torch.cuda.synchronize()
    kernel.check_last_error()
    for r in range(R):
        assert torch.equal(got[0][r], ref[0][r]) and torch.equal(got[1][r], ref[1][r])
        for e in range(L):
            assert torch.equal(got[2][r][e], ref[2][r][e]) and torch.equal(got[3][r][e], ref[3][r][e])


def test_capture_refuses_what_a_replay_cannot_do(kernel, bk):
    x, idx, wts, w1, w2 = _inputs(1, 2, 256, 128, 2, [100], seed=3)
    mok_forward_emulated(x, idx, wts, w1, w2, **KW)  # warm-up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        with pytest.raises(ValueError, match="check=True synchronises the host, which CUDA graph capture forbids"):
            mok_forward_emulated(x, idx, wts, w1, w2, check=True, **KW)
        comb = torch.zeros((100, 2, 256), dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match=r"wgrad='mm'\) cannot be captured in a CUDA graph"):
            mok_backward_emulated(x, x, idx, wts, [comb], w1, w2, wgrad="mm", check=False, **dict(KW, comm_sms=2))
