"""Kernel error records: the exception, the message, and reading a record after a launch.

Both MoK kernels write the same 16-int record {code, rank, slot, phase, expected, seen, extra, CTA, ...}
when a flag wait times out or an input is invalid; only the phase names differ.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

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
    if code == 4:
        return (
            f"{kernel}: rank {extra} runs {seen} tokens but rank {rank} was launched for {expected}: every EP rank "
            "must call the layer with the same number of tokens"
        )
    if code == 2:
        return (
            f"{kernel}: invalid topk index {seen} at rank {rank} token {slot} k {extra}: must be -1 or in [0, {R * L})"
        )
    return f"{kernel} internal error: code {code} rank {rank} phase {pname} expected {expected} seen {seen}"


def raise_recorded_error(err_cache: Mapping[int, torch.Tensor], device, message) -> None:
    """Synchronize the current stream and raise MokKernelError(message(record)) if the last launch on
    ``device`` left an error in its record (``err_cache``: device index -> record tensor)."""
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    dev = device.index if device.index is not None else torch.cuda.current_device()
    err = err_cache.get(dev)
    if err is None:
        return
    torch.cuda.current_stream(device).synchronize()
    vals = err.cpu().tolist()
    if vals[0] != 0:
        raise MokKernelError(message(vals))
