"""Fault-injection harness of ``test_faults.py``: R EP ranks' real per-rank launches on one GPU, on buffers that
persist across calls and carry poisoned guard regions.

Each rank has its own symmetric-region stand-in (``PeerBuffers.on_one_gpu``), its own stream and an even SM share,
as in ``emulated.py`` (whose stream fan-out and per-rank FP8 weight pick are reused), but the regions, the saved fc1
output and the ``main_grad`` buffers outlive a call: a correct call right after a fault runs on the very buffers
the fault left behind, and epochs advance as in training. Every buffer a launch may write has a guard past its end
(region rows past the rank's tokens, saved-h rows past the owner capacity, ``main_grad`` rows and row padding past
each view), filled with a byte sentinel before every launch and checked after it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_mok.kernel import MokKernelError, PeerBuffers, errors, mok_backward, mok_forward

sys.path.insert(0, os.path.dirname(__file__))
from emulated import _rank_fp8, _run_ranks, mok_backward_emulated, mok_forward_emulated  # noqa: E402
from mok_truth import make_backward_case, make_routing  # noqa: E402

SENTINEL = 0xA5  # guard byte: a stray write cannot leave a whole guard region of it by chance
GUARD_TOKENS = 8  # region rows past every rank's tokens
GUARD_ROWS = 8  # saved-h rows past the largest owner capacity; main_grad rows past each expert's view
GUARD_COLS = 64  # main_grad row padding past each view's columns (Megatron's main_grad are views of one buffer)
FORWARD, BACKWARD = "forward", "backward"


def fill_sentinel(t: torch.Tensor) -> None:
    t.view(torch.uint8).fill_(SENTINEL)


def untouched(t: torch.Tensor) -> bool:
    return bool((t.view(torch.uint8) == SENTINEL).all())


@dataclass
class Outcome:
    """What one call of the ranks in ``launched`` left: every rank's error record and the MokKernelError text its
    own check raised (None: none), the wall time from the first launch until every launched rank's record was read,
    and the guard regions found written (empty: none)."""

    kind: str
    launched: list[int]
    records: dict[int, list[int]]
    raised: dict[int, str | None]
    wall_ms: float
    violations: list[str]
    message: Callable[[list[int]], str]
    results: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def reporting(self) -> list[int]:
        return [r for r in self.launched if self.raised[r] is not None]

    @property
    def silent(self) -> list[int]:
        return [r for r in self.launched if self.raised[r] is None]

    def root(self) -> list[int] | None:
        """The record that names the cause (``errors.root_cause``: a rank's own failure before its peers' waits for
        it), None when no rank reported."""
        found = [self.records[r] for r in self.launched if self.records[r][0] != 0]
        return errors.root_cause(found) if found else None

    def root_text(self) -> str:
        root = self.root()
        return "no error" if root is None else self.message(root)


class EpGroup:
    """R ranks of one seeded case (uniform top-k routing, every rank the same token count), their persistent
    buffers and streams. ``forward`` / ``backward`` launch the ranks named (default: all), with per-rank input
    overrides, and return the :class:`Outcome`; the call's outputs are in ``Outcome.results`` (cloned: a later call
    reuses the region)."""

    def __init__(
        self,
        R: int,
        fp8: bool,
        seed: int,
        *,
        L: int = 2,
        H: int = 256,
        F: int = 128,
        K: int = 2,
        T: int = 256,
        timeout_ms: float = 300.0,
    ) -> None:
        from megatron_mok.kernel.quant import quantize_expert_weights

        self.R, self.L, self.H, self.F, self.K, self.T = R, L, H, F, K, T
        self.timeout_ms = timeout_ms
        self.device = torch.device("cuda")
        # the stall tests' configurations (test_forward_kernel / test_backward_kernel): the forward ring wraps, the
        # backward ring holds every minibatch
        self.cfg = {
            FORWARD: dict(comm_sms=2, ring_slots=2, minibatch_tokens=128),
            BACKWARD: dict(comm_sms=2, ring_slots=8, minibatch_tokens=128),
        }
        self.x, self.idx, self.wts, self.w1, self.w2, self.go = make_backward_case(
            R, L, H, F, K, [T] * R, "uniform", seed
        )
        self.fp8 = quantize_expert_weights(self.w1, self.w2, transposed=True) if fp8 else None
        self.bufs = PeerBuffers.on_one_gpu(R, T + GUARD_TOKENS, H, K, self.device)
        self.streams = [torch.cuda.Stream(self.device) for _ in range(R)]
        self.ctas = torch.cuda.get_device_properties(self.device).multi_processor_count // R
        self.full_rows = R * T * K  # the dropless owner capacity: every routed row on one owner
        bf = dict(dtype=torch.bfloat16, device=self.device)
        self.saved_h = [torch.empty((self.full_rows + GUARD_ROWS, 2 * F), **bf) for _ in range(R)]
        f32 = dict(dtype=torch.float32, device=self.device)
        self.mg1_store = [torch.empty((L, 2 * F + GUARD_ROWS, H + GUARD_COLS), **f32) for _ in range(R)]
        self.mg2_store = [torch.empty((L, H + GUARD_ROWS, F + GUARD_COLS), **f32) for _ in range(R)]
        self.mg1 = [[s[e, : 2 * F, :H] for e in range(L)] for s in self.mg1_store]
        self.mg2 = [[s[e, :H, :F] for e in range(L)] for s in self.mg2_store]
        self.combine: list[torch.Tensor] | None = None  # the forward's combine rows, for the backward

    # ---- inputs ------------------------------------------------------------------------------------------------

    def routing_to_one_expert(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every slot of every rank to global expert E // 2 (one owner gets R x T x K rows)."""
        gen = torch.Generator(device=self.device).manual_seed(0)
        rt = [make_routing(self.T, self.K, self.R * self.L, "one", self.device, gen) for _ in range(self.R)]
        return [i for i, _ in rt], [w for _, w in rt]

    def with_rows(self, tensors: list[torch.Tensor], rank: int, rows: int) -> list[torch.Tensor]:
        """``tensors`` with rank ``rank``'s cut to its first ``rows`` tokens."""
        return [t[:rows].contiguous() if r == rank else t for r, t in enumerate(tensors)]

    # ---- guards ------------------------------------------------------------------------------------------------

    def _region_tails(self, Ts: list[int]) -> list[tuple[str, torch.Tensor]]:
        out = []
        for r, b in enumerate(self.bufs):
            for name in ("x", "idx", "combine", "topk_w", "grad_out", "xq", "xs"):
                t = getattr(b, name)
                if t is not None:
                    out.append((f"rank {r} region {name}[{Ts[r]}:]", t[Ts[r] :]))
        return out

    def _arm(self, kind: str, Ts: list[int], rows: int, whole: bool) -> list[torch.Tensor] | None:
        """Sentinel into every guard before a launch (and, ``whole``, into every buffer the launch must not write at
        all). Returns the backward's saved-h snapshot (an input it must leave as it is)."""
        for _, t in self._region_tails(Ts):
            fill_sentinel(t)
        if whole:
            for b in self.bufs:
                fill_sentinel(b.combine)
        if kind == FORWARD:
            for h in self.saved_h:
                fill_sentinel(h)  # the forward rewrites the rows the backward reads
            return None
        for s1, s2, v1, v2 in zip(self.mg1_store, self.mg2_store, self.mg1, self.mg2):
            fill_sentinel(s1)
            fill_sentinel(s2)
            for v in (*v1, *v2):
                v.zero_()  # the weight gradients accumulate into main_grad
        return [h.clone() for h in self.saved_h]

    def _violations(self, kind: str, Ts: list[int], rows: int, whole: bool, snap) -> list[str]:
        bad = [name for name, t in self._region_tails(Ts) if not untouched(t)]
        if whole:
            bad += [f"rank {r} region combine (the call must write nothing)" for r, b in enumerate(self.bufs)
                    if not untouched(b.combine)]  # fmt: skip
        if kind == FORWARD:
            for r, h in enumerate(self.saved_h):
                lo = 0 if whole else rows
                if not untouched(h[lo:]):
                    bad.append(f"rank {r} saved_h[{lo}:] (owner capacity {rows})")
            return bad
        for r, h in enumerate(self.saved_h):
            if not torch.equal(h, snap[r]):
                bad.append(f"rank {r} saved_h (an input of the backward)")
        for r in range(self.R):
            for name, s, n, m in (("main_grad_w1", self.mg1_store[r], 2 * self.F, self.H),
                                  ("main_grad_w2", self.mg2_store[r], self.H, self.F)):  # fmt: skip
                if not (untouched(s[:, n:, :]) and untouched(s[:, :n, m:])):
                    bad.append(f"rank {r} {name} guard rows / row padding")
        return bad

    # ---- launches ----------------------------------------------------------------------------------------------

    def _call(self, kind: str, launch, ranks: list[int], Ts: list[int], rows: int, whole: bool) -> Outcome:
        snap = self._arm(kind, Ts, rows, whole)
        message = (errors.forward_message if kind == FORWARD else errors.backward_message)(
            self.R, self.L, self.timeout_ms
        )
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = _run_ranks(self.streams, lambda q: launch(q) if q in ranks else None, self.R)
        records, raised = {}, {}
        for r in ranks:  # every launched rank's own check, as the product reads a launch's record
            err = self.bufs[r].err if kind == FORWARD else self.bufs[r].bwd_err
            try:
                errors.after_launch(err, self.streams[r], True, message)
                raised[r] = None
            except MokKernelError as exc:
                raised[r] = str(exc)
            records[r] = err.cpu().tolist()
        wall_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        bad = self._violations(kind, Ts, rows, whole, snap)
        outcome = Outcome(kind, list(ranks), records, raised, wall_ms, bad, message)
        outcome.results = self._results(kind, outs, ranks)
        return outcome

    def _results(self, kind: str, outs, ranks: list[int]) -> dict[str, list[torch.Tensor]]:
        if kind == FORWARD:
            res = {"out": [], "combine": [], "tokens_per_expert": [], "saved_h": []}
            for r in ranks:
                out, comb, tpe = outs[r]
                res["out"].append(out)
                res["combine"].append(comb.clone())
                res["tokens_per_expert"].append(tpe)
                res["saved_h"].append(self.saved_h[r][: max(0, int(tpe.sum()))].clone())
            return res
        res = {"grad_x": [], "grad_topk_weight": [], "grad_w1": [], "grad_w2": []}
        for r in ranks:
            gx, gw, _, _ = outs[r]
            res["grad_x"].append(gx)
            res["grad_topk_weight"].append(gw)
            res["grad_w1"].append(torch.stack([v.clone() for v in self.mg1[r]]))
            res["grad_w2"].append(torch.stack([v.clone() for v in self.mg2[r]]))
        return res

    def forward(
        self,
        ranks: list[int] | None = None,
        *,
        x: list[torch.Tensor] | None = None,
        idx: list[torch.Tensor] | None = None,
        wts: list[torch.Tensor] | None = None,
        rows: int | None = None,
        stall: tuple[int, int] | None = None,
        fp8=None,
        whole: bool = False,
    ) -> Outcome:
        """One forward call of ``ranks``; ``rows``: the owner capacity (saved-h rows); ``whole``: the call must
        write no combine or saved-h row at all (a fault found before any row moves)."""
        x, idx, wts = x or self.x, idx or self.idx, wts or self.wts
        rows = rows or self.full_rows
        fp8 = fp8 if fp8 is not None else self.fp8

        def launch(q: int):
            return mok_forward(
                self.bufs[q], x[q], idx[q], wts[q], self.w1[q], self.w2[q], **self.cfg[FORWARD],
                timeout_ms=self.timeout_ms, ctas=self.ctas, check=False, saved_h=self.saved_h[q][:rows],
                fp8=_rank_fp8(fp8, q), debug_stall=stall,
            )  # fmt: skip

        ranks = list(range(self.R)) if ranks is None else ranks
        outcome = self._call(FORWARD, launch, ranks, [int(t.shape[0]) for t in x], rows, whole)
        if not outcome.reporting and ranks == list(range(self.R)):
            self.combine = [c.clone() for c in outcome.results["combine"]]
        return outcome

    def backward(
        self,
        ranks: list[int] | None = None,
        *,
        go: list[torch.Tensor] | None = None,
        x: list[torch.Tensor] | None = None,
        idx: list[torch.Tensor] | None = None,
        wts: list[torch.Tensor] | None = None,
        combine: list[torch.Tensor] | None = None,
        rows: int | None = None,
        stall: tuple[int, int] | None = None,
        fp8=None,
        whole: bool = False,
    ) -> Outcome:
        """One backward call of ``ranks`` (dgrad, then the wgrad kernel into ``main_grad``) after a clean
        ``forward`` of all ranks (its combine rows and saved h); ``rows``: the owner capacity."""
        if self.combine is None:
            raise RuntimeError("EpGroup.backward needs a clean forward of every rank first")
        go, x, idx, wts = go or self.go, x or self.x, idx or self.idx, wts or self.wts
        combine = combine or self.combine
        rows = rows or self.full_rows
        fp8 = fp8 if fp8 is not None else self.fp8

        def launch(q: int):
            return mok_backward(
                self.bufs[q], go[q], x[q], idx[q], wts[q], combine[q], self.w1[q], self.w2[q], **self.cfg[BACKWARD],
                timeout_ms=self.timeout_ms, wgrad="kernel", main_grad_w1=self.mg1[q], main_grad_w2=self.mg2[q],
                saved_h=self.saved_h[q][:rows], owner_rows=rows, ctas=self.ctas, check=False,
                fp8=_rank_fp8(fp8, q), debug_stall=stall,
            )  # fmt: skip

        ranks = list(range(self.R)) if ranks is None else ranks
        return self._call(BACKWARD, launch, ranks, [int(t.shape[0]) for t in x], rows, whole)

    def call(self, kind: str, **kw) -> Outcome:
        return self.forward(**kw) if kind == FORWARD else self.backward(**kw)

    # ---- references --------------------------------------------------------------------------------------------

    def reference(self, kind: str) -> Outcome:
        """A clean call of every rank (for the backward: after a clean forward), checked against the emulated
        launches on fresh buffers (same device code and SM split: the same bits), so a later call on these buffers
        can be compared with it bit for bit."""
        fwd = self.forward()
        if fwd.reporting or fwd.violations:
            raise AssertionError(f"the clean forward failed: {fwd.root_text()}; guards written: {fwd.violations}")
        if kind == FORWARD:
            out, comb, tpe = mok_forward_emulated(
                self.x, self.idx, self.wts, self.w1, self.w2, **self.cfg[FORWARD], fp8=self.fp8,
                saved_h=[torch.empty_like(h[: self.full_rows]) for h in self.saved_h],
            )  # fmt: skip
            emu = {"out": out, "combine": comb, "tokens_per_expert": tpe}
            assert_same(fwd, emu, "the per-rank forward vs the emulated launch")
            return fwd
        bwd = self.backward()
        if bwd.reporting or bwd.violations:
            raise AssertionError(f"the clean backward failed: {bwd.root_text()}; guards written: {bwd.violations}")
        gx, gw, _, _ = mok_backward_emulated(
            self.go, self.x, self.idx, self.wts, self.combine, self.w1, self.w2, **self.cfg[BACKWARD],
            saved_h=[h[: self.full_rows] for h in self.saved_h], fp8=self.fp8,
        )  # fmt: skip
        assert_same(bwd, {"grad_x": gx, "grad_topk_weight": gw}, "the per-rank backward vs the emulated launch")
        return bwd


def assert_same(got: Outcome, want: Outcome | dict[str, list[torch.Tensor]], what: str) -> None:
    """Every output of ``want`` (an Outcome's results, or a dict of per-rank lists) equals ``got``'s bit for bit."""
    ref = want.results if isinstance(want, Outcome) else want
    for name, tensors in ref.items():
        for r, (a, b) in enumerate(zip(got.results[name], tensors)):
            assert a.shape == b.shape and torch.equal(a, b), f"{what}: rank {r} {name} differs"


def assert_same_where(
    got: Outcome, want: Outcome, keep: Callable[[str, int, int], torch.Tensor | None], what: str
) -> None:
    """As :func:`assert_same` on the part of each output that ``keep(name, rank, n)`` selects: a boolean mask over
    the output's n entries of its first dimension, or None for the whole output."""
    for name, tensors in want.results.items():
        for r, (a, b) in enumerate(zip(got.results[name], tensors)):
            m = keep(name, r, int(b.shape[0]))
            if m is None:
                assert torch.equal(a, b), f"{what}: rank {r} {name} differs"
            else:
                assert torch.equal(a[m], b[m]), f"{what}: rank {r} {name} differs where the poisoned value cannot reach"


def nonfinite_summary(out: Outcome) -> str:
    """Which outputs hold non-finite values, counted in entries of their first dimension (tokens, rows, experts)."""
    parts = []
    for name, tensors in out.results.items():
        n = 0
        for t in tensors:
            if t.numel() and t.is_floating_point():
                bad = ~torch.isfinite(t.float())
                n += int(bad.flatten(1).any(1).sum() if t.dim() > 1 else bad.sum())
        if n:
            parts.append(f"{name} {n}")
    return "no error; non-finite rows: " + (", ".join(parts) if parts else "none")


@dataclass
class Row:
    """One line of the fault table."""

    fault: str
    kind: str
    R: int
    dtype: str
    reporting: str
    wall_ms: float
    text: str


def table(rows: list[Row], width: int = 150) -> str:
    head = f"{'fault':<26} {'pass':<8} {'EP':>2} {'dtype':<5} {'ranks':>5} {'wall ms':>8}  error (first line)"
    lines = [head, "-" * len(head)]
    for r in rows:
        text = r.text.splitlines()[0] if r.text else ""
        if len(text) > width:
            text = text[: width - 3] + "..."
        lines.append(f"{r.fault:<26} {r.kind:<8} {r.R:>2} {r.dtype:<5} {r.reporting:>5} {r.wall_ms:>8.1f}  {text}")
    return "\n".join(lines)
