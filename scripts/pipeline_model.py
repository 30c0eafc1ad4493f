#!/usr/bin/env python3
"""Executable model of the MoK forward kernel's compute pipeline, run under adversarial schedulers.

What it models: one compute CTA (MOK_CLUSTER unset) or one 2-CTA cluster (MOK_CLUSTER=2) of the forward
kernel, from the producer's first ticket to the consumers' final named barrier -- the stage ring (full /
empty mbarriers with transaction bytes, kStages = 4), the 2-deep tile-info ring, the FP8 issue-order
barriers `issued` (MOK_FP8_ISSUE_ORDER 1 / 2), the 2-CTA ticket mailbox, remote empty arrivals, TMA
multicast of shared weight tiles, pass tiles (kind 3), the bf16 second warpgroup's skip branch, the
deferred fc1_done release's named-barrier syncs, consumer_sync and the final cluster barrier. The control
flow is a line-by-line port; each agent's code follows:

  P{c}          producer thread (threadIdx.x 0 of CTA c)
                  expert_ffn.cuh: ffn_producer (single CTA; tickets, rasters 0 / 1 / bands),
                  ffn_producer_pair (clusters), publish_tile, stream_tile, compute_role (cluster_arrive)
                  cluster_pair.cuh: ticket_send (leader) / ticket_receive (follower)
                  ring_buffer.cuh: num_minibatches, mb_begin, count_mtiles, find_mtile
                  pair_tiles.cuh: count_pair_units, find_pair_unit
  C{c}.wg{g}.w{w}  warp w of consumer warpgroup g (lane 0 of each warp signals `issued`; warp 0 is thread
                  lt == 0, which also releases stages, arrives on info_empty and leads skip_kloop)
                  expert_ffn.cuh: ffn_consumer (the bf16 K loop is inline there), skip_kloop,
                  release_stage, compute_role's tail (cluster_arrive / cluster_wait, named_bar_sync(1, 256))
                  fp8_kloop.cuh: ffn_kloop_fp8 (issued: order 1 after issue, order 2 after landing)
                  deferred_release.cuh: DeferredActRelease::before_wait / flush / hold (named barriers)
  R{c}          warps 1-3 of WG0: compute_role's cluster_arrive_relaxed (at once); warp 0's other lanes arrive
                with the producer once it is done (the cluster barrier counts whole warps on sm_90)
  asynchronous  each TMA load landing in each destination CTA (complete_tx), each remote mbarrier arrival
                (in flight per issuing thread, in order unless --reorder-remote), each WGMMA group landing
                (launched once all four warps of the warpgroup issued it; a warpgroup's groups land in order)

skip_kloop follows the current code: only the warpgroup's thread 0 waits on full[st], arrives four times on
issued[st] (mbar_arrive_count; FP8 issue order, first warpgroup, passes) and releases the stage; the other
warps only move st / ph on. The earlier form (every warp waits on full[st] itself and its lane 0 arrives
once on issued[st]) is the seeded bug `skip_per_warp`.

Checks (a violation is reported with the step it happened at and, with --show, the trace):
  (a) no deadlock; the final state is consistent (full / empty / issued phases equal the stage's fills, the
      info ring, mailbox and named / cluster barriers are idle, both CTAs of a cluster agree);
  (b) no TMA into a stage of a CTA whose consumer warpgroups have not released the stage's previous use or
      while a WGMMA group still reads it; a producer passes empty[st] only once every consumer warpgroup
      (both CTAs' with clusters) released it; nothing reaches a CTA that has exited;
  (c) every mbarrier wait catches exactly the phase its use of the barrier means (stale / lapped passes),
      no mbarrier is arrived on past its count, and a WGMMA group launches on a stage holding exactly its
      use's 48 KB;
  (d) issue order 1 / 2: the second warpgroup's group on a stage use launches only after all four warps of
      the first warpgroup arrived on issued[] for that use;
  (e) mailbox messages and tile infos are read exactly once and in order, never overwritten unread.

Not modelled (abstractions):
  * data: accumulators, scales, epilogue stores, pushes; a stage's content is its bytes per use;
  * sizes: a stage is A 16 KB + B 32 KB (bf16 and fp8 alike); nk1 / nk2 / nt1 / nt2 / segment offsets /
    minibatch size are drawn small;
  * dependency waits (ready / fc1_done counters) and their values: a tile's wait succeeds, or the chosen
    one fails (an abort: the producer publishes exit; with clusters the leader sends go = 0); DeferredRelease
    (mb_done, thread 0 only) has no synchronisation and is left out; DeferredActRelease only as its named
    barriers (whether a release is held is uniform over the warpgroup);
  * tickets: the atomicAdd values are a drawn increasing list (other CTAs / clusters take the rest);
  * timeouts and traps: a wait that never completes is a deadlock;
  * memory model beyond barrier order: fences, proxies, acquire / release (the mailbox entry is read after
    its full barrier, remote arrivals of one thread arrive in order, a release cluster_arrive first
    drains the thread's remote arrivals);
  * lanes: a warp's lanes move together (the code's divergent `if (lt == 0)` / `if (lead)` blocks are
    taken to reconverge at their end); the warps of a warpgroup are independent agents;
  * WGMMA: only launch (all four warps issued), in-order landing and wait_group; warpgroup_arrive fences
    and tensor-core scheduling are abstract;
  * the barrier init and the first cluster barrier (everything starts initialised), pair_agree, the
    in-SM pull warps (insm_pull_role), consumer_lead_ns (subsumed by the schedulers), TMA descriptor
    prefetch, timeline records, the compute_done counter and the final reduce.

Usage (each run draws a configuration -- cluster or single CTA, dtype, issue order, consumer_sync, K
blocks, n-tiles, segments, minibatch size, tickets, abort -- and a schedule from its seed):

  python scripts/pipeline_model.py --runs 2000 --seed 1                # clusters, every dtype / order
  python scripts/pipeline_model.py --single --dtype bf16 --runs 1000   # one CTA, bf16 (the skip branch)
  python scripts/pipeline_model.py --dtype fp8 --order 2 --policy warp_lag --runs 500
  python scripts/pipeline_model.py --mutant skip_per_warp --runs 200   # a seeded bug: violations expected
  python scripts/pipeline_model.py --replay 1000069                    # one run (its printed seed), full trace

--policy picks one scheduler (default: rotate over all, see POLICIES), --lag-bound keeps the warps of a
warpgroup within that many K blocks of each other, --small draws smaller configurations, --reorder-remote
lets one thread's remote arrivals overtake each other (beyond PTX), --json writes the statistics. The exit
status is 1 if any run reported a violation.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
from collections.abc import Callable, Generator, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, TypeVar

KSTAGES = 4  # common.cuh: kStages
KBM = 128  # common.cuh: kBM (rows of a tile)
A_KB = 16  # kATileBytes: 128 rows x 128 B
HALF_KB = 16  # kBTileBytes / 2
STAGE_KB = A_KB + 2 * HALF_KB  # kStageBytes

MUTANTS: dict[str, str] = {
    "skip_per_warp": "skip_kloop as before 91be0f3: every warp waits on full[st] itself, lane 0 arrives once on issued",
    "no_pass_issued": "a pass tile does not move the issue-order barriers on (the bug a9b8d05 fixed)",
    "no_remote_release": "release_stage arrives only on its own CTA's empty barrier",
    "no_multicast_peer": "a shared weight half is loaded into the issuing CTA only",
    "empty2": "clustered empty barriers count 2 (one CTA's warpgroups) instead of 4",
    "box_nowait": "ticket_send does not wait for the mailbox entry to be read",
}


# ------------------------------------------------------------------------------------------------
# Tile enumeration: ring_buffer.cuh and pair_tiles.cuh, ported 1:1.
def num_minibatches(n: int, m: int) -> int:
    return (n + m - 1) // m


def mb_begin(off: list[int], nseg: int, m: int, i: int) -> int:
    n = off[nseg]
    p = i * m
    if p >= n:
        return n
    lo, hi = 0, nseg - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if off[mid] <= p:
            lo = mid
        else:
            hi = mid - 1
    return off[lo] + ((p - off[lo]) // KBM) * KBM


def count_mtiles(off: list[int], nseg: int, a: int, b: int) -> int:
    n = 0
    for e in range(nseg):
        s0, s1 = max(a, off[e]), min(b, off[e + 1])
        if s1 > s0:
            n += (s1 - s0 + KBM - 1) // KBM
    return n


def find_mtile(off: list[int], nseg: int, a: int, b: int, mt: int) -> tuple[bool, int, int, int]:
    """(found, segment, row0, rows) of row block mt of [a, b)."""
    lo, hi = 0, nseg - 1
    while lo < hi:
        mid = (lo + hi) >> 1
        if off[mid + 1] > a:
            hi = mid
        else:
            lo = mid + 1
    e = lo
    while e < nseg and off[e] < b:
        s0, s1 = max(a, off[e]), min(b, off[e + 1])
        if s1 > s0:
            nt = (s1 - s0 + KBM - 1) // KBM
            if mt < nt:
                row0 = s0 + mt * KBM
                return True, e, row0, min(KBM, s1 - row0)
            mt -= nt
        e += 1
    return False, 0, 0, 0


@dataclass
class PairUnit:
    seg: int
    mt: list[int]
    nt: list[int]  # nt[1] == -1: CTA 1 has no tile (a pass)
    row0: list[int]
    rows: list[int]
    share_b: int


def count_pair_units(off: list[int], nseg: int, a: int, b: int, ntc: int) -> int:
    n_units = 0
    for s in range(nseg):
        s0 = max(a, off[s])
        s1 = min(b, off[s + 1])
        if s1 <= s0:
            continue
        n = (s1 - s0 + KBM - 1) // KBM
        n_units += (n // 2) * ntc + (n % 2) * ((ntc + 1) // 2)
    return n_units


def find_pair_unit(off: list[int], nseg: int, a: int, b: int, u: int, ntc: int) -> PairUnit | None:
    lo, hi = 0, nseg - 1
    while lo < hi:
        mid = (lo + hi) >> 1
        if off[mid + 1] > a:
            hi = mid
        else:
            lo = mid + 1
    mt_base = 0
    s = lo
    while s < nseg and off[s] < b:
        s0 = max(a, off[s])
        s1 = min(b, off[s + 1])
        if s1 > s0:
            n = (s1 - s0 + KBM - 1) // KBM
            paired = (n // 2) * ntc
            units = paired + (n % 2) * ((ntc + 1) // 2)
            if u < units:
                pu = PairUnit(s, [0, 0], [0, 0], [0, 0], [0, 0], 0)
                if u < paired:
                    p = u // ntc
                    for h in range(2):
                        pu.mt[h] = mt_base + 2 * p + h
                        pu.nt[h] = u % ntc
                        pu.row0[h] = s0 + (2 * p + h) * KBM
                        pu.rows[h] = min(s1 - pu.row0[h], KBM)
                    pu.share_b = 1
                else:
                    c = u - paired
                    r0 = s0 + (n - 1) * KBM  # the segment's last row block
                    for h in range(2):
                        pu.mt[h] = mt_base + n - 1
                        pu.nt[h] = 2 * c + h if 2 * c + h < ntc else -1
                        pu.row0[h] = r0
                        pu.rows[h] = s1 - r0
                    pu.share_b = 0
                return pu
            u -= units
            mt_base += n
        s += 1
    return None


# ------------------------------------------------------------------------------------------------
# Synchronisation primitives.
Tag = Any  # what an arrival is tagged with (for traces and the mixed-phase note)


class Bar:
    """A PTX mbarrier: expected count, pending arrivals, tx-count (may go negative), completed phases."""

    def __init__(self, world: World, name: str, count: int) -> None:
        self.world, self.name, self.count = world, name, count
        self.pending, self.tx, self.phase = count, 0, 0
        self.cur: list[Tag] = []  # arrival tags of the phase in progress

    def arrive(self, tag: Tag = None, tx: int = 0, count: int = 1) -> None:
        """mbarrier.arrive[.expect_tx] with `count` arrivals (mbar_arrive_count) and `tx` expected KB."""
        if self.pending < count:
            self.world.violate("over_arrival", f"{self.name}: {count} arrival(s) {tag}, {self.pending} pending")
            return
        self.tx += tx
        self.pending -= count
        self.cur.extend([tag] * count)
        self._maybe_complete()

    def complete_tx(self, kb: int) -> None:
        self.tx -= kb
        self._maybe_complete()

    def _maybe_complete(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.world.on_phase(self, self.cur)
            self.phase += 1
            self.pending = self.count
            self.cur = []

    def ready(self, parity: int) -> bool:
        """try_wait.parity(parity) succeeds: the phase of that parity has completed."""
        return (self.phase & 1) != parity

    def __repr__(self) -> str:
        return f"{self.name}[phase {self.phase} pending {self.pending} tx {self.tx}]"


class NamedBar:
    """bar.sync / barrier.cta.red.or / barrier.cluster: `count` arrivals (warps or threads) per generation."""

    def __init__(self, name: str, count: int) -> None:
        self.name, self.count = name, count
        self.arrived, self.gen, self.acc = 0, 0, False
        self.result: dict[int, bool] = {}

    def arrive(self, pred: bool = False) -> int:
        g = self.gen
        self.acc = self.acc or pred
        self.arrived += 1
        if self.arrived == self.count:
            self.result[g] = self.acc
            self.gen += 1
            self.arrived, self.acc = 0, False
        return g

    def __repr__(self) -> str:
        return f"{self.name}[gen {self.gen} arrived {self.arrived}/{self.count}]"


class Blocked(NamedTuple):
    """What an agent yields when it may block: it runs on once ready() holds."""

    ready: Callable[[], bool]
    what: str
    on: Bar | NamedBar | None = None


T = TypeVar("T")
Step = Blocked | None  # None: a scheduling point (the agent stays runnable)
Proc = Generator[Step, None, T]  # an agent's code


@dataclass
class Info:
    """TileInfo, as far as the pipeline sees it. kind 0 exit, 1 fc1, 2 fc2, 3 pass."""

    seq: int
    kind: int
    nk: int = 0
    rows: int = 0
    tag: str = ""


@dataclass(eq=False)
class Load:
    """A TMA load in flight into one destination CTA."""

    dest: int
    st: int
    use: int
    kb: int
    src: int


@dataclass
class Message:
    n: int
    ticket: int
    go: int
    read: bool = False


@dataclass
class Group:
    """One WGMMA group of a warpgroup."""

    st: int
    use: int
    issued_by: int = 0
    launched: bool = False
    landed: bool = False


class Smem:
    """The barriers and rings of one CTA's ComputeSmem (expert_ffn.cuh: carve_smem, compute_role's init)."""

    def __init__(self, world: World, c: int, cfg: Cfg) -> None:
        empty_count = 4 if cfg.cluster and cfg.mutant != "empty2" else 2  # paired ? 2 * kConsumerWGs : kConsumerWGs
        self.full = [Bar(world, f"c{c}.full[{i}]", 1) for i in range(KSTAGES)]
        self.empty = [Bar(world, f"c{c}.empty[{i}]", empty_count) for i in range(KSTAGES)]
        self.issued = [Bar(world, f"c{c}.issued[{i}]", 4) for i in range(KSTAGES)]
        self.info_full = [Bar(world, f"c{c}.info_full[{i}]", 1) for i in range(2)]
        self.info_empty = [Bar(world, f"c{c}.info_empty[{i}]", 2) for i in range(2)]
        self.info: list[Info | None] = [None, None]
        self.info_reads = [8, 8]  # warps that read the slot's current info
        self.box_full = [Bar(world, f"c{c}.box.full[{i}]", 1) for i in range(2)]
        self.box_empty = [Bar(world, f"c{c}.box.empty[{i}]", 1) for i in range(2)]
        self.box_entry: list[Message | None] = [None, None]
        # named barriers in warps: 1 = both consumer warpgroups (256 threads), 2 / 3 = one warpgroup each
        self.nb = {1: NamedBar(f"c{c}.bar1", 8), 2: NamedBar(f"c{c}.bar2", 4), 3: NamedBar(f"c{c}.bar3", 4)}


class Agent:
    """One thread (producer), one warp (consumers) or a set of threads acting at once (rest of WG0)."""

    def __init__(self, name: str, cta: int, role: str, wgc: int | None = None, warp: int | None = None) -> None:
        self.name, self.cta, self.role, self.wgc, self.warp = name, cta, role, wgc, warp
        self.proc: Proc[None] | None = None
        self.blocked: Blocked | None = None
        self.done = False
        self.outbox: collections.deque[tuple[int, Bar, Tag]] = collections.deque()  # remote arrivals in flight
        self.progress = 0  # K-block iterations done (the --lag-bound fairness)
        self.issued_cnt = 0  # WGMMA groups this warp issued


class Actor(NamedTuple):
    """An enabled scheduling choice (World.fire runs it)."""

    kind: str  # agent (resume it), remote (deliver an arrival), tma (a load lands), land (a WGMMA group lands)
    cta: int  # the agent's CTA or the destination's
    name: str
    agent: Agent | None = None  # kind agent: the agent; kind remote: the issuing thread
    arg: Any = None  # remote: outbox index; tma: the Load; land: the warpgroup


class Stop(Exception):
    pass


# ------------------------------------------------------------------------------------------------
@dataclass
class Cfg:
    """One run's configuration (gen_cfg draws them)."""

    cluster: bool = True
    fp8: bool = False
    order: int = 0  # MOK_FP8_ISSUE_ORDER (fp8 only)
    consumer_sync: bool = False
    nk1: int = 2  # ceil(H / bk)
    nk2: int = 3  # ceil(F / bk)
    nt1: int = 1
    nt2: int = 1
    off: list[int] = field(default_factory=lambda: [0, 100])  # processing-order segment offsets
    M: int = 256  # minibatch rows
    tickets: list[int] = field(default_factory=list)  # this CTA's / cluster's tickets (the last one past the end)
    abort_n: int = -1  # clusters: the leader's n-th message fails its dependency wait; single CTA: the n-th tile
    raster: int = 0  # single CTA: 0 row-block major, 1 n-tile major, > 1 bands of that many row blocks
    reorder_remote: bool = False  # one thread's remote arrivals may overtake each other (beyond PTX)
    mutant: str = ""  # a seeded bug (MUTANTS) to show the checks fire

    def describe(self) -> str:
        return json.dumps(asdict(self))


def advance(st: int, ph: int) -> tuple[int, int]:
    """`if (++st == kStages) { st = 0; ph ^= 1u; }`"""
    st += 1
    if st == KSTAGES:
        return 0, ph ^ 1
    return st, ph


class World:
    """The CTA(s) of one run: shared memory, agents, in-flight operations and the checks' bookkeeping."""

    def __init__(self, cfg: Cfg, trace: bool = True) -> None:
        if cfg.mutant and cfg.mutant not in MUTANTS:
            raise ValueError(f"unknown mutant {cfg.mutant!r}: one of {', '.join(MUTANTS)}")
        self.cfg = cfg
        self.C = 2 if cfg.cluster else 1
        self.violations: list[tuple[str, str, int]] = []
        self.trace_on = trace
        self.trace: list[str] = []
        self.step = 0
        self.cur_agent: Agent | None = None
        self.mixed_phases = 0
        C = self.C
        self.sm = [Smem(self, c, cfg) for c in range(C)]
        self.cluster_bar = NamedBar("cluster", 10 * C)  # per CTA: producer, rest of WG0, 8 consumer warps
        # bookkeeping for the checks (not program state)
        self.content: list[list[collections.Counter[int]]]  # KB landed per use, per CTA and stage
        self.content = [[collections.Counter() for _ in range(KSTAGES)] for _ in range(C)]
        self.released = [[[0] * KSTAGES for _ in range(2)] for _ in range(C)]  # uses released per warpgroup
        self.fills = [[0] * KSTAGES for _ in range(C)]  # uses the producer started per stage
        self.iss_arr = [[[0] * KSTAGES for _ in range(4)] for _ in range(C)]  # issued arrivals per wg0 warp
        self.groups: list[list[list[Group]]] = [[[] for _ in range(2)] for _ in range(C)]
        self.landed = [[0, 0] for _ in range(C)]
        self.tma: list[Load] = []
        self.exited = [False] * C
        self.sent: list[tuple[int, int, int]] = []
        self.received: list[tuple[int, int, int]] = []
        self.published = [0] * C
        self.agents: list[Agent] = []
        for c in range(C):
            p = Agent(f"P{c}", c, "prod")
            p.proc = self.producer_pair(p) if cfg.cluster else self.producer_single(p)
            self.agents.append(p)
            for wgc in range(2):
                for w in range(4):
                    a = Agent(f"C{c}.wg{wgc}.w{w}", c, f"wg{wgc}", wgc, w)
                    a.proc = self.consumer(a)
                    self.agents.append(a)
            r = Agent(f"R{c}", c, "rest")
            r.proc = self.rest_of_wg0(r)
            self.agents.append(r)
        self.agent_actor = {a.name: Actor("agent", a.cta, a.name, a) for a in self.agents}
        self.land_actor = [[Actor("land", c, "land", None, wgc) for wgc in range(2)] for c in range(C)]
        self.wg_agents = {
            (c, g): [a for a in self.agents if a.cta == c and a.wgc == g] for c in range(C) for g in range(2)
        }

    # ---------------------------------------------------------------- bookkeeping
    def log(self, msg: str) -> None:
        if self.trace_on:
            who = self.cur_agent.name if self.cur_agent is not None else "async"
            self.trace.append(f"{self.step:5d} {who:12s} {msg}")

    def violate(self, kind: str, msg: str) -> None:
        self.violations.append((kind, msg, self.step))
        self.log(f"!!! VIOLATION {kind}: {msg}")
        if len(self.violations) >= 40:
            raise Stop()

    def on_phase(self, bar: Bar, tags: list[Tag]) -> None:
        # a clustered empty barrier's phase may complete with arrivals of two uses (legal: noted for the stats)
        if self.cfg.cluster and bar.name.split(".", 1)[1].startswith("empty["):
            uses = {t[2] for t in tags if t is not None}
            if len(uses) > 1:
                self.mixed_phases += 1
                self.log(f"(note) {bar.name} phase {bar.phase} completes with arrivals of uses {sorted(uses)}")

    def wait(self, a: Agent, bar: Bar, parity: int, expect: int, what: str) -> Proc[None]:
        """mbar_wait: block until try_wait.parity succeeds, then check it caught phase `expect` (1-based)."""
        yield Blocked(lambda: bar.ready(parity), f"wait parity {parity} ({what})", bar)
        if bar.phase != expect:
            kind = "stale_pass" if bar.phase < expect else "lapped_pass"
            self.violate(
                f"{kind}:{what}",
                f"{a.name} waited on {bar.name} parity {parity} for completed phase {expect}, "
                f"the barrier has completed {bar.phase}",
            )
        self.log(f"passed {bar.name} parity {parity} (phase {bar.phase}, wanted {expect}) {what}")

    def nbsync(self, a: Agent, nb: NamedBar, pred: bool = False, what: str = "") -> Proc[bool]:
        """named_bar_sync / named_bar_any (the OR of the arrivals' predicates)."""
        g = nb.arrive(pred)
        self.log(f"arrive {nb.name} gen {g} {what}")
        yield Blocked(lambda: nb.gen > g, f"gen {g} {what}", nb)
        return nb.result[g]

    def remote_arrive(self, a: Agent, dest: int, bar: Bar, tag: Tag) -> None:
        """remote_arrive_release: delivered later (Actor 'remote'), in order per issuing thread."""
        a.outbox.append((dest, bar, tag))
        self.log(f"remote arrive -> {bar.name} {tag} (in flight)")

    def deliver(self, a: Agent, idx: int) -> None:
        dest, bar, tag = a.outbox[idx]
        del a.outbox[idx]
        if self.exited[dest]:
            self.violate("remote_after_exit", f"remote arrival {tag} from {a.name} reaches exited CTA {dest}")
        self.log(f"remote arrival lands {bar.name} {tag} (from {a.name})")
        bar.arrive(tag)

    # ---------------------------------------------------------------- TMA
    def tma_issue(self, a: Agent, dests: list[int], st: int, use: int, kb: int) -> None:
        for d in dests:
            # (b) the destination's consumers released the stage's previous use and no group reads it
            for wg in range(2):
                if self.released[d][wg][st] < use:
                    self.violate(
                        "tma_overwrite",
                        f"{a.name} TMA use {use} of stage {st} into CTA {d} while wg{wg} of CTA {d} released "
                        f"only {self.released[d][wg][st]} uses",
                    )
                for g in self.groups[d][wg]:
                    if g.st == st and g.launched and not g.landed and g.use < use:
                        self.violate(
                            "tma_overwrite_inflight",
                            f"{a.name} TMA into CTA {d} stage {st} while wg{wg} group (use {g.use}) reads it",
                        )
            if self.exited[d]:
                self.violate("tma_after_exit", f"{a.name} TMA into exited CTA {d}")
            self.tma.append(Load(d, st, use, kb, a.cta))
        self.log(f"TMA issue stage {st} use {use} {kb}KB -> CTAs {dests}")

    def tma_land(self, t: Load) -> None:
        self.tma.remove(t)
        if self.exited[t.dest]:
            self.violate("tma_after_exit", f"TMA lands in exited CTA {t.dest}")
        self.content[t.dest][t.st][t.use] += t.kb
        self.log(f"TMA lands CTA {t.dest} stage {t.st} use {t.use} {t.kb}KB (from P{t.src})")
        self.sm[t.dest].full[t.st].complete_tx(t.kb)

    # ---------------------------------------------------------------- WGMMA groups
    def wg_issue(self, a: Agent, st: int, use: int) -> None:
        """This warp's part of a group (warpgroup_arrive, the wgmmas, commit_batch)."""
        c, wgc = a.cta, a.wgc
        assert wgc is not None
        k = a.issued_cnt
        gl = self.groups[c][wgc]
        if k == len(gl):
            gl.append(Group(st, use))
        g = gl[k]
        if (g.st, g.use) != (st, use):
            self.violate(
                "warp_divergence",
                f"{a.name} issues group {k} on stage {st} use {use}, other warps issued it on stage {g.st} use {g.use}",
            )
        g.issued_by += 1
        a.issued_cnt += 1
        self.log(f"wgmma issue group {k} (stage {st} use {use}) {g.issued_by}/4")
        if g.issued_by < 4:
            return
        g.launched = True
        cont = self.content[c][st]
        if cont.get(use, 0) != STAGE_KB or (cont and max(cont) > use):
            self.violate(
                "read_bad_stage", f"wg{wgc} of CTA {c} launches on stage {st} use {use}, stage holds {dict(cont)}"
            )
        if wgc == 1 and self.cfg.fp8 and self.cfg.order:
            arr = [self.iss_arr[c][w][st] for w in range(4)]
            if min(arr) < use + 1:
                self.violate(
                    "issue_order",
                    f"CTA {c} wg1 group on stage {st} use {use} starts before wg0's warps arrived for that use "
                    f"(arrivals per warp {arr})",
                )
        self.log(f"group {k} of wg{wgc} launched (stage {st} use {use})")

    def wgmma_wait(self, a: Agent, n: int) -> Proc[None]:
        """warpgroup_wait<n>: at most n of this warp's groups still in flight."""
        c, wgc = a.cta, a.wgc
        assert wgc is not None
        need = a.issued_cnt - n
        yield Blocked(lambda: self.landed[c][wgc] >= need, f"wgmma.wait_group<{n}> ({need} landed)")

    def group_land(self, c: int, wgc: int) -> None:
        g = self.groups[c][wgc][self.landed[c][wgc]]
        g.landed = True
        self.landed[c][wgc] += 1
        self.log(f"wg{wgc} CTA {c} group (stage {g.st} use {g.use}) landed")

    # ---------------------------------------------------------------- producer pieces
    def publish_tile(self, a: Agent, ti: Info, ii: int, iph: int) -> Proc[tuple[int, int]]:
        """expert_ffn.cuh: publish_tile."""
        s = self.sm[a.cta]
        k = self.published[a.cta]
        yield from self.wait(a, s.info_empty[ii], iph ^ 1, k // 2, "info_empty")
        if s.info_reads[ii] != 8:
            self.violate("info_overwrite", f"{a.name} overwrites info slot {ii} read by {s.info_reads[ii]}/8 warps")
        ti.seq = k
        s.info[ii] = ti
        s.info_reads[ii] = 0
        self.published[a.cta] += 1
        self.log(f"write info[{ii}] = {ti}")
        yield None
        s.info_full[ii].arrive(("prod", k))
        self.log(f"arrive info_full[{ii}]")
        yield None
        ii += 1
        if ii == 2:
            ii, iph = 0, iph ^ 1
        return ii, iph

    def check_all_released(self, a: Agent, st: int, use: int) -> None:
        """Invariant: a stage (of either CTA, with clusters) is refilled only once every consumer warpgroup
        released its previous use."""
        for d in range(self.C):
            for wg in range(2):
                if self.released[d][wg][st] < use:
                    self.violate(
                        "empty_invariant",
                        f"{a.name} passes empty[{st}] for use {use} while wg{wg} of CTA {d} released "
                        f"{self.released[d][wg][st]} uses",
                    )

    def stream_tile(self, a: Agent, ti: Info, share: int, st: int, ph: int) -> Proc[tuple[int, int]]:
        """expert_ffn.cuh: stream_tile (share: -1, or the weight half this CTA multicasts)."""
        c, cfg, s = a.cta, self.cfg, self.sm[a.cta]
        for _kb in range(ti.nk):
            use = self.fills[c][st]
            yield from self.wait(a, s.empty[st], ph ^ 1, use, "empty")
            self.check_all_released(a, st, use)
            self.fills[c][st] += 1
            if ti.kind == 3:  # a pass: the stages go round without data
                s.full[st].arrive(("pass", use))
                self.log(f"pass: arrive full[{st}] (use {use})")
                yield None
                st, ph = advance(st, ph)
                continue
            s.full[st].arrive(("prod", use), tx=STAGE_KB)
            self.log(f"arrive_expect_tx full[{st}] {STAGE_KB}KB (use {use})")
            yield None
            self.tma_issue(a, [c], st, use, A_KB)  # A rows
            yield None
            if share >= 0:  # half `share` of the weight tile, multicast into both CTAs
                self.tma_issue(a, [c] if cfg.mutant == "no_multicast_peer" else [0, 1], st, use, HALF_KB)
            elif ti.kind == 1 or cfg.cluster:  # gate + up rows; clustered w2 maps have half-tile boxes
                self.tma_issue(a, [c], st, use, HALF_KB)
                yield None
                self.tma_issue(a, [c], st, use, HALF_KB)
            else:
                self.tma_issue(a, [c], st, use, 2 * HALF_KB)
            yield None
            st, ph = advance(st, ph)
        return st, ph

    # ---------------------------------------------------------------- mailbox (cluster_pair.cuh)
    def ticket_send(self, a: Agent, n: int, ticket: int, go: int) -> Proc[None]:
        i, ph = n & 1, (n >> 1) & 1
        if self.cfg.mutant != "box_nowait":
            yield from self.wait(a, self.sm[0].box_empty[i], ph ^ 1, n >> 1, "box.empty")
        e = self.sm[1].box_entry[i]
        if e is not None and not e.read:
            self.violate("mailbox_overwrite", f"message {n} overwrites unread message {e.n}")
        self.sm[1].box_entry[i] = Message(n, ticket, go)
        self.sent.append((n, ticket, go))
        self.log(f"st.shared::cluster box.entry[{i}] = message {n} (ticket {ticket}, go {go})")
        self.remote_arrive(a, 1, self.sm[1].box_full[i], ("msg", n))
        yield None

    def ticket_receive(self, a: Agent, n: int) -> Proc[tuple[int, int]]:
        i, ph = n & 1, (n >> 1) & 1
        yield from self.wait(a, self.sm[1].box_full[i], ph, (n >> 1) + 1, "box.full")
        e = self.sm[1].box_entry[i]
        if e is None or e.n != n or e.read:
            self.violate("mailbox_order", f"the follower reads message {n}, the entry holds {e}")
        if e is None:
            raise Stop()
        e.read = True
        self.received.append((e.n, e.ticket, e.go))
        self.log(f"read box.entry[{i}] = message {e.n} (ticket {e.ticket}, go {e.go})")
        self.remote_arrive(a, 0, self.sm[0].box_empty[i], ("ack", n))
        yield None
        return e.ticket, e.go

    # ---------------------------------------------------------------- producers
    def producer_pair(self, a: Agent) -> Proc[None]:
        """expert_ffn.cuh: ffn_producer_pair, then compute_role's cluster_arrive."""
        cfg, crank = self.cfg, a.cta
        off, nseg, M = cfg.off, len(cfg.off) - 1, cfg.M
        nmb = num_minibatches(off[nseg], M)
        cur_mb, cur_a, cur_b = 0, 0, mb_begin(off, nseg, M, 1)
        cur_u1 = count_pair_units(off, nseg, cur_a, cur_b, cfg.nt1)
        cur_u2 = count_pair_units(off, nseg, cur_a, cur_b, cfg.nt2)
        cur_base = 0
        st, ph, ii, iph = 0, 0, 0, 0
        tickets = iter(cfg.tickets)
        n = 0
        while True:
            go = 0
            if crank == 0:
                tk = next(tickets)
                self.log(f"atomicAdd ticket -> {tk}")
                yield None
            else:
                tk, go = yield from self.ticket_receive(a, n)
            while cur_mb < nmb and tk >= cur_base + cur_u1 + cur_u2:
                cur_base += cur_u1 + cur_u2
                cur_mb += 1
                cur_a = cur_b
                cur_b = mb_begin(off, nseg, M, cur_mb + 1)
                cur_u1 = count_pair_units(off, nseg, cur_a, cur_b, cfg.nt1)
                cur_u2 = count_pair_units(off, nseg, cur_a, cur_b, cfg.nt2)
            mb = cur_mb
            kind = 0
            pu = None
            if mb < nmb:
                u = tk - cur_base
                kind = 1 if u < cur_u1 else 2
                if kind == 2:
                    u -= cur_u1
                pu = find_pair_unit(off, nseg, cur_a, cur_b, u, cfg.nt1 if kind == 1 else cfg.nt2)
                if pu is None:  # cannot happen
                    self.violate("internal", f"find_pair_unit failed for ticket {tk}")
                    kind = 0
            if crank == 0:  # the dependencies of both tiles (abstract); the verdict goes with the ticket
                ok = kind != 0
                if kind != 0:
                    ok = n != cfg.abort_n
                    self.log(f"dependency wait for ticket {tk}: {'ok' if ok else 'FAILED (abort)'}")
                    yield None
                go = 1 if ok else 0
                yield from self.ticket_send(a, n, tk, go)
            ti = Info(-1, 0)
            if go and kind != 0:
                assert pu is not None
                h = crank
                ti = Info(
                    -1,
                    3 if pu.nt[h] < 0 else kind,
                    cfg.nk1 if kind == 1 else cfg.nk2,
                    pu.rows[h],
                    f"mb{mb} k{kind} mt{pu.mt[h]} nt{pu.nt[h]} share{pu.share_b}",
                )
            ii, iph = yield from self.publish_tile(a, ti, ii, iph)
            if ti.kind == 0:
                break
            assert pu is not None
            st, ph = yield from self.stream_tile(a, ti, crank if pu.share_b else -1, st, ph)
            n += 1
        # cluster_arrive (release): this thread's remote arrivals are performed first
        yield Blocked(lambda: not a.outbox, "cluster_arrive.release (drain remote arrivals)")
        self.cluster_bar.arrive()
        self.log("cluster_arrive (producer), exits")

    def producer_single(self, a: Agent) -> Proc[None]:
        """expert_ffn.cuh: ffn_producer."""
        cfg = self.cfg
        off, nseg, M = cfg.off, len(cfg.off) - 1, cfg.M
        nmb = num_minibatches(off[nseg], M)
        per_mt = cfg.nt1 + cfg.nt2
        cur_mb, cur_a, cur_b = 0, 0, mb_begin(off, nseg, M, 1)
        cur_cnt = count_mtiles(off, nseg, cur_a, cur_b)
        cur_base = 0
        st, ph, ii, iph = 0, 0, 0, 0
        tickets = iter(cfg.tickets)
        n = 0  # tiles whose dependency wait ran (abort_n counts them)
        while True:
            ti = Info(-1, 0)
            tk = next(tickets)
            self.log(f"atomicAdd ticket -> {tk}")
            yield None
            while cur_mb < nmb and tk >= cur_base + cur_cnt * per_mt:
                cur_base += cur_cnt * per_mt
                cur_mb += 1
                cur_a = cur_b
                cur_b = mb_begin(off, nseg, M, cur_mb + 1)
                cur_cnt = count_mtiles(off, nseg, cur_a, cur_b)
            if cur_mb < nmb:  # else every tile is handed out: publish exit
                mb, cnt = cur_mb, cur_cnt
                u = tk - cur_base
                t1 = cnt * cfg.nt1
                kind = 1 if u < t1 else 2
                if kind == 2:
                    u -= t1
                ntc = cfg.nt1 if kind == 1 else cfg.nt2
                if cfg.raster == 0:  # row-block major
                    mt, nt = u // ntc, u % ntc
                elif cfg.raster == 1:  # n-tile major
                    mt, nt = u % cnt, u // cnt
                else:  # bands of `raster` row blocks, n-tile major inside a band
                    gm_ = cfg.raster
                    b, idx = u // (gm_ * ntc), u % (gm_ * ntc)
                    gm = min(gm_, cnt - b * gm_)
                    mt, nt = b * gm_ + idx % gm, idx // gm
                found, _seg, _row0, rows = find_mtile(off, nseg, cur_a, cur_b, mt)
                if not found:  # cannot happen
                    self.violate("internal", f"find_mtile failed for row block {mt}")
                else:
                    ok = n != cfg.abort_n
                    self.log(f"dependency wait for ticket {tk}: {'ok' if ok else 'FAILED (abort)'}")
                    yield None
                    n += 1
                    if ok:
                        ti = Info(-1, kind, cfg.nk1 if kind == 1 else cfg.nk2, rows, f"mb{mb} k{kind} mt{mt} nt{nt}")
            ii, iph = yield from self.publish_tile(a, ti, ii, iph)
            if ti.kind == 0:
                return
            st, ph = yield from self.stream_tile(a, ti, -1, st, ph)

    def rest_of_wg0(self, a: Agent) -> Proc[None]:
        """compute_role: WG0's other threads arrive on the final cluster barrier at once (relaxed)."""
        if self.cfg.cluster:
            self.cluster_bar.arrive()
            self.log("cluster_arrive_relaxed (rest of WG0)")
        return
        yield  # (a generator)

    # ---------------------------------------------------------------- consumer pieces
    def release_stage(self, a: Agent, st: int, use: int) -> None:
        """expert_ffn.cuh: release_stage (thread lt == 0): the own CTA's empty barrier, the partner's remotely."""
        c, wgc = a.cta, a.wgc
        assert wgc is not None
        if self.released[c][wgc][st] != use:
            self.violate(
                "release_order", f"{a.name} releases stage {st} use {use}, released count {self.released[c][wgc][st]}"
            )
        self.released[c][wgc][st] += 1
        self.sm[c].empty[st].arrive((c, wgc, use))
        self.log(f"release stage {st} use {use}: arrive empty[{st}]")
        if self.cfg.cluster and self.cfg.mutant != "no_remote_release":
            self.remote_arrive(a, c ^ 1, self.sm[c ^ 1].empty[st], (c, wgc, use))

    def arrive_issued(self, a: Agent, st: int, use: int, warps: Iterable[int]) -> None:
        """Arrivals on issued[st] standing for the given warps of the first warpgroup (one mbarrier op)."""
        c = a.cta
        ws = list(warps)
        for w in ws:
            self.iss_arr[c][w][st] += 1
            if self.iss_arr[c][w][st] != use + 1:
                self.violate(
                    "issued_arrival_count",
                    f"{a.name} arrives on issued[{st}] for warp {w} use {use}, its count {self.iss_arr[c][w][st]}",
                )
        self.sm[c].issued[st].arrive(("w", tuple(ws), use), count=len(ws))
        self.log(f"arrive issued[{st}] x{len(ws)} (use {use})")

    def act_flush(self, a: Agent, held: bool, wg_bar: NamedBar, what: str) -> Proc[bool]:
        """DeferredActRelease::flush: the warpgroup's named barrier if a release is held."""
        if held:
            yield from self.nbsync(a, wg_bar, what=f"act_rel.flush {what}")
        return False

    def skip_kloop(self, a: Agent, nk: int, st: int, ph: int, uses: list[int], issued: bool) -> Proc[tuple[int, int]]:
        """expert_ffn.cuh: skip_kloop. Only thread 0 of the warpgroup (warp 0) waits on each stage, arrives
        four times on issued[st] (mbar_arrive_count) and releases it; the other warps just move st / ph on.
        Mutant skip_per_warp: skip_kloop before 91be0f3 (each warp waits and arrives once on issued for itself;
        warp 0 releases)."""
        s = self.sm[a.cta]
        assert a.warp is not None
        per_warp = self.cfg.mutant == "skip_per_warp"
        lead = a.warp == 0
        for _kb in range(nk):
            u = uses[st]
            if lead or per_warp:
                yield from self.wait(a, s.full[st], ph, u + 1, "full(skip)")
                if issued:
                    self.arrive_issued(a, st, u, [a.warp] if per_warp else range(4))
                    yield None
            if lead:
                self.release_stage(a, st, u)
                yield None
            uses[st] += 1
            a.progress += 1
            st, ph = advance(st, ph)
        return st, ph

    def kloop_bf16(
        self, a: Agent, nk: int, st: int, ph: int, uses: list[int], held: bool, wg_bar: NamedBar
    ) -> Proc[tuple[int, int, bool]]:
        """expert_ffn.cuh: ffn_consumer's bf16 K loop (one group kept in flight)."""
        s = self.sm[a.cta]
        prev, prev_use = 0, -1
        for kb in range(nk):
            u = uses[st]
            yield from self.wait(a, s.full[st], ph, u + 1, "full")
            self.wg_issue(a, st, u)
            yield None
            if kb == (1 if nk > 1 else 0):  # resolve_push, rel.flush, act_rel.flush
                held = yield from self.act_flush(a, held, wg_bar, "kloop")
            yield from self.wgmma_wait(a, 1)
            if kb > 0 and a.warp == 0:
                self.release_stage(a, prev, prev_use)
                yield None
            prev, prev_use = st, u
            uses[st] += 1
            a.progress += 1
            st, ph = advance(st, ph)
        yield from self.wgmma_wait(a, 0)
        if a.warp == 0:
            self.release_stage(a, prev, prev_use)
            yield None
        return st, ph, held

    def kloop_fp8(
        self, a: Agent, nk: int, st: int, ph: int, uses: list[int], held: bool, wg_bar: NamedBar
    ) -> Proc[tuple[int, int, bool]]:
        """fp8_kloop.cuh: ffn_kloop_fp8 (issued = fp8_issue_order ? sm.issued : nullptr, after_landing = order 2)."""
        cfg, s, wgc = self.cfg, self.sm[a.cta], a.wgc
        assert a.warp is not None
        issued = cfg.order != 0
        signal_issue = issued and wgc == 0 and cfg.order != 2
        signal_landing = issued and wgc == 0 and cfg.order == 2
        prev, prev_use = 0, -1
        for kb in range(nk):
            if kb > 0:
                yield from self.wgmma_wait(a, 0)
                if signal_landing:
                    self.arrive_issued(a, prev, prev_use, [a.warp])
                    yield None
                if a.warp == 0:
                    self.release_stage(a, prev, prev_use)
                    yield None
            u = uses[st]
            yield from self.wait(a, s.full[st], ph, u + 1, "full")
            if issued and wgc == 1:
                yield from self.wait(a, s.issued[st], ph, u + 1, "issued")
            self.wg_issue(a, st, u)
            yield None
            if signal_issue:
                self.arrive_issued(a, st, u, [a.warp])
                yield None
            if kb == 0:  # after_issue(0): rel.flush, act_rel.flush
                held = yield from self.act_flush(a, held, wg_bar, "after_issue(0)")
            prev, prev_use = st, u
            uses[st] += 1
            a.progress += 1
            st, ph = advance(st, ph)
        yield from self.wgmma_wait(a, 0)
        if signal_landing:
            self.arrive_issued(a, prev, prev_use, [a.warp])
            yield None
        if a.warp == 0:
            self.release_stage(a, prev, prev_use)
            yield None
        return st, ph, held

    def consumer(self, a: Agent) -> Proc[None]:
        """expert_ffn.cuh: ffn_consumer for one warp of warpgroup wgc, then compute_role's tail."""
        cfg, c, wgc = self.cfg, a.cta, a.wgc
        assert wgc is not None
        s = self.sm[c]
        st, ph, ii, iph = 0, 0, 0, 0
        uses = [0] * KSTAGES  # this warp's uses of each stage so far (what its waits expect)
        held = False  # DeferredActRelease holds an fc1_done release (uniform over the warpgroup)
        wg_bar = s.nb[2 + wgc]
        seq = 0
        while True:
            if held:  # act_rel.before_wait: named_bar_any(!test_wait(info_full)) -> flush
                anyp = yield from self.nbsync(a, wg_bar, pred=not s.info_full[ii].ready(iph), what="before_wait")
                if anyp:
                    held = yield from self.act_flush(a, held, wg_bar, "before_wait")
            yield from self.wait(a, s.info_full[ii], iph, seq // 2 + 1, "info_full")
            ti = s.info[ii]
            if ti is None or ti.seq != seq:
                self.violate("info_order", f"{a.name} expected info {seq}, slot {ii} holds {ti}")
                raise Stop()
            s.info_reads[ii] += 1
            self.log(f"read info[{ii}] = {ti}")
            seq += 1
            yield None
            yield from self.nbsync(a, wg_bar, what="info read")
            if a.warp == 0:
                s.info_empty[ii].arrive(("wg", wgc))
                self.log(f"arrive info_empty[{ii}]")
                yield None
            ii += 1
            if ii == 2:
                ii, iph = 0, iph ^ 1
            if ti.kind == 0:
                held = yield from self.act_flush(a, held, wg_bar, "exit")
                break
            if ti.kind == 3:  # a pass: the stages go round for the partner
                held = yield from self.act_flush(a, held, wg_bar, "pass")
                iss = cfg.fp8 and cfg.order != 0 and wgc == 0 and cfg.mutant != "no_pass_issued"
                st, ph = yield from self.skip_kloop(a, ti.nk, st, ph, uses, iss)
                continue
            if not cfg.fp8 and wgc == 1 and ti.rows <= 64:  # bf16: no rows in the second warpgroup's half
                held = yield from self.act_flush(a, held, wg_bar, "skip")
                st, ph = yield from self.skip_kloop(a, ti.nk, st, ph, uses, False)
            elif cfg.fp8:
                st, ph, held = yield from self.kloop_fp8(a, ti.nk, st, ph, uses, held, wg_bar)
            else:
                st, ph, held = yield from self.kloop_bf16(a, ti.nk, st, ph, uses, held, wg_bar)
            # epilogue
            if ti.kind == 1:
                held = yield from self.act_flush(a, held, wg_bar, "hold")  # act_rel.hold
                held = True
            else:
                yield from self.nbsync(a, wg_bar, what="fc2 rows stored")
            if cfg.consumer_sync:
                yield from self.nbsync(a, s.nb[1], what="consumer_sync")
        # compute_role's tail
        if cfg.cluster:
            yield Blocked(lambda: not a.outbox, "cluster_arrive.release (drain remote arrivals)")
            g = self.cluster_bar.arrive()
            self.log("cluster_arrive")
            yield Blocked(lambda: self.cluster_bar.gen > g, "cluster_wait", self.cluster_bar)
            pend = self.in_flight_to(c)
            if pend:
                self.violate("inflight_at_exit", f"CTA {c} passes the final cluster barrier with {pend} in flight")
            self.log("cluster_wait passed")
        yield from self.nbsync(a, s.nb[1], what="final")

    # ---------------------------------------------------------------- scheduling
    def in_flight_to(self, c: int) -> list[Any]:
        return [t for t in self.tma if t.dest == c] + [x for b in self.agents for x in b.outbox if x[0] == c]

    def actors(self) -> list[Actor]:
        acts: list[Actor] = []
        for a in self.agents:
            if not a.done and (a.blocked is None or a.blocked.ready()):
                acts.append(self.agent_actor[a.name])
            if a.outbox:
                for i in range(len(a.outbox)) if self.cfg.reorder_remote else [0]:
                    acts.append(Actor("remote", a.outbox[i][0], "remote", a, i))
        for t in self.tma:
            acts.append(Actor("tma", t.dest, "tma", None, t))
        for c in range(self.C):
            for wgc in range(2):
                k = self.landed[c][wgc]
                gl = self.groups[c][wgc]
                if k < len(gl) and gl[k].launched:
                    acts.append(self.land_actor[c][wgc])
        return acts

    def fire(self, x: Actor) -> None:
        if x.kind == "agent":
            assert x.agent is not None
            self.resume(x.agent)
        elif x.kind == "remote":
            assert x.agent is not None
            self.deliver(x.agent, x.arg)
        elif x.kind == "tma":
            self.tma_land(x.arg)
        else:
            self.group_land(x.cta, x.arg)

    def resume(self, a: Agent) -> None:
        assert a.proc is not None
        self.cur_agent = a
        try:
            a.blocked = a.proc.send(None)
        except StopIteration:
            a.done = True
            a.blocked = None
            self.log("done")
            self.on_agent_done(a)
        finally:
            self.cur_agent = None

    def on_agent_done(self, a: Agent) -> None:
        c = a.cta
        if all(b.done for b in self.agents if b.cta == c):
            # the CTA's threads have all left: no remote arrival or multicast may reach it from now on
            self.exited[c] = True
            pend = self.in_flight_to(c)
            if pend and self.cfg.cluster:
                self.violate("inflight_at_exit", f"CTA {c} exits with {pend} in flight")

    def final_checks(self) -> None:
        cfg = self.cfg
        if self.tma or any(a.outbox for a in self.agents):
            self.violate("final_inflight", "operations still in flight at the end")
        for c in range(self.C):
            s = self.sm[c]
            for st in range(KSTAGES):
                f, e, i = s.full[st], s.empty[st], s.issued[st]
                fills = self.fills[c][st]
                if f.phase != fills or f.pending != f.count or f.tx != 0:
                    self.violate("final_full", f"{f!r} after {fills} fills")
                if e.phase != fills or e.pending != e.count or e.tx != 0:
                    self.violate("final_empty", f"{e!r} after {fills} fills")
                want = fills if (cfg.fp8 and cfg.order) else 0
                if i.phase != want or i.pending != i.count:
                    self.violate("final_issued", f"{i!r}, expected phase {want}")
                if self.C == 2 and (
                    self.fills[0][st] != self.fills[1][st] or s.full[st].phase != self.sm[c ^ 1].full[st].phase
                ):
                    self.violate("final_asym", f"stage {st}: fills {self.fills[0][st]} vs {self.fills[1][st]}")
            for i2 in range(2):
                if s.info_full[i2].pending != 1 or s.info_empty[i2].pending != 2:
                    self.violate("final_info", f"{s.info_full[i2]!r} {s.info_empty[i2]!r}")
            for nb in s.nb.values():
                if nb.arrived:
                    self.violate("final_namedbar", f"{nb!r} has stray arrivals")
        if self.C == 2:
            if self.cluster_bar.gen != 1 or self.cluster_bar.arrived != 0:
                self.violate("final_cluster_barrier", f"{self.cluster_bar!r}")
            if self.sent != self.received:
                self.violate("mailbox_mismatch", f"sent {self.sent} received {self.received}")
            boxes = self.sm[1].box_full + self.sm[0].box_empty
            if any(x.pending != 1 for x in boxes):
                self.violate("final_box", f"{boxes}")
            if self.published[0] != self.published[1]:
                self.violate("final_published", f"{self.published}")


# ------------------------------------------------------------------------------------------------
# Schedulers: which enabled action runs next. None is fair; most starve some class of actions.
POLICIES = [
    "uniform",  # any enabled action
    "leader_first",  # CTA 0 first (clusters)
    "follower_first",  # CTA 1 first
    "wg1_lag",  # the second consumer warpgroup runs (almost) only when nothing else can
    "wg0_lag",  # the first likewise
    "warp_lag",  # warps 1..3 of each warpgroup likewise
    "warp3_lag",  # warp 3 of each warpgroup likewise
    "async_late",  # TMA landings, remote arrivals and group landings late
    "async_early",  # ... early
    "producer_first",
    "consumers_first",
    "pct",  # random priorities per actor, changed at a few random steps (PCT-like)
]
# also "starve:NAME,NAME": the named agents run only when nothing else can


class Policy:
    def __init__(self, name: str, rng: random.Random, lag_bound: int | None = None) -> None:
        if name not in POLICIES and not name.startswith("starve:"):
            raise ValueError(f"unknown policy {name!r}")
        self.name, self.rng, self.lag_bound = name, rng, lag_bound
        self.prio: dict[str, float] = {}
        self.changes: set[int] = set()
        if name == "pct":
            self.changes = {rng.randrange(1, 3000) for _ in range(rng.randrange(1, 6))}
        self.starved = set(name.split(":", 1)[1].split(",")) if name.startswith("starve:") else set()

    def _pref(self, acts: list[Actor], pred: Callable[[Actor], bool], p: float = 0.97) -> Actor:
        """One of the actions pred prefers with probability p (always, if only those are enabled)."""
        pri = [x for x in acts if pred(x)]
        if pri and (len(pri) == len(acts) or self.rng.random() < p):
            return self.rng.choice(pri)
        return self.rng.choice([x for x in acts if not pred(x)] or acts)

    def choose(self, world: World, acts: list[Actor]) -> Actor:
        if self.lag_bound is not None:  # fairness among the warps of one warpgroup (not a property of the code)
            ok = []
            for x in acts:
                a = x.agent if x.kind == "agent" else None
                if a is not None and a.wgc is not None:
                    lo = min((b.progress for b in world.wg_agents[(a.cta, a.wgc)] if not b.done), default=0)
                    if a.progress - lo > self.lag_bound:
                        continue
                ok.append(x)
            acts = ok or acts
        n, r = self.name, self.rng

        def warp(x: Actor) -> int | None:
            return x.agent.warp if x.kind == "agent" and x.agent is not None else None

        def wgc(x: Actor) -> int | None:
            return x.agent.wgc if x.kind == "agent" and x.agent is not None else None

        if self.starved:
            return self._pref(acts, lambda x: x.name not in self.starved, 1.0)
        if n == "uniform":
            return r.choice(acts)
        if n == "leader_first":
            return self._pref(acts, lambda x: x.cta == 0)
        if n == "follower_first":
            return self._pref(acts, lambda x: x.cta == 1)
        if n == "wg1_lag":
            return self._pref(acts, lambda x: wgc(x) != 1, 0.995)
        if n == "wg0_lag":
            return self._pref(acts, lambda x: wgc(x) != 0, 0.995)
        if n == "warp_lag":
            return self._pref(acts, lambda x: (warp(x) or 0) == 0, 0.999)
        if n == "warp3_lag":
            return self._pref(acts, lambda x: warp(x) != 3, 0.999)
        if n == "async_late":
            return self._pref(acts, lambda x: x.kind == "agent", 0.99)
        if n == "async_early":
            return self._pref(acts, lambda x: x.kind != "agent", 0.99)
        if n == "producer_first":
            return self._pref(acts, lambda x: x.kind == "agent" and x.agent is not None and x.agent.role == "prod")
        if n == "consumers_first":
            return self._pref(acts, lambda x: wgc(x) is not None)
        # pct
        if world.step in self.changes:
            self.prio = {}
        best, bp = acts[0], -1.0
        for x in acts:
            key = x.name if x.kind == "agent" else x.kind + str(x.cta)
            if key not in self.prio:
                self.prio[key] = r.random()
            if self.prio[key] > bp:
                best, bp = x, self.prio[key]
        return best


def run_one(
    cfg: Cfg, seed: int, policy: str, lag_bound: int | None = None, trace: bool = True, max_steps: int = 200000
) -> World:
    """One run of cfg under the scheduler `policy` (seeded): the World with its violations and trace."""
    world = World(cfg, trace)
    pol = Policy(policy, random.Random(seed * 7919 + 1), lag_bound)
    try:
        while True:
            acts = world.actors()
            if not acts:
                break
            x = pol.choose(world, acts)
            world.step += 1
            world.fire(x)
            if world.step > max_steps:
                world.violate("step_limit", "no termination")
                raise Stop()
        stuck = [a for a in world.agents if not a.done]
        if stuck:
            desc = "; ".join(
                f"{a.name}: {a.blocked.what if a.blocked else '?'} {a.blocked.on if a.blocked and a.blocked.on else ''}"
                for a in stuck
            )
            world.violations.append(("deadlock", desc, world.step))
            world.log("!!! DEADLOCK: " + desc)
        else:
            world.final_checks()
    except Stop:
        pass
    return world


# ------------------------------------------------------------------------------------------------
# Configurations.
def tile_count(cfg: Cfg) -> int:
    """Tickets of the whole problem: units (clusters) or tiles (single CTA)."""
    off, nseg, total = cfg.off, len(cfg.off) - 1, 0
    for mb in range(num_minibatches(off[nseg], cfg.M)):
        a, b = mb_begin(off, nseg, cfg.M, mb), mb_begin(off, nseg, cfg.M, mb + 1)
        if cfg.cluster:
            total += count_pair_units(off, nseg, a, b, cfg.nt1) + count_pair_units(off, nseg, a, b, cfg.nt2)
        else:
            total += count_mtiles(off, nseg, a, b) * (cfg.nt1 + cfg.nt2)
    return total


def gen_cfg(
    rng: random.Random, cluster: bool, fp8: bool | None = None, order: int | None = None, small: bool = False
) -> Cfg:
    """A random configuration (fp8 / order None: drawn too)."""
    cfg = Cfg(cluster=cluster)
    cfg.fp8 = rng.random() < 0.5 if fp8 is None else fp8
    cfg.order = (rng.choice([0, 1, 2]) if order is None else order) if cfg.fp8 else 0
    cfg.consumer_sync = rng.random() < 0.4
    cfg.nk1 = rng.randint(1, 5 if small else 9)
    cfg.nk2 = rng.randint(1, 5 if small else 9)
    cfg.nt1 = rng.randint(1, 3)
    cfg.nt2 = rng.randint(1, 3)
    off = [0]
    for _ in range(rng.randint(1, 2 if small else 3)):
        off.append(off[-1] + rng.choice([0, rng.randint(1, 64), rng.randint(65, 128), rng.randint(1, 400)]))
    if off[-1] == 0:
        off[-1] = rng.randint(1, 300)
    cfg.off = off
    cfg.M = rng.choice([128, 256, 384, 1000])
    total = tile_count(cfg)
    p = rng.choice([1.0, 1.0, 0.7, 0.4])
    tk = [t for t in range(total) if rng.random() < p]
    limit = 6 if small else 14
    if len(tk) > limit:  # keep runs short: other clusters took the rest
        keep = sorted(rng.sample(range(len(tk)), limit))
        tk = [tk[i] for i in keep]
    tk.append(total + rng.randint(0, 3))  # the first ticket past the end
    cfg.tickets = tk
    cfg.abort_n = rng.randrange(len(tk)) if rng.random() < 0.3 else -1
    cfg.raster = 0 if cluster else rng.choice([0, 1, 2, 3])
    return cfg


def pass_count(cfg: Cfg) -> int:
    """Pass tiles (CTA 1 without a tile) among a clustered cfg's tickets."""
    if not cfg.cluster:
        return 0
    off, nseg, M = cfg.off, len(cfg.off) - 1, cfg.M
    n = 0
    for tk in cfg.tickets:
        base = 0
        for mb in range(num_minibatches(off[nseg], M)):
            a, b = mb_begin(off, nseg, M, mb), mb_begin(off, nseg, M, mb + 1)
            u1, u2 = count_pair_units(off, nseg, a, b, cfg.nt1), count_pair_units(off, nseg, a, b, cfg.nt2)
            if tk < base + u1 + u2:
                u = tk - base
                pu = find_pair_unit(off, nseg, a, b, u if u < u1 else u - u1, cfg.nt1 if u < u1 else cfg.nt2)
                n += pu is not None and pu.nt[1] < 0
                break
            base += u1 + u2
    return n


# ------------------------------------------------------------------------------------------------
# Campaigns.
def run_seed(campaign_seed: int, r: int) -> int:
    """The seed of run r of a campaign (printed with a failing run; --replay takes it)."""
    return campaign_seed * 1000003 + r


@dataclass
class Campaign:
    """A campaign's results: failing runs (index, policy, cfg, violations) and statistics."""

    runs: int = 0
    steps: int = 0
    failing: list[tuple[int, str, Cfg, list[tuple[str, str, int]]]] = field(default_factory=list)
    stats: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def first_failure(self) -> int | None:
        """Index (0-based) of the first failing run."""
        return self.failing[0][0] if self.failing else None


def campaign(
    runs: int,
    seed: int,
    cluster: bool = True,
    fp8: bool | None = None,
    order: int | None = None,
    policies: list[str] | None = None,
    mutant: str = "",
    small: bool = False,
    lag_bound: int | None = None,
    reorder_remote: bool = False,
    stop_at_first: bool = False,
) -> Campaign:
    """`runs` runs; run r draws its cfg from run_seed(seed, r) and uses policies[r % len(policies)]."""
    pols = policies or POLICIES
    res = Campaign()
    for r in range(runs):
        s = run_seed(seed, r)
        cfg = gen_cfg(random.Random(s), cluster, fp8, order, small)
        cfg.reorder_remote = reorder_remote
        cfg.mutant = mutant
        pol = pols[r % len(pols)]
        w = run_one(cfg, s, pol, lag_bound, trace=False)
        res.runs += 1
        res.steps += w.step
        st = res.stats
        st[f"policy {pol}"] += 1
        st[f"fp8 order {cfg.order}" if cfg.fp8 else "bf16"] += 1
        st["abort"] += cfg.abort_n >= 0  # runs whose cfg aborts
        st["consumer_sync"] += cfg.consumer_sync  # runs with consumer_sync
        st["passes"] += pass_count(cfg)  # pass tiles among the tickets drawn
        st["mixed empty phases"] += w.mixed_phases
        if w.violations:
            res.failing.append((r, pol, cfg, w.violations))
            for k in sorted({v[0].split(":")[0] for v in w.violations}):
                st["VIOLATION " + k] += 1
            if stop_at_first:
                break
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1, help="campaign seed (run r uses seed * 1000003 + r)")
    ap.add_argument("--single", action="store_true", help="one CTA (ffn_producer, no passes) instead of a cluster")
    ap.add_argument("--dtype", choices=["bf16", "fp8", "mixed"], default="mixed")
    ap.add_argument("--order", type=int, choices=[0, 1, 2], default=None, help="MOK_FP8_ISSUE_ORDER (default: drawn)")
    ap.add_argument(
        "--policy", default=None, help="one of " + ", ".join(POLICIES) + " or starve:NAME,... (default: rotate)"
    )
    ap.add_argument("--mutant", default="", choices=["", *MUTANTS], help="a seeded bug (violations expected)")
    ap.add_argument("--lag-bound", type=int, default=None, help="warps of a warpgroup stay within this many K blocks")
    ap.add_argument("--small", action="store_true", help="smaller configurations")
    ap.add_argument("--reorder-remote", action="store_true", help="remote arrivals of one thread may overtake")
    ap.add_argument("--replay", type=int, default=None, help="run only this run seed (as printed), with its trace")
    ap.add_argument("--show", type=int, default=1, help="print the traces of the first N failing runs")
    ap.add_argument("--tail", type=int, default=60, help="trace lines shown per failing run (0: all)")
    ap.add_argument("--json", default=None, help="write the statistics here")
    args = ap.parse_args(argv)
    fp8 = None if args.dtype == "mixed" else args.dtype == "fp8"
    pols = [args.policy] if args.policy else POLICIES

    def show(s: int, pol: str, cfg: Cfg) -> bool:
        w = run_one(cfg, s, pol, args.lag_bound, trace=True)
        print(f"=== run seed {s} policy {pol}\ncfg {cfg.describe()}")
        for v in w.violations:
            print("   ", v)
        print("\n".join(w.trace[-args.tail :] if args.tail else w.trace))
        return bool(w.violations)

    if args.replay is not None:  # the same cfg and schedule as in the campaign that printed the seed
        cfg = gen_cfg(random.Random(args.replay), not args.single, fp8, args.order, args.small)
        cfg.reorder_remote = args.reorder_remote
        cfg.mutant = args.mutant
        r = args.replay - run_seed(args.seed, 0)
        return 1 if show(args.replay, pols[r % len(pols)] if r >= 0 else pols[0], cfg) else 0
    res = campaign(
        args.runs,
        args.seed,
        not args.single,
        fp8,
        args.order,
        pols,
        args.mutant,
        args.small,
        args.lag_bound,
        args.reorder_remote,
    )
    for r, pol, cfg, _v in res.failing[: args.show]:
        show(run_seed(args.seed, r), pol, cfg)
    stats = dict(res.stats, runs=res.runs, steps=res.steps, failing_runs=len(res.failing))
    print(json.dumps(stats, indent=1, sort_keys=True))
    if res.failing:
        r, pol, _cfg, v = res.failing[0]
        print(f"first failing run: {r} (--replay {run_seed(args.seed, r)} --policy {pol}): {v[0][0]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(stats, f, indent=1, sort_keys=True)
    return 1 if res.failing else 0


if __name__ == "__main__":
    sys.exit(main())
