"""tools/timeline_gaps.py: the idle between one SM's GEMM tiles, on a hand-made timeline whose gaps are known."""

from __future__ import annotations

from types import ModuleType

import pytest
from load_script import load_script

from megatron_mok.kernel.timeline import TimelineEvent


def _load() -> ModuleType:
    return load_script("timeline_gaps")


def _ev(sm: int, kind: str, t0: float, t1: float, mb: int = 0) -> TimelineEvent:
    return TimelineEvent(cta=sm, sm=sm, kind=kind, minibatch=mb, start_us=t0, end_us=t1)


def test_gaps_by_transition_head_and_tail() -> None:
    tg = _load()
    events = [
        # SM 0: fc1 [10, 20], fc1 [21, 30] (gap 1), fc2 [32, 40] (gap 2), fc2 [40.5, 45] (gap 0.5)
        _ev(0, "fc2", 32, 40),  # out of order on purpose: gaps follow each SM's start times
        _ev(0, "fc1", 10, 20),
        _ev(0, "fc1", 21, 30),
        _ev(0, "fc2", 40.5, 45),
        # SM 1: fc1 [12, 25], fc2 [28, 50] (gap 3); the latest end of all (50)
        _ev(1, "fc1", 12, 25),
        _ev(1, "fc2", 28, 50, mb=1),
        # SM 2: a long fc2 [14, 44] then a short fc1 [44.25, 46] (gap 0.25): sorted by end time instead of
        # start time the pair would swap and give a negative gap
        _ev(2, "fc1", 44.25, 46, mb=1),
        _ev(2, "fc2", 14, 44),
        # not GEMM tiles: ignored
        _ev(0, "dispatch", 0, 60),
        _ev(1, "combine", 50, 70),
    ]
    gaps, head, tail = tg.between_tile_gaps(events)
    assert dict(gaps) == {
        ("fc1", "fc1"): [1.0],
        ("fc1", "fc2"): [2.0, 3.0],
        ("fc2", "fc2"): [0.5],
        ("fc2", "fc1"): [0.25],
    }
    # per SM in first-seen order (SM 0, 1, 2): offset from the first tile anywhere (10), tail to the last end (50)
    assert head == [0.0, 2.0, 4.0]
    assert tail == [5.0, 0.0, 4.0]


def test_no_gemm_tiles() -> None:
    tg = _load()
    gaps, head, tail = tg.between_tile_gaps([_ev(0, "schedule", 0, 5)])
    assert not gaps and head == [] and tail == []


@pytest.mark.parametrize("minibatches", [False, True])
def test_report_prints_every_transition(capsys: pytest.CaptureFixture[str], minibatches: bool) -> None:
    tg = _load()
    tg.report([_ev(0, "fc1", 0, 10), _ev(0, "fc2", 11, 20), _ev(1, "fc1", 0, 9)], minibatches)
    out = capsys.readouterr().out
    assert "fc1 -> fc2:      1 gaps" in out and "idle between tiles 0.5 us per SM" in out
    assert ("minibatch   0" in out) == minibatches
