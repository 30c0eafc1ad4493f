"""GPU fault table of the MoK kernels: each fault of an EP group ends in a clear error on every rank, in bounded time,
with nothing written past a buffer, and the process runs a correct call right after it.

Every case runs R real per-rank launches on one GPU (``faults.EpGroup``: R streams, an even SM split, buffers that
persist across calls), EP 2 and 4, forward and backward (dgrad, then the wgrad kernel into ``main_grad``), bf16 and
FP8, with a 300 ms flag-wait timeout. Per case:

* a clean reference call, checked bit for bit against the emulated launches on fresh buffers (``emulated.py``);
* the fault, with a byte sentinel in every guard region (region rows past each rank's tokens, saved-h rows past the
  owner capacity, ``main_grad`` rows and row padding past each view); a fault found before any row moves must leave
  the combine / grad_buf rows and saved h untouched altogether;
* every launched rank's own record check raises MokKernelError; the record and its text name the rank, the slot
  where the fault has one, and the phase; it ends within 10 x the timeout (a timeout: not before it); a failed
  backward leaves NaN in every output (the wgrad kernel poisons them, so a training step stops even on a lazy read);
* the same call again on the same buffers equals the reference bit for bit (the CUDA context survives every fault).

Faults and the records they must leave (csrc/mok/common.cuh: codes kErr*, phases kPhase*):

  stalled peer          rank 1 never publishes ring slot 1 (the kernels' debug stall): rank 1 times out naming slot 1
                        in dispatch-ready / pull-ready (or slot-free, where the forward ring wraps); every other rank
                        times out in the peer compute-done wait naming rank 1
  rank never launches   rank R-1 is not launched: every launched rank times out in the peer start wait naming it; when
                        it launches late, after its peers gave up, it times out too (naming a peer that never
                        signalled this call), which puts the group's epochs back in step for the next call
  owner capacity        every slot routed to one expert, owner rows = T x K: every rank reports the owner, the rows
                        sent and the rows it holds (phase: schedule), before any row is written
  token count           rank R-1 runs T - 64 tokens: every rank reports the peer whose count differs and both counts
                        (phase: peer token count)
  non-finite value      NaN / Inf in one element of x, grad_out or an FP8 weight scale: the rank that reads it (the
                        forward's pull or FP8 source quantisation, the backward's pull reverse-combine, the
                        weight-scale check) reports the home rank and token or the expert, and the phase that found
                        it; its peers time out naming it. ``test_nonfinite_is_contained``: no hang, no write past a
                        buffer, without an error only the results that depend on the value differ, and the next call
                        is correct

The last test prints the table (fault, pass, EP, dtype, ranks reporting, wall ms, first line of the root-cause error).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from collections.abc import Callable

import pytest
import torch

from megatron_mok.kernel import errors

sys.path.insert(0, os.path.dirname(__file__))
from faults import (  # noqa: E402
    BACKWARD,
    FORWARD,
    EpGroup,
    Outcome,
    Row,
    assert_same,
    assert_same_where,
    nonfinite_summary,
    table,
)

pytestmark = pytest.mark.gpu

TIMEOUT_MS = 300.0
WALL_FACTOR = 10.0  # a fault ends within this many timeouts
KINDS = [FORWARD, BACKWARD]
DTYPES = ["bf16", "fp8"]
EPS = [2, 4]
STALL = (1, 1)  # (rank, ring slot) whose pull is never published

TABLE: list[Row] = []  # filled as the fault tests run, printed by the last test


def _group(R: int, dtype: str, seed: int) -> EpGroup:
    return EpGroup(R, dtype == "fp8", seed, timeout_ms=TIMEOUT_MS)


def _phases(kind: str) -> dict[int, str]:
    return errors.FORWARD_PHASES if kind == FORWARD else errors.BACKWARD_PHASES


def _note(fault: str, kind: str, R: int, dtype: str, out: Outcome, text: str | None = None) -> None:
    reporting = f"{len(out.reporting)}/{len(out.launched)}"
    TABLE.append(Row(fault, kind, R, dtype, reporting, out.wall_ms, text if text is not None else out.root_text()))


def _names(text: str | None, *needles: str) -> None:
    assert text is not None, "no error was raised"
    for n in needles:
        assert n in text, f"{n!r} not in the error: {text}"


def _assert_ended_cleanly(out: Outcome, *, timed_out: bool) -> None:
    """Every launched rank reported, within WALL_FACTOR timeouts (a timeout not before the timeout), and no guard was
    written."""
    assert not out.silent, f"ranks {out.silent} reported nothing (root cause elsewhere: {out.root_text()})"
    assert out.wall_ms < WALL_FACTOR * TIMEOUT_MS, f"the fault took {out.wall_ms:.0f} ms (timeout {TIMEOUT_MS} ms)"
    if timed_out:
        assert out.wall_ms >= 0.9 * TIMEOUT_MS, f"a timeout reported after {out.wall_ms:.0f} ms < {TIMEOUT_MS} ms"
    assert not out.violations, f"written past a buffer (or where nothing may be written): {out.violations}"


def _assert_poisoned(out: Outcome) -> None:
    """A failed backward's outputs are NaN on every rank that launched (grad_x, router grad, main_grad)."""
    for i, r in enumerate(out.launched):
        for name, tensors in out.results.items():
            assert torch.isnan(tensors[i].float()).all(), f"rank {r}: {name} of the failed backward is not all NaN"


def _after(grp: EpGroup, kind: str, ref: Outcome, fault: str) -> None:
    """A correct call right after the fault, on the same buffers: the reference's bits."""
    again = grp.call(kind)
    assert not again.reporting, f"the call after the {fault} failed: {again.root_text()}"
    assert not again.violations, f"the call after the {fault} wrote past a buffer: {again.violations}"
    assert_same(again, ref, f"the call after the {fault}")


def _seed(*parts: object) -> int:
    """A seed per case, the same in every process (str hashes are salted per process)."""
    return sum((i + 1) * ord(c) for i, c in enumerate("/".join(map(str, parts)))) % 100_000


# ---- stalled peer -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("R", EPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_stalled_peer(kernel, kind: str, dtype: str, R: int) -> None:
    """Rank 1 never publishes its ring slot 1: it names the slot and the wait; every peer names rank 1."""
    grp = _group(R, dtype, _seed("stall", kind, dtype, R))
    ref = grp.reference(kind)
    out = grp.call(kind, stall=STALL)
    _note(f"stalled peer (rank {STALL[0]} slot {STALL[1]})", kind, R, dtype, out)
    _assert_ended_cleanly(out, timed_out=True)
    ph = _phases(kind)
    srank, sslot = STALL
    code, rank, slot, phase = out.records[srank][:4]
    # its consumers wait for the slot's rows; where the ring wraps, its pull waits for the slot to be combined
    assert (code, rank, slot) == (1, srank, sslot) and phase in (2, 3), f"stalled rank's record {out.records[srank]}"
    _names(out.raised[srank], f"timed out: rank {srank} slot {sslot} waiting for {ph[phase]}")
    for r in out.launched:
        if r == srank:
            continue
        rec = out.records[r]
        assert rec[:4] == [1, r, -1, 9] and rec[6] == srank, f"rank {r}'s record {rec}"
        _names(out.raised[r], f"rank {r} waiting for {ph[9]}", f"rank {srank} did not signal call {grp.bufs[r].epoch}")
    root = out.root()
    assert root is not None and root[1:3] == [srank, sslot], f"root cause {root}: not the stalled slot"
    if kind == BACKWARD:
        _assert_poisoned(out)
    _after(grp, kind, ref, "stall")


# ---- a rank that never launches -----------------------------------------------------------------------------------


@pytest.mark.parametrize("R", EPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_rank_never_launches(kernel, kind: str, dtype: str, R: int) -> None:
    """Rank R-1 is not launched: every launched rank names it; launched late, it names a peer that gave up."""
    grp = _group(R, dtype, _seed("missing", kind, dtype, R))
    ref = grp.reference(kind)
    miss, launched = R - 1, list(range(R - 1))
    out = grp.call(kind, ranks=launched, whole=True)
    _note(f"rank {miss} never launches", kind, R, dtype, out)
    _assert_ended_cleanly(out, timed_out=True)
    ph = _phases(kind)
    epoch = grp.bufs[0].epoch  # the call the launched ranks made
    for r in launched:
        rec = out.records[r]
        assert rec[:4] == [1, r, -1, 8] and rec[6] == miss, f"rank {r}'s record {rec}"
        _names(out.raised[r], f"rank {r} waiting for {ph[8]}", f"rank {miss} did not signal call {epoch}")
    if kind == BACKWARD:
        _assert_poisoned(out)

    # the missing rank launches late, after its peers gave up: it finds their start signals but never their
    # compute-done (FP8 forward: source-quantised) signals of this call, and times out naming one of them
    late = grp.call(kind, ranks=[miss])
    _note(f"rank {miss} launches late", kind, R, dtype, late)
    _assert_ended_cleanly(late, timed_out=True)
    rec = late.records[miss]
    assert rec[0] == 1 and rec[1] == miss and rec[3] in errors.PEER_SIGNAL_PHASES and rec[6] in launched, rec
    assert grp.bufs[miss].epoch == epoch, "the late rank made another call than its peers"
    _names(late.raised[miss], f"rank {miss} waiting for {ph[rec[3]]}", f"rank {rec[6]} did not signal call {epoch}")
    if kind == BACKWARD:
        _assert_poisoned(late)
    _after(grp, kind, ref, "missing rank")


# ---- owner-capacity overflow --------------------------------------------------------------------------------------


@pytest.mark.parametrize("R", EPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_owner_capacity_overflow(kernel, kind: str, dtype: str, R: int) -> None:
    """One owner is sent R x T x K rows into buffers of T x K: every rank names it and both counts, nothing moves."""
    grp = _group(R, dtype, _seed("capacity", kind, dtype, R))
    ref = grp.reference(kind)
    idx, wts = grp.routing_to_one_expert()
    owner = (grp.R * grp.L // 2) // grp.L  # the owner of expert E // 2
    cap, sent = grp.T * grp.K, grp.R * grp.T * grp.K  # owner_capacity_factor 1.0; the owner is sent every row
    out = grp.call(kind, idx=idx, wts=wts, rows=cap, whole=True)
    _note(f"owner capacity (rank {owner})", kind, R, dtype, out)
    _assert_ended_cleanly(out, timed_out=False)
    for r in out.launched:
        rec = out.records[r]
        # every rank reads every rank's routing, so each reports the same owner (phase 7: schedule)
        assert rec[:6] == [5, owner, -1, 7, cap, sent], f"rank {r}'s record {rec}"
        _names(out.raised[r], f"sends {sent} rows to rank {owner}, but its owner-side row buffers hold {cap}")
    if kind == BACKWARD:
        _assert_poisoned(out)
    _after(grp, kind, ref, "capacity overflow")


# ---- token-count mismatch -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("R", EPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_token_count_mismatch(kernel, kind: str, dtype: str, R: int) -> None:
    """Rank R-1 runs 64 tokens fewer: every rank names the peer whose count differs and both counts."""
    grp = _group(R, dtype, _seed("tokens", kind, dtype, R))
    ref = grp.reference(kind)
    odd, T, T2 = R - 1, grp.T, grp.T - 64
    kw = {name: grp.with_rows(getattr(grp, name), odd, T2) for name in ("x", "idx", "wts")}
    if kind == BACKWARD:
        kw.update(go=grp.with_rows(grp.go, odd, T2), combine=grp.with_rows(grp.combine, odd, T2))
    out = grp.call(kind, whole=True, **kw)
    _note(f"token count (rank {odd}: {T2})", kind, R, dtype, out)
    _assert_ended_cleanly(out, timed_out=False)
    for r in out.launched:
        rec = out.records[r]
        # phase 10: the start wait's token-count check; a rank names the first peer whose count differs from its own
        want = [4, r, -1, 10, T, T2, odd] if r != odd else [4, r, -1, 10, T2, T, 0]
        assert rec[:7] == want, f"rank {r}'s record {rec}, want {want}"
        _names(out.raised[r], f"rank {want[6]} runs {want[5]} tokens but rank {r} was launched for {want[4]}")
    if kind == BACKWARD:
        _assert_poisoned(out)
    _after(grp, kind, ref, "token-count mismatch")


# ---- non-finite values --------------------------------------------------------------------------------------------

POISON_RANK, POISON_TOKEN, POISON_COL = 1, 37, 5  # one element of rank 1's x / grad_out
POISON_EXPERT = 0  # rank 1's local expert whose first (or last) FP8 scale block is poisoned
NONFINITE = [
    pytest.param(FORWARD, "x", "bf16", id="forward-x-bf16"),
    pytest.param(FORWARD, "x", "fp8", id="forward-x-fp8"),
    pytest.param(BACKWARD, "grad_out", "bf16", id="backward-grad_out-bf16"),
    pytest.param(BACKWARD, "grad_out", "fp8", id="backward-grad_out-fp8"),
    pytest.param(FORWARD, "weight_scale", "fp8", id="forward-w1_scale-fp8"),
    pytest.param(BACKWARD, "weight_scale", "fp8", id="backward-w2t_scale-fp8"),
    # the last block of a list: in the forward, of the expert's second list (w2), the check's other branch
    pytest.param(FORWARD, "weight_scale_last", "fp8", id="forward-w2_scale_last-fp8"),
    pytest.param(BACKWARD, "weight_scale_last", "fp8", id="backward-w2t_scale_last-fp8"),
]
VALUES = [pytest.param(math.nan, id="nan"), pytest.param(math.inf, id="inf")]

Keep = Callable[[str, int, int], torch.Tensor | None]


def _poisoned_scale(grp: EpGroup, name: str, value: float, at: int):
    """The group's FP8 weights with block scale ``at`` (0: the first, -1: the last) of rank POISON_RANK's expert
    POISON_EXPERT in ``name`` (w1s: the forward's fc1; w2ts: the FP8 dgrad's W2^T) set to ``value``."""
    lists = [list(per_rank) for per_rank in getattr(grp.fp8, name)]
    s = lists[POISON_RANK][POISON_EXPERT].clone()
    s.view(-1)[at] = value
    lists[POISON_RANK][POISON_EXPERT] = s
    return dataclasses.replace(grp.fp8, **{name: lists})


def _inject_nonfinite(grp: EpGroup, kind: str, source: str, value: float) -> tuple[Outcome, Keep, str]:
    """Run the call with one non-finite value; returns its outcome, the mask of results the value cannot reach
    (``faults.assert_same_where``) and what the error must name besides the rank (the token, or the expert)."""
    pr, t, g = POISON_RANK, POISON_TOKEN, POISON_RANK * grp.L + POISON_EXPERT
    dev = grp.device

    if source in ("x", "grad_out"):
        bad = [v.clone() for v in (grp.x if source == "x" else grp.go)]
        bad[pr][t, POISON_COL] = value
        out = grp.forward(x=bad) if source == "x" else grp.backward(go=bad)
        experts_hit = {int(e) for e in grp.idx[pr][t].tolist() if e >= 0}  # the experts the token's rows reach

        def keep(name: str, r: int, n: int) -> torch.Tensor | None:
            if name == "tokens_per_expert":
                return None
            if name == "saved_h":  # layout rows: where the token's rows sit is the kernel's business
                return torch.zeros(n, dtype=torch.bool, device=dev)
            if name in ("grad_w1", "grad_w2"):  # owner r's experts: those the token's rows reach sum over them
                return torch.tensor([r * grp.L + e not in experts_hit for e in range(n)], device=dev)
            if r != pr:
                return None
            rest = torch.ones(n, dtype=torch.bool, device=dev)
            rest[t] = False
            return rest

        return out, keep, f"token {t}"

    last = source.endswith("_last")
    scale = ("w2s" if last else "w1s") if kind == FORWARD else "w2ts"
    out = grp.call(kind, fp8=_poisoned_scale(grp, scale, value, -1 if last else 0))

    def keep_expert(name: str, r: int, n: int) -> torch.Tensor | None:
        if name in ("tokens_per_expert", "grad_topk_weight"):  # neither reads a weight
            return None
        if name == "saved_h":
            return torch.zeros(n, dtype=torch.bool, device=dev)
        if name in ("grad_w1", "grad_w2"):
            return torch.tensor([r * grp.L + e != g for e in range(n)], device=dev)
        return ~(grp.idx[r] == g).any(1)  # all but the tokens with a row through the expert

    return out, keep_expert, f"expert {POISON_EXPERT}"


@pytest.mark.parametrize("R", EPS)
@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("kind,source,dtype", NONFINITE)
def test_nonfinite_is_reported(kernel, kind: str, source: str, dtype: str, value: float, R: int) -> None:
    """The behaviour the kernels should have: every rank reports the non-finite value, the root cause naming the
    rank that holds it, the token (or the expert) and the phase that found it."""
    grp = _group(R, dtype, _seed("nonfinite", kind, source, dtype, R))
    ref = grp.reference(kind)
    out, _, what = _inject_nonfinite(grp, kind, source, value)
    assert not out.silent, f"ranks {out.silent} reported nothing for a non-finite {source}"
    root = out.root()
    assert root is not None
    text = out.message(root)
    assert re.search(r"(?i)\bnon-finite\b|\bnan\b|\binf\b", text), f"the error does not say what was found: {text}"
    _names(text, f"rank {POISON_RANK}", what, _phases(kind).get(root[3], f"<phase {root[3]} has no name>"))
    _assert_ended_cleanly(out, timed_out=False)
    _after(grp, kind, ref, f"non-finite {source}")


@pytest.mark.parametrize("R", EPS)
@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("kind,source,dtype", NONFINITE)
def test_nonfinite_is_contained(kernel, kind: str, source: str, dtype: str, value: float, R: int) -> None:
    """Whatever the kernels make of a non-finite value, the call ends in bounded time without writing past a buffer;
    when it reports no error, every result the value cannot reach has the reference's bits; the next call is
    correct."""
    grp = _group(R, dtype, _seed("nonfinite", kind, source, dtype, R))
    ref = grp.reference(kind)
    out, keep, _ = _inject_nonfinite(grp, kind, source, value)
    what = source
    if source.startswith("weight_scale"):
        what = ("w2 scale" if source.endswith("_last") else "w1 scale") if kind == FORWARD else "w2t scale"
    _note(f"non-finite {what} ({value})", kind, R, dtype, out, None if out.reporting else nonfinite_summary(out))
    assert out.wall_ms < WALL_FACTOR * TIMEOUT_MS, f"took {out.wall_ms:.0f} ms (timeout {TIMEOUT_MS} ms)"
    assert not out.violations, f"written past a buffer: {out.violations}"
    if not out.reporting:
        assert_same_where(out, ref, keep, f"non-finite {source}")
    _after(grp, kind, ref, f"non-finite {source}")


# ---- the table ----------------------------------------------------------------------------------------------------


def test_zz_fault_table(kernel, capsys) -> None:
    """Print the fault table of the tests above (last in the module, so it sees every row; printed past pytest's
    capture so a GPU run's log holds it)."""
    with capsys.disabled():
        body = table(TABLE) if TABLE else "no fault test ran"
        print(f"\n\nMoK fault table (timeout {TIMEOUT_MS:g} ms)\n{body}\n")
