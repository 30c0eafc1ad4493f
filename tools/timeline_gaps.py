#!/usr/bin/env python3
"""Where a forward timeline's GEMM SMs sit idle: per-minibatch progress and the gaps between one SM's
consecutive GEMM tiles, by transition (fc1 -> fc1, fc2 -> fc2, ...). Reads the JSON of tools/timeline.py.

    python tools/timeline_gaps.py timeline-dsv3.json [more.json ...]

A gap is the time from a tile's end event (its epilogue's stores issued) to the next tile's start on the same
SM (the consumers have the next tile's info): the producer's ticket, dependency wait and publication that
the previous tile's streaming did not hide. (A timeline launch adds one event atomic per tile to it.)
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_mok.kernel.timeline import TimelineEvent, load_json  # noqa: E402


def pct(v: list[float], p: float) -> float:
    return v[min(len(v) - 1, int(len(v) * p))]


def between_tile_gaps(
    events: list[TimelineEvent],
) -> tuple[dict[tuple[str, str], list[float]], list[float], list[float]]:
    """Per transition (kind of a tile, kind of the SM's next tile): the gaps in us from a tile's end to the next
    tile's start on the same SM; plus each SM's first-tile offset from the first tile anywhere and its end tail
    (last tile's end to the last end anywhere). GEMM tiles (fc1 / fc2) only."""
    gem = [e for e in events if e.kind in ("fc1", "fc2")]
    gaps: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    if not gem:
        return gaps, [], []
    t0 = min(e.start_us for e in gem)
    t1 = max(e.end_us for e in gem)
    by_sm: dict[int, list[TimelineEvent]] = collections.defaultdict(list)
    for e in gem:
        by_sm[e.sm].append(e)
    head, tail = [], []
    for es in by_sm.values():
        es.sort(key=lambda e: e.start_us)
        head.append(es[0].start_us - t0)
        tail.append(t1 - es[-1].end_us)
        for a, b in zip(es, es[1:]):
            gaps[(a.kind, b.kind)].append(b.start_us - a.end_us)
    return gaps, head, tail


def report(events: list[TimelineEvent], per_minibatch: bool) -> None:
    gem = [e for e in events if e.kind in ("fc1", "fc2")]
    if not gem:
        print("no GEMM tiles in this timeline")
        return
    comb = [e for e in events if e.kind == "combine"]
    t0 = min(e.start_us for e in gem)
    t1 = max(e.end_us for e in gem)
    line = f"GEMM window {t0:.1f} - {t1:.1f} us"
    if comb:
        line += f"; final sum {min(e.start_us for e in comb):.1f} - {max(e.end_us for e in comb):.1f} us"
    print(line)
    if per_minibatch:
        done: dict[int, float] = collections.defaultdict(float)
        first: dict[int, float] = collections.defaultdict(lambda: float("inf"))
        for e in gem:
            done[e.minibatch] = max(done[e.minibatch], e.end_us)
            first[e.minibatch] = min(first[e.minibatch], e.start_us)
        for m in sorted(done):
            print(f"  minibatch {m:3d}: first tile {first[m]:9.1f} us, last tile done {done[m]:9.1f} us")
    gaps, head, tail = between_tile_gaps(events)
    n = len(head)
    total = sum(sum(v) for v in gaps.values()) / n
    print(
        f"{n} SMs: idle between tiles {total:.1f} us per SM; first-tile offset {sum(head) / n:.1f}, end tail "
        f"{sum(tail) / n:.1f} (max {max(tail):.1f}) us per SM"
    )
    for (a, b), v in sorted(gaps.items()):
        v.sort()
        print(
            f"  {a} -> {b}: {len(v):6d} gaps, {sum(v) / n:7.1f} us per SM, p10 / p50 / p90 / p99 "
            f"{pct(v, 0.1):.2f} / {pct(v, 0.5):.2f} / {pct(v, 0.9):.2f} / {pct(v, 0.99):.2f} us"
        )
    for k in ("fc1", "fc2"):
        es = [e for e in gem if e.kind == k]
        d = sorted(e.end_us - e.start_us for e in es)
        epi = [e.end_us - e.mma_end_us for e in es if e.mma_end_us is not None]
        line = f"  {k} tiles: {len(d)}, p50 {pct(d, 0.5):.2f} us"
        if epi:
            line += f", epilogue mean {sum(epi) / len(epi):.2f} us"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="timeline JSON files (tools/timeline.py --out NAME writes NAME.json)")
    ap.add_argument("--minibatches", action="store_true", help="also print each minibatch's first / last tile")
    args = ap.parse_args()
    for path in args.json:
        print(f"== {path}")
        events, _ = load_json(path)
        report(events, args.minibatches)


if __name__ == "__main__":
    main()
