"""Prove a refactor of the kernels on one GPU: two checkouts' kernels side by side, same inputs, same bits,
timings in pairs.

Each tree runs in a worker process of its own (its own ``megatron_mok`` and library, built once into the shared
cache) that prepares every case -- the Kimi-K2 and DeepSeek-V3 slices (hidden 7168, ffn 2048, top-8, 8192 tokens,
EP 1; 8 / 32 local experts), bf16 and FP8, forward and backward with the shipped configs' kernel settings -- on
inputs drawn from fixed seeds, and stays alive. Each case is then timed tree after tree, each tree first in turn,
N times (``--pairs``): the GPU's clock under its power cap drifts between one process's run and the next by
more than a kernel change of a few percent moves (4-10 % between fresh processes on an H100), but little between
the two halves of a pair. The summary prints each tree's median device time per case, the median of the per-pair
ratios against the first tree with their quartiles, and the host time per call (the Python call alone, the GPU busy
behind it; the launches read no error record, so a layer call's lazy error read is not in it). A bit-exact checksum
of every output and gradient is compared across the trees on the workers' first calls and again after the timings;
any difference fails.

    python tools/compare_trees.py --tree before=/tmp/before --tree after=. --pairs 20 --json out.json

A tree is a checkout (its ``megatron_mok`` is imported from there); the first is the baseline. A tree launches
through ``kernel.mok_forward`` / ``kernel.mok_backward`` (the PyTorch operators) or, in older checkouts, through
``kernel.mok_forward_emulated`` / ``kernel.backward.mok_backward_emulated`` at one rank.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

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


def _prepare_case(inputs: tuple, dtype: str) -> dict:
    """One slice in one dtype, ready to call: {"forward", "backward", "sums"}; "sums" runs the forward and the
    backward once and returns the checksum of every output and gradient."""
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

    state: dict = {}  # the combine buffer the timed backward reads: the first forward's (its checksum's)

    def forward():
        return fwd(x, idx, w, w1, w2, saved, q8)

    def backward():
        if "comb" not in state:
            state["comb"] = forward()[1]
        return bwd(go, x, idx, w, state["comb"], w1, w2, saved, q8)

    def sums() -> dict:
        o, c = forward()
        state.setdefault("comb", c)
        gx, gw, g1, g2 = bwd(go, x, idx, w, c, w1, w2, saved, q8)
        torch.cuda.synchronize()
        out = {"out": checksum(o), "combine": checksum(c), "saved_h": checksum(saved)}
        out.update(grad_x=checksum(gx), grad_topk_w=checksum(gw))
        out.update(grad_w1=checksum(torch.stack(g1)), grad_w2=checksum(torch.stack(g2)))
        return out

    # nothing is launched yet: the first "sums" request checksums each case's very first calls
    return {"forward": forward, "backward": backward, "sums": sums}


def _time_case(case: dict, iters: int) -> dict:
    from megatron_mok.timing import cuda_times_ms  # the tree's own event timing (median of iters calls)

    return {
        "forward_ms": cuda_times_ms(case["forward"], iters, 2)[0],
        "backward_ms": cuda_times_ms(case["backward"], iters, 2)[0],
        "forward_host_us": _host_us(case["forward"], iters),
        "backward_host_us": _host_us(case["backward"], iters),
    }


def _slice_inputs(name: str):
    """(x, topk_idx, topk_w, w1, w2, grad_out) of one slice, drawn from a fixed seed on the GPU."""
    import torch

    from megatron_mok import kernel

    if not kernel.is_available():
        raise SystemExit(f"MoK kernel unavailable: {kernel.unavailable_reason()}")
    dev = torch.device("cuda")
    L = SLICES[name]
    g = torch.Generator(device=dev).manual_seed(1000 + L)
    x = torch.randn((T, H), generator=g, device=dev).bfloat16()
    scores = torch.rand((T, L), generator=g, device=dev)
    idx = torch.topk(scores, K, dim=1).indices.to(torch.int32).contiguous()
    w = torch.softmax(torch.gather(scores, 1, idx.long()), dim=1).float().contiguous()
    w1 = [(torch.randn((2 * F, H), generator=g, device=dev) / H**0.5).bfloat16() for _ in range(L)]
    w2 = [(torch.randn((H, F), generator=g, device=dev) / F**0.5).bfloat16() for _ in range(L)]
    go = torch.randn((T, H), generator=g, device=dev).bfloat16()
    return x, idx, w, w1, w2, go


def _release_cached_memory() -> None:
    import torch

    torch.cuda.empty_cache()


def serve(iters: int) -> None:
    """A tree's worker: prepares every case, then answers requests from stdin, one JSON line each on the
    process's original stdout, which nothing else writes to (the tree's own prints go to stderr): "sums" -> {case:
    checksums}, a case's name -> its forward and backward times, "quit" ends it."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    cases = {f"{name} {dtype}": _prepare_case(inputs, dtype) for name in SLICES for inputs in [_slice_inputs(name)]
             for dtype in ("bf16", "fp8")}  # fmt: skip
    _release_cached_memory()  # before the next tree's worker prepares its own
    answers.write(json.dumps({"cases": list(cases)}) + "\n")
    for line in sys.stdin:
        req = line.strip()
        if req == "quit":
            break
        reply = {c: case["sums"]() for c, case in cases.items()} if req == "sums" else _time_case(cases[req], iters)
        _release_cached_memory()  # the idle worker holds only its cases while the other tree runs
        answers.write(json.dumps(reply) + "\n")


def _worker_command(iters: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--serve", "--iters", str(iters)]


class _Worker:
    """One tree's worker process; its own output goes to a log file, shown if it fails."""

    #: seconds one answer may take (a case's timings, or every case's checksums) before the worker counts as hung
    TIMEOUT_S = 900.0

    def __init__(self, label: str, tree: Path, iters: int):
        self.label, self.tree = label, tree
        self.log = tempfile.NamedTemporaryFile("w+", suffix=f"-{label}.log")
        self.proc = subprocess.Popen(_worker_command(iters), cwd=tree, env=_worker_env(tree), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)  # fmt: skip
        try:
            self.cases: list[str] = self._read()["cases"]
        except BaseException:
            self.close()
            raise

    def _fail(self, what: str) -> NoReturn:
        """Stop the worker and raise with the end of its log."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.seek(0)
        raise SystemExit(f"tree {self.label} ({self.tree}) worker {what} (rc {self.proc.returncode}):\n"
                         f"{self.log.read()[-3000:]}")  # fmt: skip

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.TIMEOUT_S)
        if not ready:
            self._fail(f"gave no answer within {self.TIMEOUT_S:g} s")
        line = self.proc.stdout.readline()
        if not line:
            self._fail("ended")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            self._fail(f"answered {line[:200]!r}")

    def ask(self, request: str) -> dict:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(request + "\n")
            self.proc.stdin.flush()
        except OSError:  # it ended while idle
            self._fail("ended")
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None and not f.closed:
                try:
                    f.close()
                except OSError:  # a request still buffered for a worker that ended
                    pass
        self.log.close()


_TIMES = ("forward_ms", "backward_ms", "forward_host_us", "backward_host_us")


def _quantiles(v: list[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile)."""
    if len(v) < 2:
        return v[0], v[0], v[0]
    q = statistics.quantiles(v, n=4, method="inclusive")
    return q[0], q[1], q[2]


def run_pairs(trees: dict[str, Path], pairs: int, iters: int) -> tuple[dict, bool]:
    """Every case timed on every tree, pair after pair: returns (report, bits identical). Workers are started one after
    another (each prepares its cases alone); any failure stops them all."""
    workers: dict[str, _Worker] = {}
    try:
        for label, tree in trees.items():
            workers[label] = _Worker(label, tree, iters)
        base = next(iter(trees))
        cases = workers[base].cases
        for label, w in workers.items():
            if w.cases != cases:
                raise SystemExit(f"tree {label}: cases {w.cases} differ from {base}'s {cases}")
        first = {label: w.ask("sums") for label, w in workers.items()}
        times: dict = {c: {label: {k: [] for k in _TIMES} for label in trees} for c in cases}
        labels = list(trees)
        for i in range(pairs):
            for j, case in enumerate(cases):
                # which tree goes first turns round from pair to pair (and case to case): each goes first equally often
                r = (i + j) % len(labels)
                for label in labels[r:] + labels[:r]:
                    for k, v in workers[label].ask(case).items():
                        times[case][label][k].append(v)
            # as they come, so that a run stopped early still shows its pairs
            print(f"pair {i + 1}/{pairs}, fwd / bwd vs {base}: " + "; ".join(
                f"{case} {label} {t[label]['forward_ms'][-1] / t[base]['forward_ms'][-1]:.3f} / "
                f"{t[label]['backward_ms'][-1] / t[base]['backward_ms'][-1]:.3f}"
                for case, t in times.items() for label in trees if label != base), flush=True)  # fmt: skip
        last = {label: w.ask("sums") for label, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
    ok = True
    ref = first[base]
    for label in trees:
        for when, sums in (("first calls", first[label]), ("after the timings", last[label])):
            for case in cases:
                diff = [k for k in ref[case] if sums[case][k] != ref[case][k]]
                if diff:
                    ok = False
                    print(f"BITS DIFFER: {case}, tree {label}, {when}: {', '.join(diff)}")
    report: dict = {"trees": {k: str(v) for k, v in trees.items()}, "pairs": pairs, "iters": iters, "cases": {}}
    print(f"{'case':20s} {'tree':8s} {'fwd ms':>8s} {'bwd ms':>8s} {'host us fwd / bwd':>18s}   per-pair ratio vs {base},"
          " median (quartiles): fwd; bwd")  # fmt: skip
    for case in cases:
        for label in trees:
            t, b = times[case][label], times[case][base]
            row: dict = {**t, "sums": first[label][case], "sums_after_timings": last[label][case]}
            cols = []
            for k in ("forward_ms", "backward_ms"):
                ratios = [x / y for x, y in zip(t[k], b[k])]
                lo, med, hi = _quantiles(ratios)
                row[k.replace("_ms", "_ratios")] = ratios
                row[k.replace("_ms", "_ratio_quartiles")] = [lo, med, hi]
                cols.append(f"{med:.3f} ({lo:.3f}-{hi:.3f})")
            fm, bm = statistics.median(t["forward_ms"]), statistics.median(t["backward_ms"])
            hf, hb = statistics.median(t["forward_host_us"]), statistics.median(t["backward_host_us"])
            print(f"{case:20s} {label:8s} {fm:8.3f} {bm:8.3f} {hf:8.1f} / {hb:7.1f}   {cols[0]}; {cols[1]}")
            report["cases"].setdefault(case, {})[label] = row
    print("bits: identical across trees, before and after the timings" if ok else "bits: DIFFER")
    return report, ok


def _worker_env(tree: Path) -> dict:
    env = dict(os.environ)
    site = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != Path.cwd().resolve()]
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *site])
    env["PYTHONUNBUFFERED"] = "1"
    return env


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
    ap.add_argument("--pairs", type=int, default=20, help="times each case is timed on every tree, tree after tree")
    ap.add_argument("--iters", type=int, default=10, help="timed calls per case, tree and pair (their median)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.iters)
        return 0
    if args.pairs < 1 or args.iters < 1:
        ap.error(f"--pairs and --iters must be >= 1, got {args.pairs} / {args.iters}")
    trees = {}
    for spec in args.tree:
        label, sep, path = spec.partition("=")
        if not sep or not (Path(path) / "megatron_mok").is_dir():
            ap.error(f"--tree {spec!r}: expected LABEL=PATH of a checkout with megatron_mok/")
        trees[label] = Path(path).resolve()
    if len(trees) < 2:
        ap.error("give at least two --tree LABEL=PATH")
    _prebuild(trees)
    report, ok = run_pairs(trees, args.pairs, args.iters)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
