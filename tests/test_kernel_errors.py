"""CPU: the kernels' error records as messages (megatron_mok/kernel/errors.py), and the Python side's tables of
the kernels' phase and signal enums checked against csrc/mok/common.cuh, so a phase or signal added on one side
only is caught here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_mok.kernel.comm import SIGNAL_KINDS
from megatron_mok.kernel.errors import BACKWARD_PHASES, FORWARD_PHASES, PEER_SIGNAL_PHASES, UNIT_PHASES, format_error

COMMON = (Path(__file__).resolve().parents[1] / "csrc" / "mok" / "common.cuh").read_text()


def c_enum(name: str) -> dict[str, int]:
    """The enumerators of `enum name : int { ... };` in common.cuh (explicit values only)."""
    m = re.search(r"enum " + name + r" : int \{(.*?)\};", COMMON, re.S)
    assert m is not None, f"enum {name} not found"
    body = re.sub(r"//[^\n]*", "", m.group(1))
    return {k: int(v) for k, v in re.findall(r"(k\w+)\s*=\s*(\d+)", body)}


def test_every_phase_has_a_name():
    phases = c_enum("Phase")
    assert len(phases) >= 13
    named = set(FORWARD_PHASES) | set(BACKWARD_PHASES) | set(UNIT_PHASES)
    missing = {k: v for k, v in phases.items() if v not in named}
    assert not missing, f"phases without a name in FORWARD_PHASES / BACKWARD_PHASES / UNIT_PHASES: {missing}"
    assert phases["kPhaseWgrad"] in BACKWARD_PHASES
    assert phases["kPhasePeerSrcQuant"] in FORWARD_PHASES  # forward only


def test_peer_signal_phases_are_the_peer_waits():
    phases = c_enum("Phase")
    peer_waits = {v for k, v in phases.items() if k.startswith("kPhasePeer") and k != "kPhasePeerShape"}
    assert set(PEER_SIGNAL_PHASES) == peer_waits


def test_signal_kinds_match_the_pad():
    kinds = c_enum("SignalKind")
    assert SIGNAL_KINDS == kinds["kSigKinds"] == max(v for k, v in kinds.items() if k != "kSigKinds") + 1


def test_peer_timeout_names_the_missing_peer():
    # {code 1 timeout, rank 0, slot -1, phase 13, expected epoch 5, seen 4, extra = peer 3, CTA 7}
    msg = format_error([1, 0, -1, 13, 5, 4, 3, 7], 4, 2, 250.0, kernel="MoK kernel", phases=FORWARD_PHASES)
    assert msg == (
        "MoK kernel timed out: rank 0 waiting for peer source-quantised signal (a peer rank has not written its "
        "tokens' e4m3 copy for the FP8 forward): rank 3 did not signal call 5 (its flag reads 4) within 250 ms "
        "(CTA 7)"
    )
    counter = format_error([1, 1, 2, 3, 9, 8, 0, 5], 2, 2, 100.0, kernel="MoK kernel", phases=FORWARD_PHASES)
    assert counter.startswith("MoK kernel timed out: rank 1 slot 2 waiting for slot-free"), counter
    assert "expected counter >= 9, saw 8" in counter


@pytest.mark.parametrize(
    "backward,phase,fields,expected",
    [
        (False, "kPhaseInputCheck", (1, 37, 0, 0, 3), "NaN / Inf in x of rank 1 token 37, found by rank 3"),
        (True, "kPhaseGradOutCheck", (0, 12, 0, 0, 1), "NaN / Inf in grad_out of rank 0 token 12, found by rank 1"),
        (False, "kPhaseWeightScales", (2, 5, 11, 1, 2), "scale 11 of w2 of rank 2 local expert 5"),
        (True, "kPhaseWeightScales", (0, 3, 0, 0, 0), "scale 0 of W2^T of rank 0 local expert 3"),
    ],
    ids=["x", "grad_out", "forward-w2-scale", "backward-w2t-scale"],
)
def test_nonfinite_messages(backward: bool, phase: str, fields: tuple[int, ...], expected: str) -> None:
    """A non-finite record (code, rank, slot, phase, expected, seen, extra, block) names the tensor, the rank, the
    token or the expert's scale, and the phase that found it."""
    code, ph = c_enum("ErrCode")["kErrNonFinite"], c_enum("Phase")[phase]
    rank, slot, exp, seen, extra = fields
    names = BACKWARD_PHASES if backward else FORWARD_PHASES
    kernel = "MoK backward kernel" if backward else "MoK kernel"
    msg = format_error([code, rank, slot, ph, exp, seen, extra, 0], 4, 8, 100.0, kernel=kernel, phases=names)
    assert expected in msg and names[ph] in msg, msg


@pytest.mark.parametrize(
    "extra,expected",
    [
        (0, "local expert 3's rows end at row 900, but the rows hold 800"),
        (1, "local expert 3's 128-padded tokens end at column 900, but a and b hold 800"),
        (2, "local expert 3 has a negative token count (900)"),
    ],
    ids=["quantiser-rows", "wgrad-columns", "negative"],
)
def test_token_count_messages(extra: int, expected: str) -> None:
    """The FP8 wgrad units' count check (code kErrBadShape, phase kPhaseTokenCounts) says which expert and why."""
    code, ph = c_enum("ErrCode")["kErrBadShape"], c_enum("Phase")["kPhaseTokenCounts"]
    msg = format_error([code, 0, 3, ph, 800, 900, extra, 0], 1, 8, 100.0, kernel="MoK unit", phases=UNIT_PHASES)
    assert msg == "MoK unit: " + ("the token counts do not fit: " if extra < 2 else "") + expected, msg
