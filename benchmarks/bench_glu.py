"""What Megatron's clamped / offset SwiGLU costs in the MoK kernels: the plain SwiGLU and the variant
(glu_linear_offset, activation_func_clamp_value) timed in interleaved rounds of one run, forward bf16 / fp8 and
the bf16 backward (saved fc1 output), on a model slice (default Kimi-K2: hidden 7168, ffn 2048, 8 local
experts, top-8, 8192 tokens, EP 1, the kimi-k2 config's kernel settings). Prints the variant's time over the plain one's (median of the rounds'
medians) and, with --json, writes the figures there.

    python benchmarks/bench_glu.py [--tokens 8192] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_common import make_inputs, pipelined  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))
from emulated import mok_backward_emulated, mok_forward_emulated  # noqa: E402
from result_file import write_result  # noqa: E402

from megatron_mok.activation import PLAIN, Glu  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--offset", type=float, default=1.0)
    ap.add_argument("--clamp", type=float, default=7.0)
    ap.add_argument("--comm-sms", type=int, default=0)
    ap.add_argument("--bwd-comm-sms", type=int, default=8)
    ap.add_argument("--bwd-minibatch", type=int, default=6144)
    ap.add_argument("--minibatch", type=int, default=4096)
    ap.add_argument("--ring-slots", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from megatron_mok import kernel
    from megatron_mok.kernel.quant import quantize_expert_weights

    if not kernel.is_available():
        print(f"MoK kernel unavailable: {kernel.unavailable_reason()}")
        return 1
    H, F, L, K, T = args.hidden, args.ffn, args.experts, args.topk, args.tokens
    x, idx, w, w1, w2, go = make_inputs(H, F, K, L, T, grad=True)
    w1l, w2l = [list(w1.unbind(0))], [list(w2.unbind(0))]
    q8 = quantize_expert_weights(w1l, w2l)
    saved = [torch.empty((T * K, 2 * F), dtype=torch.bfloat16, device="cuda")]
    fwd_kw = dict(comm_sms=args.comm_sms, ring_slots=args.ring_slots, minibatch_tokens=args.minibatch, check=False)
    variant = Glu(offset=args.offset, clamp=args.clamp)

    def forward(glu, fp8):
        return lambda: mok_forward_emulated(
            [x], [idx], [w], w1l, w2l, fp8=q8 if fp8 else None, saved_h=saved, glu=glu, **fwd_kw
        )

    combs = {}
    for name, glu in (("plain", PLAIN), ("variant", variant)):
        _, comb, _ = forward(glu, False)()
        combs[name] = [comb[0].view(T, K, H).clone()]
    h = [saved[0].clone()]  # the fc1 output: the same for both (the variant acts after it)

    def backward(name):
        glu = PLAIN if name == "plain" else variant
        return lambda: mok_backward_emulated(
            [go],
            [x],
            [idx],
            [w],
            combs[name],
            w1l,
            w2l,
            comm_sms=args.bwd_comm_sms,
            ring_slots=args.ring_slots,
            minibatch_tokens=args.minibatch,
            saved_h=h,
            glu=glu,
            check=False,
        )

    fns = {
        ("forward bf16", "plain"): forward(PLAIN, False),
        ("forward bf16", "variant"): forward(variant, False),
        ("forward fp8", "plain"): forward(PLAIN, True),
        ("forward fp8", "variant"): forward(variant, True),
        ("backward bf16", "plain"): backward("plain"),
        ("backward bf16", "variant"): backward("variant"),
    }
    times: dict[tuple[str, str], list[float]] = {k: [] for k in fns}
    for r in range(args.rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(list(fns)))
        for key in order:
            times[key].append(pipelined(fns[key], args.iters, 2))
    print(
        f"{torch.cuda.get_device_name()}: H {H} F {F} L {L} top-{K} T {T}, {variant.describe()}, {args.rounds} rounds"
    )
    result = {"device": torch.cuda.get_device_name(), "shape": [H, F, L, K, T], "glu": [args.offset, args.clamp]}
    for what in ("forward bf16", "forward fp8", "backward bf16"):
        p, v = statistics.median(times[(what, "plain")]), statistics.median(times[(what, "variant")])
        print(f"  {what:14s} plain {p:8.3f} ms  variant {v:8.3f} ms  variant / plain {v / p:.3f}")
        result[what] = {"plain_ms": p, "variant_ms": v, "ratio": v / p}
    if args.json:
        write_result(args.json, "bench_glu", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
