"""benchmarks/host_overhead.py's part timer: nested parts count for themselves only."""

from __future__ import annotations

import time

import pytest
from load_script import load_script


def test_part_timer_counts_nested_parts_once():
    ho = load_script("host_overhead", "benchmarks")
    timer = ho.PartTimer()
    inner = timer.wrap("inner", lambda: time.sleep(0.02))

    def outer_body():
        time.sleep(0.01)
        inner()
        inner()

    outer = timer.wrap("outer", outer_body)
    t0 = time.perf_counter()
    outer()
    whole = time.perf_counter() - t0
    assert timer.acc["inner"] == pytest.approx(0.04, abs=0.01)
    assert timer.acc["outer"] == pytest.approx(0.01, abs=0.008)  # without its inner parts
    assert timer.acc["inner"] + timer.acc["outer"] <= whole
    timer.acc.clear()
    inner()  # a part called alone is all its own
    assert timer.acc == {"inner": pytest.approx(0.02, abs=0.008)}
