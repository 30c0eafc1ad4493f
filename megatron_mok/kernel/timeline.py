"""In-kernel timeline of the MoK kernels (csrc/mok/timeline.cuh): per-SM intervals of, in the forward,
schedule, pull dispatch (per minibatch), fc1 / fc2 tiles and the final weighted sum; in the backward,
schedule, pull reverse-combine, stage-1 / stage-2 dgrad tiles (main loop and epilogue apart), the router
gradient (+ act rows) as background work of the comm SMs, and the grad_x sum.

    tl = Timeline(cap=4096)
    mok_forward(bufs, ..., timeline=tl)        # or mok_backward
    events = tl.events()                        # after the launch finished
    render_png(events, "timeline.png")          # tools/timeline.py does both

Recording costs one globaltimer read and one store per event; without a Timeline the kernel skips it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

KINDS = {
    0: "schedule",
    1: "dispatch",
    2: "fc1",
    3: "fc2",
    4: "combine",
    # backward kernel
    5: "pull",
    6: "dgrad1",
    7: "dgrad1_epilogue",
    8: "dgrad2",
    9: "push",
    10: "background",
    11: "grad_x",
}
FORWARD_KINDS = ("schedule", "dispatch", "fc1", "fc2", "combine")
BACKWARD_KINDS = ("schedule", "pull", "dgrad1", "dgrad1_epilogue", "dgrad2", "push", "background", "grad_x")
COLORS = {
    "schedule": "#999999",
    "dispatch": "#1f77b4",
    "fc1": "#2ca02c",
    "fc2": "#98df8a",
    "combine": "#d62728",
    "pull": "#1f77b4",
    "dgrad1": "#2ca02c",
    "dgrad1_epilogue": "#bcbd22",
    "dgrad2": "#98df8a",
    "push": "#ff7f0e",
    "background": "#9467bd",
    "grad_x": "#d62728",
}


@dataclass
class TimelineEvent:
    cta: int
    sm: int
    kind: str
    minibatch: int
    start_us: float
    end_us: float
    mma_end_us: float | None = None  # GEMM tiles: when its MMAs ended (the rest is the epilogue)


class Timeline:
    """Device buffers for one launch's events (grid x cap, 24 bytes each) and per-CTA counts."""

    def __init__(self, cap: int = 4096) -> None:
        if cap < 1:
            raise ValueError(f"Timeline cap must be >= 1, got {cap}")
        self.cap = cap
        self.grid = 0
        self.buf: torch.Tensor | None = None  # int64 [grid, cap, 3]: {tag, t0, t1}
        self.count: torch.Tensor | None = None  # int32 [grid]

    def prepare(self, grid: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate for ``grid`` CTAs; returns the (events, counts) tensors a launch records into."""
        if self.buf is None or self.grid != grid or self.buf.device != device:
            self.grid = grid
            self.buf = torch.zeros((grid, self.cap, 3), dtype=torch.int64, device=device)
            self.count = torch.zeros((grid,), dtype=torch.int32, device=device)
        return self.buf, self.count

    def events(self) -> list[TimelineEvent]:
        """Decode (synchronises); times in microseconds from the earliest event."""
        if self.buf is None or self.count is None:
            return []
        torch.cuda.synchronize(self.buf.device)
        counts = self.count.cpu().tolist()
        raw = self.buf.cpu()
        rows = []
        for cta, n in enumerate(counts):
            for tag, t0, t1 in raw[cta, : min(n, self.cap)].tolist():
                rows.append((cta, tag & 0xFFFFFFFF, t0, t1, (tag >> 32) & 0xFFFFFFFF))
        if not rows:
            return []
        base = min(r[2] for r in rows)
        return [
            TimelineEvent(
                cta=cta,
                sm=(tag >> 8) & 0xFF,
                kind=KINDS.get(tag & 0xFF, f"kind{tag & 0xFF}"),
                minibatch=tag >> 16,
                start_us=(t0 - base) / 1e3,
                end_us=(t1 - base) / 1e3,
                mma_end_us=(t0 + mma - base) / 1e3 if mma else None,
            )
            for cta, tag, t0, t1, mma in rows
        ]

    def dropped(self) -> int:
        """Events lost because a CTA recorded more than ``cap``."""
        if self.count is None:
            return 0
        return int((self.count.cpu() - self.cap).clamp(min=0).sum())


def save_json(events: list[TimelineEvent], path: str, meta: dict | None = None) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta or {}, "events": [asdict(e) for e in events]}, f)


def load_json(path: str) -> tuple[list[TimelineEvent], dict]:
    with open(path) as f:
        d = json.load(f)
    return [TimelineEvent(**e) for e in d["events"]], d.get("meta", {})


def summarize(events: list[TimelineEvent]) -> dict:
    """Span of the launch; per kind: busy SM-microseconds, its share of all CTAs' time over the span,
    and the wall window [first start, last end] in which that phase ran."""
    span = max((e.end_us for e in events), default=0.0)
    ctas = len({e.cta for e in events}) or 1
    busy: dict[str, float] = {}
    window: dict[str, list[float]] = {}
    for e in events:
        busy[e.kind] = busy.get(e.kind, 0.0) + (e.end_us - e.start_us)
        w = window.setdefault(e.kind, [e.start_us, e.end_us])
        w[0], w[1] = min(w[0], e.start_us), max(w[1], e.end_us)
    share = {k: v / (span * ctas) if span > 0 else 0.0 for k, v in busy.items()}
    # GEMM tiles that carry their MMA end: mean tile and epilogue time (what the tensor cores of that
    # warpgroup waited for), to see what overlapping the epilogue with the next tile's MMAs could gain
    tiles: dict[str, list[float]] = {}
    for e in events:
        if e.mma_end_us is not None:
            t = tiles.setdefault(e.kind, [0, 0.0, 0.0])
            t[0] += 1
            t[1] += e.end_us - e.start_us
            t[2] += e.end_us - e.mma_end_us
    per_tile = {k: {"tiles": n, "mean_us": tot / n, "epilogue_us": epi / n} for k, (n, tot, epi) in tiles.items()}
    return {
        "span_us": span,
        "ctas": ctas,
        "busy_sm_us": busy,
        "sm_time_share": share,
        "window_us": window,
        "tile_us": per_tile,
    }


@dataclass(frozen=True)
class PhaseWork:
    """What one phase of a launch must do: ``amount`` FLOP (unit "flop") or bytes read + written
    (unit "byte"), and the ceiling of the unit that does it (TFLOP/s or GB/s for the whole GPU)."""

    amount: float
    unit: str
    ceiling: float


def phase_fractions(summary: dict, work: dict[str, PhaseWork], num_sms: int) -> dict[str, dict[str, float]]:
    """Per phase: its rate per busy SM-second scaled to the whole GPU (what every SM running it at that
    rate would do) and over its wall window, each as a fraction of the phase's ceiling. A memory phase
    run by a few comm SMs shows both: per-SM efficiency, and whether the window itself was long."""
    out: dict[str, dict[str, float]] = {}
    for kind, wk in work.items():
        busy = summary["busy_sm_us"].get(kind, 0.0)
        win = summary["window_us"].get(kind)
        if busy <= 0 or not win:
            continue
        unit = 1e12 if wk.unit == "flop" else 1e9  # TFLOP/s or GB/s
        full = wk.amount / (busy * 1e-6 / num_sms) / unit
        wall = wk.amount / (max(win[1] - win[0], 1e-9) * 1e-6) / unit
        out[kind] = {
            "rate_full_gpu": full,
            "frac_full_gpu": full / wk.ceiling,
            "rate_window": wall,
            "frac_window": wall / wk.ceiling,
        }
    return out


def render_png(events: list[TimelineEvent], path: str, title: str = "MoK forward kernel timeline") -> None:
    """One row per CTA (= SM), one bar per event, coloured by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ctas = sorted({e.cta for e in events})
    fig, ax = plt.subplots(figsize=(14, max(4.0, 0.06 * len(ctas) + 2)))
    present = [k for k in COLORS if any(e.kind == k for e in events)]
    for kind in present:
        color = COLORS[kind]
        segs: dict[int, list[tuple[float, float]]] = {}
        for e in events:
            if e.kind == kind:
                segs.setdefault(e.cta, []).append((e.start_us, max(e.end_us - e.start_us, 0.05)))
        for cta, bars in segs.items():
            ax.broken_barh(bars, (cta - 0.4, 0.8), facecolors=color, linewidth=0)
    ax.set_xlabel("time (us)")
    ax.set_ylabel("CTA (one per SM; comm CTAs first in each rank's partition)")
    ax.set_ylim(-1, len(ctas))
    ax.invert_yaxis()
    ax.set_title(title)
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in present], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
