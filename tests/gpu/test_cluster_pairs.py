"""GPU tests of the forward's 2-CTA clusters (MOK_CLUSTER=2; csrc/mok/pair_tiles.cuh, cluster_pair.cuh).

The two compute CTAs of a cluster run the two tiles of one ticket and, where both use the same weight tile,
each loads half of it into both CTAs' shared memory (TMA multicast). Every tile is the same computation on
the same bytes, in the same K order: outputs, combine rows, tokens per expert, the saved fc1 output, kept
rows and the backward on top of them must equal the unclustered launch's bit for bit. The pairs' coupling
(a shared stage ring, the ticket mailbox, the cluster barriers) must also survive an abort: a stalled
dispatch is reported by rank and slot, and the next call works.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from mok_truth import KEPT_AND_BACKWARD, ground_truth, kept_rows_and_backward, make_backward_case, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu


def _launch(kernel, monkeypatch, cluster, *args, env=(), **kw):
    monkeypatch.setenv("MOK_CLUSTER", str(cluster))
    for k, v in env:
        monkeypatch.setenv(k, v)
    try:
        got = kernel.mok_forward_emulated(*args, **kw)
        torch.cuda.synchronize()
        return got
    finally:
        monkeypatch.delenv("MOK_CLUSTER")
        for k, _ in env:
            monkeypatch.delenv(k)


def _fp8(w1, w2):
    from megatron_mok.kernel.fp8_weights import quantize_expert_weights

    return quantize_expert_weights(w1, w2)


def _same(kernel, monkeypatch, case, kw, env=(), saved_h=True):
    """The clustered launch's outputs (and saved h) equal the unclustered one's bit for bit."""
    x, idx, wts, w1, w2 = case
    R, F = len(x), w2[0][0].shape[1]  # w2: per rank, per expert
    rows = sum(int(t.shape[0]) for t in x) * idx[0].shape[1]
    res = []
    for cluster in (1, 2):
        h = [torch.full((rows, 2 * F), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(R)]
        out, comb, tpe = _launch(
            kernel, monkeypatch, cluster, x, idx, wts, w1, w2, env=env, saved_h=h if saved_h else None, **kw
        )
        res.append((out, comb, tpe, [t.nan_to_num(7.0) for t in h]))
    for name, a, b in zip(("out", "combine", "tokens_per_expert", "saved h"), res[1], res[0]):
        if name == "saved h" and not saved_h:
            continue
        for q in range(R):
            assert torch.equal(a[q], b[q]), f"rank {q}: {name} differs with MOK_CLUSTER=2"
    return res[1]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("comm", [0, 2, 4], ids=lambda c: "insm" if c == 0 else f"comm{c}")
@pytest.mark.parametrize("mode", ["uniform", "skewed", "minus1", "one"])
def test_cluster_pairs_give_the_same_bits(kernel, monkeypatch, dtype, R, comm, mode):
    """H 512 / F 256: two n-tiles per stage (all units pair row blocks or n-tiles); R = 4 gives 33 SMs per
    rank, rounded down to 32 (whole clusters); "one": a single expert, long runs of shared units."""
    L, H, F, K = 4, 512, 256, 4
    Ts = [700 + 97 * r for r in range(R)]
    x, idx, wts, w1, w2, _ = make_backward_case(R, L, H, F, K, Ts, mode, seed=60 + R)
    kw = dict(comm_sms=comm, ring_slots=3, minibatch_tokens=256)
    if dtype == "fp8":
        kw["fp8"] = _fp8(w1, w2)
    _same(kernel, monkeypatch, (x, idx, wts, w1, w2), kw, saved_h=dtype == "bf16")


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("H", [256, 128, 64])
@pytest.mark.parametrize("order", ["0", "1", "2"])
def test_cluster_pairs_odd_n_tiles_pass(kernel, monkeypatch, dtype, H, order):
    """F 128: one n-tile per stage, so an odd segment's last row block is a unit with a pass (the second CTA's
    stages go round without data; with the FP8 issue order its first warpgroup still moves the `issued`
    barriers on, or the next tile deadlocks); the results must still be right and the same bits. H 128 / 64:
    the second 128-row half of W2's tile lies wholly past H (TMA fills it with zeros and counts its bytes)."""
    if dtype == "fp8" and H % 128:
        pytest.skip("fp8 needs H % 128 == 0")
    if dtype == "bf16" and order != "0":
        pytest.skip("the issue order is an FP8 knob")
    if dtype == "fp8" and order != "0" and not kernel.fp8_issue_order_built():
        pytest.skip("issue orders 1 / 2 need a build with MOK_FP8_ORDERED=1")
    L, F, K = 5, 128, 2
    x, idx, wts, w1, w2, _ = make_backward_case(2, L, H, F, K, [900, 333], "skewed", seed=7)
    kw = dict(comm_sms=2, ring_slots=2, minibatch_tokens=128)
    if dtype == "fp8":
        kw["fp8"] = _fp8(w1, w2)
        monkeypatch.setenv("MOK_FP8_ISSUE_ORDER", order)
    out, comb, _, _ = _same(kernel, monkeypatch, (x, idx, wts, w1, w2), kw, saved_h=dtype == "bf16")
    if dtype == "bf16":
        r_out, r_comb, _ = ground_truth(x, idx, wts, w1, w2)
        for q in range(2):
            assert rel_err(out[q], r_out[q]) < 1e-2 and rel_err(comb[q], r_comb[q]) < 1e-2


def test_cluster_pairs_with_knobs(kernel, monkeypatch):
    """FP8 issue orders 0 / 1 / 2 (the `issued` barriers beside the shared stages), lock-step consumers and a
    consumer lead, token chunks (EP 1), a single-slot ring with an odd minibatch."""
    L, H, F, K = 3, 512, 384, 4
    x, idx, wts, w1, w2, _ = make_backward_case(1, L, H, F, K, [1500], "uniform", seed=9)
    case = (x, idx, wts, w1, w2)
    f8 = dict(comm_sms=2, ring_slots=2, minibatch_tokens=192, fp8=_fp8(w1, w2))
    for order in ("0", "1", "2") if kernel.fp8_issue_order_built() else ("0",):
        _same(kernel, monkeypatch, case, f8, env=[("MOK_FP8_ISSUE_ORDER", order)], saved_h=False)
    bf = dict(comm_sms=2, ring_slots=2, minibatch_tokens=192)
    _same(kernel, monkeypatch, case, bf, env=[("MOK_CONSUMER_SYNC", "1")])
    _same(kernel, monkeypatch, case, bf, env=[("MOK_CONSUMER_LEAD_NS", "2000")])
    _same(kernel, monkeypatch, case, bf, env=[("MOK_MACROBATCHES", "4")])
    _same(kernel, monkeypatch, case, dict(comm_sms=2, ring_slots=1, minibatch_tokens=77))


def test_cluster_pairs_kept_rows_and_backward(kernel, monkeypatch):
    res = kept_rows_and_backward(kernel, monkeypatch, "MOK_CLUSTER", (1, 2), comm_sms=2)
    for name, a, b in zip(KEPT_AND_BACKWARD, res[2], res[1]):
        assert torch.equal(a, b), f"{name} differs with MOK_CLUSTER=2"


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("comm", [0, 8], ids=lambda c: "insm" if c == 0 else f"comm{c}")
def test_cluster_pairs_kimi_k2_slice(kernel, monkeypatch, dtype, comm):
    """The benchmark's shape (H 7168, F 2048, 8 experts, top-8, 4096 tokens): long K loops of shared units
    (16 fc1 and 28 fc2 n-tiles), with the in-SM pull (the benchmark's split) and with 8 comm SMs."""
    R, L, H, F, K, T = 1, 8, 7168, 2048, 8, 4096
    x, idx, wts, w1, w2, _ = make_backward_case(R, L, H, F, K, [T], "uniform", seed=11)
    kw = dict(comm_sms=comm, ring_slots=4, minibatch_tokens=4096)
    if dtype == "fp8":
        kw["fp8"] = _fp8(w1, w2)
    _same(kernel, monkeypatch, (x, idx, wts, w1, w2), kw, saved_h=False)


def test_cluster_pairs_timeline(kernel, monkeypatch):
    """Each CTA records its own tiles (passes record none): the fc1 / fc2 events number the tiles."""
    from megatron_mok.kernel.timeline import Timeline

    L, H, F, K = 4, 512, 256, 4
    x, idx, wts, w1, w2, _ = make_backward_case(1, L, H, F, K, [1000], "skewed", seed=3)
    counts = {}
    for cluster in (1, 2):
        tl = Timeline()
        _launch(
            kernel,
            monkeypatch,
            cluster,
            x,
            idx,
            wts,
            w1,
            w2,
            comm_sms=2,
            ring_slots=2,
            minibatch_tokens=256,
            timeline=tl,
        )
        ev = tl.events()
        counts[cluster] = {k: sum(e.kind == k for e in ev) for k in ("fc1", "fc2")}
        assert tl.dropped() == 0
    assert counts[2] == counts[1] and counts[1]["fc1"] > 0, counts


def test_cluster_pairs_stall_times_out_and_recovers(kernel, monkeypatch):
    """An abort while the pairs run: the leader sends "exit" to its follower, both pipelines end at the same
    unit, no CTA waits for a partner that left (that would trap and lose the context)."""
    *args, _ = make_backward_case(2, 4, 256, 128, 2, [600, 600], "uniform", seed=3)
    for comm, slot in ((2, 1), (2, 0), (4, 1)):
        with pytest.raises(kernel.MokKernelError, match=rf"timed out: rank 1 slot {slot}"):
            _launch(
                kernel,
                monkeypatch,
                2,
                *args,
                comm_sms=comm,
                ring_slots=2,
                minibatch_tokens=128,
                timeout_ms=300.0,
                debug_stall=(1, slot),
            )
    _same(kernel, monkeypatch, args, dict(comm_sms=2, ring_slots=2, minibatch_tokens=128))


def test_cluster_knob_refusals(kernel, monkeypatch):
    x, idx, wts, w1, w2, _ = make_backward_case(1, 2, 256, 256, 2, [300], "uniform", seed=1)
    kw = dict(ring_slots=2, minibatch_tokens=128)
    errors = (ValueError, kernel.MokKernelError)
    for bad in ("0", "3", "two"):
        with pytest.raises(errors, match="MOK_CLUSTER must be 1 or 2"):
            _launch(kernel, monkeypatch, bad, x, idx, wts, w1, w2, comm_sms=2, **kw)
    with pytest.raises(errors, match="comm_sms=3 must be even"):
        _launch(kernel, monkeypatch, 2, x, idx, wts, w1, w2, comm_sms=3, **kw)
    with pytest.raises(errors, match="ctas_per_rank=65 must be even"):
        _launch(kernel, monkeypatch, 2, x, idx, wts, w1, w2, comm_sms=2, ctas_per_rank=65, **kw)
    with pytest.raises(errors, match="MOK_RASTER must be 0"):
        _launch(kernel, monkeypatch, 2, x, idx, wts, w1, w2, comm_sms=2, env=[("MOK_RASTER", "4")], **kw)
    # and the same launch goes through once the knobs agree
    _same(kernel, monkeypatch, (x, idx, wts, w1, w2), dict(comm_sms=2, ctas_per_rank=64, **kw))
