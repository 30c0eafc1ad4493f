"""CPU model check of the forward kernel's compute pipeline (scripts/pipeline_model.py).

The model ports the stage ring, tile-info ring, FP8 issue-order barriers, 2-CTA ticket mailbox, remote
releases, multicast and pass tiles of csrc/mok (expert_ffn.cuh, fp8_kloop.cuh, cluster_pair.cuh,
pair_tiles.cuh) and runs them under adversarial schedulers. Here:
  * campaigns of the current protocol (clusters and single CTAs, bf16 and FP8 issue orders 0 / 1 / 2,
    aborts, every scheduler policy) must report no violation;
  * every seeded bug (MUTANTS) must be caught, for its own reason, by a small campaign;
  * two hand-made schedules of the skip_kloop hazard (a starved warp) pass with the current skip_kloop and
    trip the per-warp one.
Fixed seeds: deterministic. A failure prints the cfg and schedule to replay with pipeline_model.run_one.
"""

from __future__ import annotations

from typing import Any

import pytest
from load_script import load_script

pm = load_script("pipeline_model")
NPOL = len(pm.POLICIES)


def _failures(res: Any, seed: int) -> str:
    out = [f"{len(res.failing)} of {res.runs} runs failed"]
    for r, pol, cfg, viol in res.failing[:3]:
        out.append(f"run {r}: run_one(Cfg(**{cfg.describe()}), {pm.run_seed(seed, r)}, {pol!r})")
        out += [f"    {k}: {msg[:400]}" for k, msg, _step in viol[:3]]
    return "\n".join(out)


# (a) the current protocol: (campaign arguments, runs -- a multiple of the policy count --, seed)
CLEAN = [
    pytest.param(dict(cluster=True), 60 * NPOL, 11, id="cluster-mixed"),
    pytest.param(dict(cluster=True, fp8=False), 20 * NPOL, 12, id="cluster-bf16"),
    pytest.param(dict(cluster=True, fp8=True, order=1), 20 * NPOL, 13, id="cluster-fp8-order1"),
    pytest.param(dict(cluster=True, fp8=True, order=2), 20 * NPOL, 14, id="cluster-fp8-order2"),
    pytest.param(dict(cluster=True, small=True, reorder_remote=True), 10 * NPOL, 15, id="cluster-small-reordered"),
    pytest.param(dict(cluster=True, lag_bound=1), 10 * NPOL, 16, id="cluster-lag-bound"),
    pytest.param(dict(cluster=False), 40 * NPOL, 21, id="single-mixed"),
    pytest.param(dict(cluster=False, fp8=False), 20 * NPOL, 22, id="single-bf16"),
]


@pytest.mark.parametrize("kw,runs,seed", CLEAN)
def test_current_protocol_is_clean(kw: dict[str, Any], runs: int, seed: int) -> None:
    res = pm.campaign(runs, seed, **kw)
    assert not res.failing, _failures(res, seed)
    st = res.stats
    assert res.runs == runs
    assert all(st[f"policy {p}"] == runs // NPOL for p in pm.POLICIES)
    assert st["abort"] >= runs // 5, st  # ~30 % of the runs abort
    assert st["consumer_sync"] > 0
    if kw.get("cluster"):
        assert st["passes"] > 0, st
    dtypes = {k for k in st if k == "bf16" or k.startswith("fp8 order")}
    if "fp8" not in kw:
        assert dtypes == {"bf16", "fp8 order 0", "fp8 order 1", "fp8 order 2"}, st
    elif kw["fp8"]:
        assert dtypes == {f"fp8 order {kw['order']}"}, st
    else:
        assert dtypes == {"bf16"}, st


# (b) seeded bugs: (mutant, campaign arguments, seed, at most this many runs, signature) -- the first failing
# run must report a violation of one of the signature's kinds whose message contains the given text
SKIP_SIG = [
    ("lapped_pass:full(skip)", ""),
    ("stale_pass:issued", ""),
    ("issue_order", ""),
    ("deadlock", "(full(skip))"),
]
ISSUED_SIG = [
    ("stale_pass:issued", ""),
    ("issue_order", ""),
    ("issued_arrival_count", ""),
    ("final_issued", ""),
    ("deadlock", "(issued)"),
]
MUTANT_CASES = [
    pytest.param("skip_per_warp", dict(cluster=True), 1, 60, SKIP_SIG, id="skip_per_warp-cluster"),
    pytest.param("skip_per_warp", dict(cluster=False, fp8=False), 1, 60, SKIP_SIG, id="skip_per_warp-single-bf16"),
    pytest.param("skip_per_warp", dict(cluster=True, fp8=True, order=1), 1, 60, SKIP_SIG, id="skip_per_warp-fp8-o1"),
    pytest.param("no_pass_issued", dict(cluster=True, fp8=True, order=1), 1, 60, ISSUED_SIG, id="no_pass_issued-o1"),
    pytest.param("no_pass_issued", dict(cluster=True, fp8=True, order=2), 1, 60, ISSUED_SIG, id="no_pass_issued-o2"),
    pytest.param("no_remote_release", dict(cluster=True), 1, 60, [("deadlock", "(empty)")], id="no_remote_release"),
    pytest.param("no_multicast_peer", dict(cluster=True), 1, 60, [("deadlock", "tx 16]")], id="no_multicast_peer"),
    pytest.param(
        "empty2",
        dict(cluster=True),
        1,
        60,
        [("empty_invariant", ""), ("tma_overwrite", ""), ("over_arrival", ""), ("deadlock", "(empty)")],
        id="empty2",
    ),
    pytest.param(
        "box_nowait",
        dict(cluster=True),
        1,
        120,
        [("mailbox_overwrite", ""), ("mailbox_order", ""), ("mailbox_mismatch", "")],
        id="box_nowait",
    ),
]


def test_every_mutant_has_a_case() -> None:
    assert {p.values[0] for p in MUTANT_CASES} == set(pm.MUTANTS)


@pytest.mark.parametrize("mutant,kw,seed,max_runs,signature", MUTANT_CASES)
def test_mutant_is_caught(
    mutant: str, kw: dict[str, Any], seed: int, max_runs: int, signature: list[tuple[str, str]]
) -> None:
    res = pm.campaign(max_runs, seed, mutant=mutant, stop_at_first=True, **kw)
    assert res.failing, f"{mutant}: no violation in {max_runs} runs"
    _r, _pol, _cfg, viol = res.failing[0]
    assert any(k == kind and text in msg for k, msg, _step in viol for kind, text in signature), _failures(res, seed)


# (c) hand-made schedules of the skip_kloop hazard: one warp starved while its warpgroup skips stages
S1 = dict(cluster=False, fp8=False, nk1=1, nk2=4, nt1=1, nt2=1, off=[0, 40], M=1024, tickets=[0, 1, 2])
S2 = dict(cluster=True, fp8=True, order=1, nk1=4, nk2=2, nt1=3, nt2=2, off=[0, 40], M=1024, tickets=[0, 1, 2, 3])
SCENARIOS = [
    # single CTA bf16: an fc1 tile of 40 rows (the second warpgroup skips its one stage), then an fc2 tile
    pytest.param(S1, "starve:C0.wg1.w1", id="single-bf16-skip-branch"),
    # cluster FP8 order 1: CTA 1 runs an fc1 tile, a pass, an fc2 tile; a first-warpgroup warp is starved
    pytest.param(S2, "starve:C1.wg0.w3", id="cluster-fp8-pass"),
]


@pytest.mark.parametrize("cfg,policy", SCENARIOS)
def test_skip_kloop_scenarios(cfg: dict[str, Any], policy: str) -> None:
    w = pm.run_one(pm.Cfg(**cfg), 1, policy)
    assert not w.violations, "\n".join(w.trace[-40:])
    w = pm.run_one(pm.Cfg(mutant="skip_per_warp", **cfg), 1, policy)
    assert w.violations, "the per-warp skip_kloop passed the schedule that laps a starved warp"
