"""Prove a refactor of the kernels on one GPU: two checkouts' kernels side by side, same inputs, same bits,
timings interleaved.

Each tree runs in processes of its own (its own ``megatron_mok`` and library, built once into the shared cache):
round after round, the trees alternate (in a fresh order per round), and each process runs every case -- the
Kimi-K2 and DeepSeek-V3 slices (hidden 7168, ffn 2048, top-8, 8192 tokens, EP 1; 8 / 32 local experts), bf16
and FP8, forward and backward with the shipped configs' kernel settings -- on inputs drawn from fixed seeds. It
records a bit-exact checksum of every output and gradient and the median device time of the forward and the
backward. The summary compares the checksums across trees and rounds (any difference fails) and prints each
tree's median time per case, the ratio of the trees, and each tree's spread over the rounds.

    python tools/compare_trees.py --tree before=/tmp/before --tree after=. --rounds 3 --json out.json

A tree is a checkout (its ``megatron_mok`` is imported from there); the first is the baseline. A tree launches
through ``kernel.mok_forward`` / ``kernel.mok_backward`` (the PyTorch operators) or, in older checkouts, through
``kernel.mok_forward_emulated`` / ``kernel.backward.mok_backward_emulated`` at one rank; the host time per call
(the Python call alone, the GPU busy behind it) is printed beside the device times.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# (name, local experts); both at hidden 7168, ffn 2048, top-8, 8192 tokens
SLICES = {"kimi-k2": 8, "deepseek-v3": 32}
H, F, K, T = 7168, 2048, 8, 8192
# the shipped configs' kernel settings (configs/kimi-k2*.yaml): forward in-SM pull, ring 4 x 4096; backward
FORWARD = dict(comm_sms=0, ring_slots=4, minibatch_tokens=4096)
BACKWARD = {"bf16": dict(comm_sms=8, minibatch_tokens=6144), "fp8": dict(comm_sms=28, minibatch_tokens=6144)}


def checksum(t) -> str:
    """A bit-exact fingerprint of a tensor (its bytes as int32 words, summed plainly and position-weighted in
    int64 on the GPU; any changed bit changes it but for a vanishing chance)."""
    import torch

    b = t.detach().contiguous().view(-1).view(torch.uint8)
    pad = (-b.numel()) % 4
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    w = b.view(torch.int32)
    s1 = s2 = 0
    step = 1 << 26
    for i in range(0, w.numel(), step):
        c = w[i : i + step].to(torch.int64)
        pos = torch.arange(i, i + c.numel(), device=c.device, dtype=torch.int64)
        s1 += int(c.sum())
        s2 += int((c * ((pos * 2654435761) % 2147483647 + 1)).sum())
    return f"{t.dtype}:{tuple(t.shape)}:{s1 & (2**64 - 1):016x}{s2 & (2**64 - 1):016x}"


def _launchers(dtype: str, dev):
    """(forward(x, idx, w, w1, w2, saved, fp8, keep) -> (out, combine), backward(go, x, idx, w, comb, w1, w2, saved,
    fp8, keep) -> (grad_x, grad_w, grad_w1, grad_w2), KeptRows or None) of this process's tree, EP 1. w1 / w2 are
    one rank's lists of experts."""

    from megatron_mok import kernel

    bwd_kw = dict(BACKWARD[dtype], ring_slots=FORWARD["ring_slots"], check=False)
    mb = FORWARD["minibatch_tokens"]
    if hasattr(kernel, "mok_forward"):  # the operators: one launch path, EP 1 over a local handle
        bufs = kernel.PeerBuffers.local(dev)
        keep = kernel.KeptRows.allocate(T * K, H, F, mb, dev) if dtype == "bf16" else None

        def forward(x, idx, w, w1, w2, saved, fp8):
            out, comb, _ = kernel.mok_forward(bufs, x, idx, w, w1, w2, **FORWARD, saved_h=saved, fp8=fp8, keep=keep,
                                              check=False)  # fmt: skip
            return out, comb

        def backward(go, x, idx, w, comb, w1, w2, saved, fp8):
            return kernel.mok_backward(bufs, go, x, idx, w, comb, w1, w2, **bwd_kw, saved_h=saved, fp8=fp8, kept=keep)

        return forward, backward
    from megatron_mok.kernel import backward as bk

    keep = kernel.KeptRows.allocate(1, T * K, H, F, mb, dev) if dtype == "bf16" else None

    def forward(x, idx, w, w1, w2, saved, fp8):
        o, c, _ = kernel.mok_forward_emulated([x], [idx], [w], [w1], [w2], **FORWARD, saved_h=[saved], fp8=fp8,
                                              keep=keep, check=False)  # fmt: skip
        return o[0], c[0].view(T, K, H)

    def backward(go, x, idx, w, comb, w1, w2, saved, fp8):
        gx, gw, g1, g2 = bk.mok_backward_emulated([go], [x], [idx], [w], [comb], [w1], [w2], **bwd_kw, saved_h=[saved],
                                                  fp8=fp8, kept=keep)  # fmt: skip
        return gx[0], gw[0], g1[0], g2[0]

    return forward, backward


def _host_us(fn, calls: int) -> float:
    """Median microseconds the host spends in one call while the GPU is busy with the calls before it."""
    import time

    import torch

    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _one_case(inputs: tuple, dtype: str, iters: int) -> dict:
    """Checksums and timings of one slice in one dtype: forward, then backward on its outputs."""
    import torch

    try:
        from megatron_mok.kernel.quant import quantize_expert_weights
    except ImportError:  # a checkout from before megatron_mok/kernel was laid out by concept
        from megatron_mok.kernel.fp8_weights import quantize_expert_weights

    x, idx, w, w1, w2, go = inputs
    dev = x.device
    q8 = quantize_expert_weights([w1], [w2], transposed=True) if dtype == "fp8" else None
    saved = torch.empty((T * K, 2 * F), dtype=torch.bfloat16, device=dev)
    fwd, bwd = _launchers(dtype, dev)

    def forward():
        return fwd(x, idx, w, w1, w2, saved, q8)

    o, comb = forward()

    def backward():
        return bwd(go, x, idx, w, comb, w1, w2, saved, q8)

    gx, gw, g1, g2 = backward()
    torch.cuda.synchronize()
    sums = {"out": checksum(o), "combine": checksum(comb), "saved_h": checksum(saved)}
    sums.update(grad_x=checksum(gx), grad_topk_w=checksum(gw))
    sums.update(grad_w1=checksum(torch.stack(g1)), grad_w2=checksum(torch.stack(g2)))
    from megatron_mok.timing import cuda_times_ms  # the tree's own event timing (median of iters calls)

    return {
        "sums": sums,
        "forward_ms": cuda_times_ms(forward, iters, 2)[0],
        "backward_ms": cuda_times_ms(backward, iters, 2)[0],
        "forward_host_us": _host_us(forward, iters),
        "backward_host_us": _host_us(backward, iters),
    }


def run_cases(iters: int) -> dict:
    """Every case in this process's tree: {case: {"sums": {name: checksum}, "forward_ms", "backward_ms"}}."""
    import torch

    from megatron_mok import kernel

    if not kernel.is_available():
        raise SystemExit(f"MoK kernel unavailable: {kernel.unavailable_reason()}")
    dev = torch.device("cuda")
    out: dict = {}
    for name, L in SLICES.items():
        g = torch.Generator(device=dev).manual_seed(1000 + L)
        x = torch.randn((T, H), generator=g, device=dev).bfloat16()
        scores = torch.rand((T, L), generator=g, device=dev)
        idx = torch.topk(scores, K, dim=1).indices.to(torch.int32).contiguous()
        w = torch.softmax(torch.gather(scores, 1, idx.long()), dim=1).float().contiguous()
        w1 = [(torch.randn((2 * F, H), generator=g, device=dev) / H**0.5).bfloat16() for _ in range(L)]
        w2 = [(torch.randn((H, F), generator=g, device=dev) / F**0.5).bfloat16() for _ in range(L)]
        go = torch.randn((T, H), generator=g, device=dev).bfloat16()
        for dtype in ("bf16", "fp8"):
            out[f"{name} {dtype}"] = _one_case((x, idx, w, w1, w2, go), dtype, iters)
            torch.cuda.empty_cache()
    return out


def _worker_env(tree: Path) -> dict:
    env = dict(os.environ)
    site = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != Path.cwd().resolve()]
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *site])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run_worker(label: str, tree: Path, iters: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", path, "--iters", str(iters)]
    proc = subprocess.run(cmd, cwd=tree, env=_worker_env(tree), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"tree {label} ({tree}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(Path(path).read_text())


def _prebuild(trees: dict[str, Path]) -> None:
    """Build every tree's kernels in parallel (cache hits afterwards): the operator library, or in older checkouts
    the forward and backward libraries."""
    code = (
        "from megatron_mok import kernel\n"
        "if hasattr(kernel, 'ops'): kernel.ops.load()\n"
        "else:\n    from megatron_mok.kernel import backward; kernel.build_library(); backward.build_library()"
    )
    procs = {
        label: subprocess.Popen(
            [sys.executable, "-c", code], cwd=t, env=_worker_env(t), stderr=subprocess.PIPE, text=True
        )
        for label, t in trees.items()
    }
    for label, p in procs.items():
        _, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"tree {label}: build failed\n{err[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], help="LABEL=PATH of a checkout (the first: baseline)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        Path(args.worker).write_text(json.dumps(run_cases(args.iters)))
        return 0
    trees = {}
    for spec in args.tree:
        label, sep, path = spec.partition("=")
        if not sep or not (Path(path) / "megatron_mok").is_dir():
            ap.error(f"--tree {spec!r}: expected LABEL=PATH of a checkout with megatron_mok/")
        trees[label] = Path(path).resolve()
    if len(trees) < 2:
        ap.error("give at least two --tree LABEL=PATH")
    _prebuild(trees)
    rng = random.Random(0)
    rounds: dict[str, list[dict]] = {label: [] for label in trees}
    for _ in range(args.rounds):
        order = list(trees)
        rng.shuffle(order)
        for label in order:
            rounds[label].append(_run_worker(label, trees[label], args.iters))
    base = next(iter(trees))
    ok = True
    report: dict = {"trees": {k: str(v) for k, v in trees.items()}, "rounds": args.rounds, "cases": {}}
    print(
        f"{'case':20s} {'tree':8s} {'fwd ms':>8s} {'spread':>7s} {'bwd ms':>8s} {'spread':>7s} {'host us fwd / bwd':>18s}"
        f"  vs {base}"
    )
    for case in rounds[base][0]:
        ref = rounds[base][0][case]["sums"]
        for label in trees:
            runs = [r[case] for r in rounds[label]]
            for i, r in enumerate(runs):
                diff = [k for k in ref if r["sums"][k] != ref[k]]
                if diff:
                    ok = False
                    print(f"BITS DIFFER: {case}, tree {label} round {i}: {', '.join(diff)}")
            f = [r["forward_ms"] for r in runs]
            b = [r["backward_ms"] for r in runs]
            fb = statistics.median(r[case]["forward_ms"] for r in rounds[base])
            bb = statistics.median(r[case]["backward_ms"] for r in rounds[base])
            fm, bm = statistics.median(f), statistics.median(b)
            hf = statistics.median(r.get("forward_host_us", float("nan")) for r in runs)
            hb = statistics.median(r.get("backward_host_us", float("nan")) for r in runs)
            print(
                f"{case:20s} {label:8s} {fm:8.3f} {(max(f) - min(f)) / fm:6.1%} {bm:8.3f} {(max(b) - min(b)) / bm:6.1%}"
                f" {hf:8.1f} / {hb:7.1f}  {fm / fb:.3f} / {bm / bb:.3f}"
            )
            report["cases"].setdefault(case, {})[label] = {
                "forward_ms": f, "backward_ms": b, "forward_host_us": hf, "backward_host_us": hb, "sums": runs[0]["sums"]
            }  # fmt: skip
    print("bits: identical across trees and rounds" if ok else "bits: DIFFER")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
