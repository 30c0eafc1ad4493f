"""GPU tests of the forward's token chunks (kernel.macrobatches = B > 1, EP 1; ring_buffer.cuh: seg_table).

The rows are processed in B chunks of tokens, each expert's rows cut on the 128-row tile grid, so the final
sum of a chunk's tokens runs while later chunks' GEMMs do. Every row's result and every token's k-ordered
fp32 sum are the same computation in any order: outputs, combine rows, tokens per expert, the saved fc1
output and the kept rows must equal the B = 1 launch's bit for bit, and the backward on top of them too.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from emulated import mok_forward_emulated  # noqa: E402
from mok_truth import KEPT_AND_BACKWARD, kept_rows_and_backward, make_backward_case  # noqa: E402

from megatron_mok.kernel.tuning import ForwardTuning  # noqa: E402

pytestmark = pytest.mark.gpu


def _launch(kernel, B, x, idx, wts, w1, w2, **kw):
    got = mok_forward_emulated(x, idx, wts, w1, w2, tuning=ForwardTuning(macrobatches=B), **kw)
    torch.cuda.synchronize()
    return got


@pytest.mark.parametrize("B", [2, 3, 4, 8])
@pytest.mark.parametrize("comm", [2, 0], ids=["comm2", "insm"])
@pytest.mark.parametrize("mode", ["uniform", "skewed", "minus1"])
@pytest.mark.parametrize("slots", [2, 32], ids=["ring", "roomy"])
def test_token_chunks_give_the_same_bits(kernel, B, comm, mode, slots):
    """ring: the ring wraps, so the early sums start only after most minibatches are done; roomy: a slot per
    minibatch, the pulls end at once and the early sums wait on each chunk's minibatches."""
    L, H, F, K, T = 4, 512, 256, 4, 1500  # 12 token chunks of 128: several per macrobatch
    x, idx, wts, w1, w2, _ = make_backward_case(1, L, H, F, K, [T], mode, seed=40 + B)
    rows = T * K
    kw = dict(comm_sms=comm, ring_slots=slots, minibatch_tokens=256)

    def run(b):
        h = [torch.full((rows, 2 * F), float("nan"), dtype=torch.bfloat16, device="cuda")]
        out, comb, tpe = _launch(kernel, b, x, idx, wts, w1, w2, saved_h=h, **kw)
        return out[0], comb[0], tpe[0], h[0].nan_to_num(7.0)

    ref = run(1)
    got = run(B)
    for name, a, b in zip(("out", "combine", "tokens_per_expert", "saved h"), got, ref):
        assert torch.equal(a, b), f"B={B}: {name} differs from the unchunked launch"


def test_token_chunks_fp8_and_few_tokens(kernel):
    """FP8 kernel; and more chunks than 128-token chunks of tokens (empty chunks, empty segments)."""
    from megatron_mok.kernel.quant import quantize_expert_weights

    for T, B, comm, slots in ((1100, 4, 0, 2), (1100, 4, 2, 32), (200, 8, 0, 2), (200, 8, 2, 2)):
        x, idx, wts, w1, w2, _ = make_backward_case(1, 3, 256, 256, 2, [T], "skewed", seed=T)
        kw = dict(comm_sms=comm, ring_slots=slots, minibatch_tokens=128, fp8=quantize_expert_weights(w1, w2))
        a = _launch(kernel, 1, x, idx, wts, w1, w2, **kw)
        b = _launch(kernel, B, x, idx, wts, w1, w2, **kw)
        same = torch.equal(a[0][0], b[0][0]) and torch.equal(a[1][0], b[1][0])
        assert same, f"T={T} B={B} comm={comm}: fp8 output differs"


def test_token_chunks_with_kept_rows_and_backward(kernel):
    """Kept rows sit at their layout rows whatever the processing order: the backward gives the same bits."""
    one, four = ForwardTuning(macrobatches=1), ForwardTuning(macrobatches=4)
    res = kept_rows_and_backward(kernel, (one, four))
    for name, a, b in zip(KEPT_AND_BACKWARD, res[four], res[one]):
        assert torch.equal(a, b), f"{name} differs with token chunks"


def test_token_chunks_refuse_what_they_do_not_cover(kernel):
    x, idx, wts, w1, w2, _ = make_backward_case(2, 2, 256, 256, 2, [300, 300], "uniform", seed=1)
    kw = dict(comm_sms=2, ring_slots=2, minibatch_tokens=128)
    with pytest.raises(ValueError, match="kernel.macrobatches=2 needs EP 1"):
        mok_forward_emulated(x, idx, wts, w1, w2, tuning=ForwardTuning(macrobatches=2), **kw)
    for bad in (-1, 65):
        with pytest.raises(ValueError, match="kernel.macrobatches must be an integer"):
            one = ([x[0]], [idx[0]], [wts[0]], [w1[0]], [w2[0]])
            mok_forward_emulated(*one, tuning=ForwardTuning(macrobatches=bad), **kw)
    x, idx, wts, w1, w2, _ = make_backward_case(1, 200, 128, 128, 2, [300], "uniform", seed=2)
    with pytest.raises(ValueError, match="row segments"):  # 3 x 200 segments > 512
        mok_forward_emulated(x, idx, wts, w1, w2, tuning=ForwardTuning(macrobatches=3), **kw)
