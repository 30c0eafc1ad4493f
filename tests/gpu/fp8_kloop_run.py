"""Subprocess body of test_fp8_kloop.py: the FP8 forward and dgrad of a few cases with the library this
process builds (MOK_FP8_KLOOP / MOK_FP8_ORDERED / MOK_FP8_SRC_QUANT are read at build time), saved to argv[1]
with the build choices the loaded library reports, for a bitwise comparison; with argv[2] == "refusal", instead
a launch with MOK_FP8_ISSUE_ORDER=1 whose error is printed."""

from __future__ import annotations

import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mok_truth import make_backward_case  # noqa: E402

# R, L, H, F, K, Ts, mode, comm, slots, minibatch, forward launcher knobs: odd / even K-block counts (the
# pipelined loop runs blocks in pairs plus a remainder: H / 128 = 3, 4; F / 128 = 3, 1, 2), a ring that wraps,
# EP 4, and the every-feature FP8 instance (token chunks, 2-CTA clusters: EP 1, even comm_sms)
CASES = [
    (1, 3, 384, 384, 4, [700], "skewed", 2, 2, 128, {}),
    (2, 3, 512, 128, 4, [200, 333], "minus1", 0, 3, 128, {}),
    (4, 2, 256, 256, 2, [64, 0, 130, 257], "empty", 1, 2, 64, {}),
    (1, 3, 384, 256, 4, [600], "skewed", 0, 2, 128, {"MOK_MACROBATCHES": "2"}),
    (1, 2, 256, 384, 2, [500], "uniform", 2, 2, 128, {"MOK_CLUSTER": "2"}),
]


def main(path: str) -> None:
    import megatron_mok.kernel as kernel
    from megatron_mok.kernel import backward
    from megatron_mok.kernel.fp8_weights import quantize_expert_weights

    dev = torch.device("cuda")
    out = {}
    for n, (R, L, H, F, K, Ts, mode, comm, slots, mb, knobs) in enumerate(CASES):
        x, idx, wts, w1, w2, go = make_backward_case(R, L, H, F, K, Ts, mode, 100 + n)
        q8 = quantize_expert_weights(w1, w2, transposed=True)
        saved = [torch.zeros((max(1, sum(Ts) * K), 2 * F), dtype=torch.bfloat16, device=dev) for _ in range(R)]
        kw = dict(comm_sms=comm, ring_slots=slots, minibatch_tokens=mb)
        with mock.patch.dict(os.environ, knobs):  # the forward launcher reads its knobs per launch
            o, comb, _ = kernel.mok_forward_emulated(x, idx, wts, w1, w2, fp8=q8, saved_h=saved, **kw)
        comb = [c.view(T, K, H) for c, T in zip(comb, Ts)]
        bkw = dict(kw, comm_sms=max(comm, 1))  # the backward has no in-SM pull: >= 1 comm SM
        gx, gw, g1, g2 = backward.mok_backward_emulated(
            go, x, idx, wts, comb, w1, w2, saved_h=saved, fp8=q8, timeout_ms=4000.0, **bkw
        )
        torch.cuda.synchronize()
        out[n] = {
            "out": [t.cpu() for t in o],
            "combine": [t.cpu() for t in comb],
            "h": [t.cpu() for t in saved],
            "grad_x": [t.cpu() for t in gx],
            "grad_w": [t.cpu() for t in gw],
            "grad_w1": [torch.stack(t).cpu() for t in g1],
            "grad_w2": [torch.stack(t).cpu() for t in g2],
        }
    built = {"ordered": kernel.fp8_issue_order_built(), "src_quant": kernel.fp8_src_quant_built()}
    torch.save({"cases": out, "built": built}, path)


def refusal() -> None:
    import megatron_mok.kernel as kernel
    from megatron_mok.kernel.fp8_weights import quantize_expert_weights

    R, L, H, F, K, Ts, mode, comm, slots, mb, _ = CASES[0]
    x, idx, wts, w1, w2, _ = make_backward_case(R, L, H, F, K, Ts, mode, 100)
    os.environ["MOK_FP8_ISSUE_ORDER"] = "1"
    try:
        kernel.mok_forward_emulated(
            x,
            idx,
            wts,
            w1,
            w2,
            fp8=quantize_expert_weights(w1, w2),
            comm_sms=comm,
            ring_slots=slots,
            minibatch_tokens=mb,
        )
    except Exception as exc:  # the launcher's error, printed for the test to match
        print(f"REFUSED: {exc}")
        return
    print("ACCEPTED")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "refusal":
        refusal()
    else:
        main(sys.argv[1])
