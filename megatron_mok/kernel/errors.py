"""Kernel error records: the exception, the message, and reading a record after a launch.

Every MoK kernel writes the same 16-int record {code, rank, slot, phase, expected, seen, extra, CTA, ...} into
its launch's ``err`` tensor when a flag wait times out or an input is invalid; only the phase names differ.
A launch's record is read in one of three ways (the launch functions' ``check``): at once after a host sync
(``True``), lazily (``"lazy"``: copied to pinned memory behind the launch, read by a later MoK call without a
host sync, so a failure surfaces at the latest one call later), or not at all (``False``; a CUDA-graph capture
reads it after a replay with :func:`check_last_error`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping

import torch

from ..layout import OVER_ROUTED

# phases whose timeout waits for a peer rank's signal (csrc/mok/common.cuh: kPhasePeerStart, kPhasePeerDone,
# kPhasePeerSrcQuant)
PEER_SIGNAL_PHASES = (8, 9, 13)


class MokKernelError(RuntimeError):
    """Raised when a MoK kernel reports an error (timeout, invalid input) or cannot be launched."""


def format_error(err: list[int], R: int, L: int, timeout_ms: float, *, kernel: str, phases: Mapping[int, str]) -> str:
    code, rank, slot, phase, expected, seen, extra, block = err[:8]
    pname = phases.get(phase, f"phase {phase}")
    # per-rank launches, the peer signals (start, done, source-quantised): `extra` is the peer that did not signal
    if code == 1 and phase in PEER_SIGNAL_PHASES:
        return (
            f"{kernel} timed out: rank {rank} waiting for {pname}: rank {extra} did not signal call {expected} "
            f"(its flag reads {seen}) within {timeout_ms:g} ms (CTA {block})"
        )
    if code == 1:
        return (
            f"{kernel} timed out: rank {rank} slot {slot} waiting for {pname}: expected counter >= {expected}, "
            f"saw {seen} after {timeout_ms:g} ms (CTA {block})"
        )
    if code == 5:
        return (
            f"{kernel}: the routing sends {seen} rows to rank {rank}, but its owner-side row buffers hold {expected} "
            "(kernel.owner_capacity_factor x T x top-k): raise the factor, or set 0 for the dropless worst case "
            "(EP x T x top-k rows)"
        )
    if code == 4 and phase == 11:
        return (
            f"{kernel}: wgrad of rank {rank} expert {slot}: its rows end at {seen} but the layout buffers hold "
            f"{expected} rows (tokens-per-expert counts not written by a finished dgrad launch?)"
        )
    if code == 4 and phase == 17:
        if extra == 2:
            return f"{kernel}: local expert {slot} has a negative token count ({seen})"
        where = (
            ("rows end at row", "the rows hold") if extra == 0 else ("128-padded tokens end at column", "a and b hold")
        )
        return (
            f"{kernel}: the token counts do not fit: local expert {slot}'s {where[0]} {seen}, but {where[1]} {expected}"
        )
    if code == 4:
        return (
            f"{kernel}: rank {extra} runs {seen} tokens but rank {rank} was launched for {expected}: every EP rank "
            "must call the layer with the same number of tokens"
        )
    if code == 6 and phase == 15:
        what = ("w1", "w2") if "backward" not in kernel else ("W2^T", "W1^T")
        return (
            f"{kernel}: FP8 weight block scale {expected} of {what[seen & 1]} of rank {rank} local expert {slot} is "
            f"not a finite positive number (a NaN / Inf in that expert's weights?), found in {pname}"
        )
    if code == 6:
        tensor, role = ("grad_out", "output gradient") if phase == 16 else ("x", "input")
        return (
            f"{kernel}: a NaN / Inf in {tensor} of rank {rank} token {slot}, found by rank {extra} in {pname}: the MoE "
            f"layer's {role} is not finite"
        )
    if code == 2 and seen == OVER_ROUTED:
        return (
            f"{kernel}: the routing map routes token {slot} of rank {rank} to more than top-k (moe_router_topk) experts"
        )
    if code == 2:
        return (
            f"{kernel}: invalid topk index {seen} at rank {rank} token {slot} k {extra}: must be -1 or in [0, {R * L})"
        )
    return f"{kernel} internal error: code {code} rank {rank} phase {pname} expected {expected} seen {seen}"


def root_cause(records: list[list[int]]) -> list[int]:
    """Of several launches' error records, the one that names the cause: a failure of its own (a stalled slot, a bad
    index, a full buffer) before a rank's wait for a peer that failed."""
    own = [r for r in records if not (r[0] == 1 and r[3] in PEER_SIGNAL_PHASES)]
    return (own or records)[0]


FORWARD_PHASES = {
    1: "grid barrier (schedule)",
    2: "dispatch-ready (compute waits for the pull dispatch of the slot)",
    3: "slot-free (dispatch waits for combine to release the slot)",
    4: "fc1-done (fc2 waits for fc1 of its row block)",
    5: "compute-done (final combine waits for all ranks' expert pushes)",
    6: "internal smem pipeline",
    7: "schedule",
    8: "peer start signal (a peer rank has not launched this call)",
    9: "peer compute-done signal (a peer rank has not finished its experts)",
    10: "peer token count",
    13: "peer source-quantised signal (a peer rank has not written its tokens' e4m3 copy for the FP8 forward)",
    14: "input check (x as the pull reads it, or as the FP8 forward quantises it at its source)",
    15: "FP8 weight-scale check (before the schedule)",
}
BACKWARD_PHASES = {
    1: "grid barrier (schedule)",
    2: "pull-ready (dgrad stage 1 waits for the pulled x / grad_out rows of its minibatch)",
    3: "slot-free (pull waits for the reverse-dispatch of the slot's previous minibatch)",
    4: "stage-1-done (dX tile waits for dH of its row block)",
    5: "compute-done (grad_x sum waits for all ranks' reverse-dispatch pushes)",
    6: "internal smem pipeline",
    7: "schedule",
    8: "peer start signal (a peer rank has not launched this call)",
    9: "peer compute-done signal (a peer rank has not pushed all its input-row gradients)",
    10: "peer token count",
    11: "wgrad (per-expert row counts do not fit the layout buffers: the dgrad launch did not finish)",
    15: "FP8 weight-scale check (before the schedule)",
    16: "output-gradient check (grad_out as the pull reverse-combine reads it)",
}

# the unit kernels' (FP8 GEMMs and quantisers) waits and checks
UNIT_PHASES = {
    6: "internal smem pipeline",
    17: "token counts (per-expert counts that do not fit the rows or the token columns they index)",
}

Message = Callable[[list[int]], str]


def forward_message(R: int, L: int, timeout_ms: float) -> Message:
    return lambda err: format_error(err, R, L, timeout_ms, kernel="MoK kernel", phases=FORWARD_PHASES)


def backward_message(R: int, L: int, timeout_ms: float) -> Message:
    return lambda err: format_error(err, R, L, timeout_ms, kernel="MoK backward kernel", phases=BACKWARD_PHASES)


def new_record(device) -> torch.Tensor:
    """A launch's error record (int32[16], zero: no error), remembered for :func:`check_last_error`."""
    err = torch.zeros((16,), dtype=torch.int32, device=device)
    _records[id(err)] = (weakref.ref(err), None)
    return err


# id(record) -> (weak reference to it, the message of its last launch): every record made by new_record while its
# owner keeps it (keyed by id: tensors compare element-wise, so they cannot be dict keys or set members themselves)
_records: dict[int, tuple[weakref.ref, Message | None]] = {}


def _live_records() -> list[tuple[torch.Tensor, Message | None]]:
    live = []
    for key, (ref, message) in list(_records.items()):
        err = ref()
        if err is None:
            del _records[key]
        else:
            live.append((err, message))
    return live


def capturing(device=None) -> bool:
    """Whether the current CUDA stream (of ``device``, default the current device) is capturing a CUDA graph (False
    without CUDA)."""
    if not torch.cuda.is_available():
        return False
    if device is not None and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()
    return torch.cuda.is_current_stream_capturing()


def capture_check(check, who: str):
    """The error check a launch can run. While the current stream captures a CUDA graph the host can neither
    synchronise (check=True) nor poll the lazy reader's events: ``"lazy"`` becomes no check (a captured launch still
    writes its error record on every replay; read it with ``check_last_error()`` after one), True is an error naming
    the fix."""
    if check and torch.compiler.is_compiling():  # read like a CUDA graph's launches: check_last_error()
        return False
    if check and capturing():
        if check == "lazy":
            return False
        raise ValueError(
            f"{who}: check=True synchronises the host, which CUDA graph capture forbids: capture with "
            "check='lazy' or check=False and call megatron_mok.kernel.check_last_error() after a replay"
        )
    return check


def refuse_capture(who: str, why: str) -> None:
    """A clear error for a launch that a CUDA graph cannot replay correctly."""
    if capturing():
        raise ValueError(f"{who} cannot be captured in a CUDA graph: {why}")


def after_launch(err: torch.Tensor, stream, check, message: Message) -> None:
    """Read a launch's record as ``check`` says (module docstring); ``stream``: the launch's, None for the current
    one. The message is kept for ``check_last_error`` whatever ``check`` is. Nothing happens while torch.compile
    traces the launch (its record is read like a CUDA graph's)."""
    if torch.compiler.is_compiling():
        return
    if id(err) in _records:
        _records[id(err)] = (_records[id(err)][0], message)
    if check and stream is None and err.device.index != torch.cuda.current_device():
        stream = torch.cuda.current_stream(err.device)
    if check == "lazy":  # (runs behind every layer call: the current stream is used without looking it up)
        _lazy_checker(err.device.index).after_launch(err, stream, message)
    elif check:
        (stream if stream is not None else torch.cuda.current_stream(err.device)).synchronize()
        vals = err.cpu().tolist()
        if vals[0] != 0:
            raise MokKernelError(message(vals))


class _LazyErrorChecker:
    """Reads kernel error records without synchronising the host.

    After each launch the 16-int error record is copied (async, same stream, so before the next launch re-zeroes
    it) into a pinned host slot, with an event. ``poll`` raises for any finished launch that recorded an error;
    ``drain`` waits for all of them. The next MoK call polls, so a timeout surfaces at the latest one call later --
    with the rank and slot it names.
    """

    SLOTS = 64

    def __init__(self) -> None:
        host = torch.zeros((self.SLOTS, 16), dtype=torch.int32).pin_memory()
        # per slot, made once (this runs behind every launch): its pinned row and its event, recorded again per use
        self.rows = list(host.unbind(0))
        self.events = [torch.cuda.Event() for _ in range(self.SLOTS)]
        self.unread = [False] * self.SLOTS
        self.pending: list[tuple[int, Message]] = []
        self.next = 0

    def after_launch(self, err: torch.Tensor, stream, message: Message) -> None:
        """``stream``: the launch's, or None for the current stream, which must then be on err's device (the module's
        ``after_launch`` passes the stream otherwise)."""
        self.poll()
        slot = self.next
        if self.unread[slot]:  # never overwrite an unread record
            self.drain()
        self.next = (slot + 1) % self.SLOTS
        ev = self.events[slot]
        if stream is None:
            self.rows[slot].copy_(err, non_blocking=True)
            ev.record()
        else:
            with torch.cuda.stream(stream):
                self.rows[slot].copy_(err, non_blocking=True)
                ev.record(stream)
        self.unread[slot] = True
        self.pending.append((slot, message))

    def poll(self, wait: bool = False) -> None:
        still = []
        found = []  # (record, message) of finished launches that failed
        for slot, message in self.pending:
            ev = self.events[slot]
            if wait:
                ev.synchronize()
            if not ev.query():
                still.append((slot, message))
                continue
            self.unread[slot] = False
            vals = self.rows[slot].tolist()
            if vals[0] != 0:
                found.append((vals, message))
        self.pending = still
        if found:
            cause = root_cause([v for v, _ in found])
            raise MokKernelError(next(m for v, m in found if v is cause)(cause))

    def drain(self) -> None:
        self.poll(wait=True)


_lazy: dict[int, _LazyErrorChecker] = {}


def _lazy_checker(dev: int) -> _LazyErrorChecker:
    if dev not in _lazy:
        _lazy[dev] = _LazyErrorChecker()
    return _lazy[dev]


def check_pending_errors(wait: bool = False) -> None:
    """Raise MokKernelError if a launch made with ``check="lazy"`` recorded an error (``wait=True`` waits for all
    such launches first). Nothing is read while torch.compile traces or a CUDA graph captures (an event query there
    invalidates the capture): the pending records are eager launches', and the next eager MoK call reads them."""
    if torch.compiler.is_compiling() or capturing():
        return
    for checker in _lazy.values():
        checker.poll(wait=wait)


def check_last_error(device=None) -> None:
    """Synchronise ``device`` (default: the current one) and raise MokKernelError if the last launch behind any live
    error record on it recorded an error (how a CUDA-graph replay's errors are read)."""
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    dev = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(dev)
    for err, message in _live_records():
        if err.device.index != dev:
            continue
        vals = err.cpu().tolist()
        if vals[0] != 0:
            raise MokKernelError(message(vals) if message else f"MoK kernel error record {vals[:8]}")
