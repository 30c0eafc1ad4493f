"""CPU: timeline JSON round trip, summary and (with matplotlib) the PNG."""

from __future__ import annotations

import pytest

from megatron_mok.kernel.timeline import TimelineEvent, load_json, render_png, save_json, summarize


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


def test_png(tmp_path):
    pytest.importorskip("matplotlib")
    p = tmp_path / "t.png"
    render_png(_events(), str(p))
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
