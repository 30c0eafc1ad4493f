"""Subprocess body of test_fp8_kloop.py: the FP8 forward and dgrad of a few cases (emulated EP) and the FP8 forward
of per-rank launches, with the library this process builds (MOK_FP8_KLOOP / MOK_FP8_ORDERED / MOK_FP8_SRC_QUANT /
MOK_FP8_SCALE_KMAJOR are read at build time), saved to argv[1] with the build choices the loaded library reports, for a bitwise
comparison; with argv[2] == "refusal", instead a launch with MOK_FP8_ISSUE_ORDER=1 whose error is printed."""

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
    for n, case in enumerate(RANK_CASES):
        out[f"rank{n}"] = rank_case(n, *case)
    torch.save({"cases": out, "built": kernel.library_build(), "fp8_sources_refusal": fp8_sources_refusal()}, path)


# Per-rank launches (the real-EP path: R launches on R streams sharing the GPU, meeting on signal pads):
# R, L, H, F, K, T per rank, mode, comm, slots, minibatch, launcher knobs. With MOK_FP8_SRC_QUANT=1 each rank
# quantises its own tokens into its region and peers pull them after its signal. Two calls each, the second
# ordered after the first by the streams alone (epochs; a copy rewritten while no host sync separates the calls).
RANK_CASES = [
    (1, 3, 256, 256, 4, 300, "skewed", 2, 2, 128, {}),
    (2, 3, 512, 256, 4, 300, "minus1", 2, 2, 128, {}),
    (4, 2, 384, 256, 2, 200, "skewed", 0, 2, 64, {}),
    (2, 2, 256, 384, 2, 250, "uniform", 2, 2, 128, {"MOK_CLUSTER": "2"}),
]


def rank_case(n, R, L, H, F, K, T, mode, comm, slots, mb, knobs) -> dict:
    import megatron_mok.kernel as kernel
    from megatron_mok.kernel.emulated import check_pending_errors
    from megatron_mok.kernel.fp8_weights import quantize_expert_weights
    from megatron_mok.kernel.peer_ep import PeerBuffers, mok_forward_rank

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bufs = PeerBuffers.on_one_gpu(R, T, H, K)  # with the source-quantised copy when this build needs it
    assert (bufs[0].xq is not None) == kernel.fp8_src_quant_built()
    streams = [torch.cuda.Stream() for _ in range(R)]
    res: dict = {"out": [], "combine": []}
    inputs = []  # every call's inputs stay alive until the end: no host sync tells when a launch has read them
    for call in range(2):
        x, idx, wts, w1, w2, _ = make_backward_case(R, L, H, F, K, [T] * R, mode, 200 + 10 * n + call)
        q8 = [quantize_expert_weights([w1[r]], [w2[r]]) for r in range(R)]
        inputs.append((x, idx, wts, w1, w2, q8))
        for r in range(R):
            streams[r].wait_stream(torch.cuda.current_stream())
            with mock.patch.dict(os.environ, knobs), torch.cuda.stream(streams[r]):
                o, comb, _ = mok_forward_rank(
                    bufs[r], x[r], idx[r], wts[r], w1[r], w2[r], fp8=q8[r], comm_sms=comm, ring_slots=slots,
                    minibatch_tokens=mb, ctas=sms // R, stream=streams[r], check="lazy", timeout_ms=4000.0,
                )  # fmt: skip
                res["out"].append(o)
                res["combine"].append(comb.clone())  # a view of the region: the next call overwrites it
    check_pending_errors(wait=True)  # every launch's error record, after both calls
    torch.cuda.synchronize()
    return {k: [t.cpu() for t in v] for k, v in res.items()}


def fp8_sources_refusal() -> str:
    """An FP8 per-rank launch over regions without the source copy: '' where this build does not need one,
    else the refusal's message."""
    from megatron_mok.kernel.fp8_weights import quantize_expert_weights
    from megatron_mok.kernel.peer_ep import PeerBuffers, mok_forward_rank

    x, idx, wts, w1, w2, _ = make_backward_case(1, 2, 256, 256, 2, [64], "uniform", 7)
    bufs = PeerBuffers.on_one_gpu(1, 64, 256, 2, fp8_sources=False)
    try:
        mok_forward_rank(
            bufs[0], x[0], idx[0], wts[0], w1[0], w2[0], fp8=quantize_expert_weights([w1[0]], [w2[0]]),
            comm_sms=2, ring_slots=2, minibatch_tokens=64,
        )  # fmt: skip
    except ValueError as exc:
        return str(exc)
    return ""


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
