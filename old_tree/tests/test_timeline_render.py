"""CPU: timeline JSON round trip, summary and (with matplotlib) the PNG."""

from __future__ import annotations

import pytest

from megatron_mok.kernel.timeline import (
    PhaseWork,
    TimelineEvent,
    load_json,
    phase_fractions,
    render_png,
    save_json,
    summarize,
)


def _events():
    return [
        TimelineEvent(0, 0, "schedule", 0, 0.0, 5.0),
        TimelineEvent(0, 0, "dispatch", 0, 5.0, 20.0),
        TimelineEvent(1, 1, "fc1", 0, 21.0, 40.0),
        TimelineEvent(1, 1, "fc2", 0, 41.0, 60.0),
        TimelineEvent(0, 0, "combine", 0, 61.0, 70.0),
    ]


def test_json_round_trip_and_summary(tmp_path):
    p = tmp_path / "t.json"
    save_json(_events(), str(p), {"config": "tiny"})
    ev, meta = load_json(str(p))
    assert ev == _events() and meta == {"config": "tiny"}
    s = summarize(ev)
    assert s["span_us"] == 70.0
    assert s["busy_sm_us"] == {"schedule": 5.0, "dispatch": 15.0, "fc1": 19.0, "fc2": 19.0, "combine": 9.0}
    assert s["ctas"] == 2 and s["window_us"]["dispatch"] == [5.0, 20.0]
    assert abs(s["sm_time_share"]["fc1"] - 19.0 / 140.0) < 1e-12


def test_phase_fractions_scale_busy_time_to_the_gpu_and_use_the_window():
    s = summarize(_events())  # 2 CTAs; fc1 busy 19 us in window [21, 40]; dispatch 15 us in [5, 20]
    work = {
        "fc1": PhaseWork(19e6, "flop", 100.0),
        "dispatch": PhaseWork(3e5, "byte", 10.0),
        "missing": PhaseWork(1.0, "byte", 1.0),
    }
    f = phase_fractions(s, work, num_sms=2)
    assert set(f) == {"fc1", "dispatch"}  # phases without events are left out
    # fc1: 19e6 FLOP in 19 us of one SM -> 1e12 FLOP/s per SM -> 2 TFLOP/s on 2 SMs = 2 % of 100
    assert abs(f["fc1"]["rate_full_gpu"] - 2.0) < 1e-9 and abs(f["fc1"]["frac_full_gpu"] - 0.02) < 1e-12
    assert abs(f["fc1"]["rate_window"] - 1.0) < 1e-9  # 19e6 FLOP over the 19 us window
    # dispatch: 3e5 B in 15 us busy on 1 of 2 SMs -> 40 GB/s at full GPU, 20 GB/s over its window
    assert abs(f["dispatch"]["rate_full_gpu"] - 40.0) < 1e-9 and abs(f["dispatch"]["frac_window"] - 2.0) < 1e-9


def test_png(tmp_path):
    pytest.importorskip("matplotlib")
    p = tmp_path / "t.png"
    render_png(_events(), str(p))
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
