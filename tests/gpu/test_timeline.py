"""GPU: the forward kernel's in-kernel timeline records what every SM did, and costs nothing when off."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from emulated import mok_backward_emulated, mok_forward_emulated  # noqa: E402
from mok_truth import make_experts, make_routing  # noqa: E402

pytestmark = pytest.mark.gpu


def test_timeline_records_every_stage_per_sm():
    import megatron_mok.kernel as k
    from megatron_mok.kernel.timeline import Timeline, summarize

    if not torch.cuda.is_available() or not k.is_available():
        pytest.skip("MoK kernel unavailable")
    R, L, H, F, K, T = 1, 4, 512, 256, 4, 1000
    comm, slots, mb = 2, 2, 256
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(3)
    x = [torch.randn((T, H), generator=gen, device=dev).bfloat16() for _ in range(R)]
    idx, w = zip(*[make_routing(T, K, R * L, "uniform", dev, gen) for _ in range(R)])
    w1, w2 = make_experts(R, L, H, F, dev, gen)
    kw = dict(comm_sms=comm, ring_slots=slots, minibatch_tokens=mb)
    out0, _, _ = mok_forward_emulated(x, list(idx), list(w), w1, w2, **kw)
    tl = Timeline(cap=1024)
    out1, _, tpe = mok_forward_emulated(x, list(idx), list(w), w1, w2, **kw, timeline=tl)
    ev = tl.events()
    assert tl.dropped() == 0
    for a, b in zip(out0, out1):
        assert torch.equal(a, b)  # recording does not change results
    cpr = torch.cuda.get_device_properties(0).multi_processor_count // R
    kinds_by_role = {"comm": set(), "compute": set()}
    for e in ev:
        assert e.end_us >= e.start_us >= 0.0
        kinds_by_role["comm" if e.cta % cpr < comm else "compute"].add(e.kind)
    assert kinds_by_role["comm"] == {"schedule", "dispatch", "combine"}
    assert kinds_by_role["compute"] == {"schedule", "fc1", "fc2", "combine"}
    assert {e.cta for e in ev if e.kind == "schedule"} == set(range(R * cpr))
    # every minibatch of every rank was dispatched by each comm CTA, once
    nmb = [-(-int(t.sum()) // mb) for t in tpe]
    assert sum(1 for e in ev if e.kind == "dispatch") == comm * sum(nmb)
    # fc2 tiles: per row block, ceil(H / 256) tiles; fc1: ceil(F / 128)
    s = summarize(ev)
    assert s["span_us"] > 0 and s["busy_sm_us"]["fc1"] > 0 and s["busy_sm_us"]["fc2"] > 0
    # GEMM tiles carry the end of their MMAs (the rest is the epilogue); other events carry none
    for e in ev:
        if e.kind in ("fc1", "fc2"):
            assert e.mma_end_us is not None and e.start_us < e.mma_end_us <= e.end_us, e
        else:
            assert e.mma_end_us is None, e
    for kind in ("fc1", "fc2"):
        t = s["tile_us"][kind]
        assert t["tiles"] == sum(1 for e in ev if e.kind == kind) and 0 < t["epilogue_us"] < t["mean_us"]
    # dispatch of the first minibatch starts before the last fc2 tile ends (the pipeline overlaps)
    first_disp_end = min(e.end_us for e in ev if e.kind == "dispatch")
    assert first_disp_end < max(e.end_us for e in ev if e.kind == "fc2")


@pytest.mark.parametrize("wgrad", ["none", "kernel"])
@pytest.mark.parametrize("saved", [False, True], ids=["recompute", "saved_h"])
def test_backward_timeline_records_every_stage_per_sm(saved, wgrad):
    """Every stage of the backward kernel on the SMs of its role. With the wgrad kernel after it (the
    default) the grad_x sum is that kernel's (home_reduce.cuh): no grad_x interval here then."""
    import megatron_mok.kernel as k
    from megatron_mok.kernel.timeline import Timeline

    if not torch.cuda.is_available() or not k.is_available():
        pytest.skip("MoK kernel unavailable")
    R, L, H, F, K, T = 1, 4, 512, 256, 4, 1000
    comm, slots, mb = 2, 2, 256
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(5)
    x = [torch.randn((T, H), generator=gen, device=dev).bfloat16() for _ in range(R)]
    go = [torch.randn((T, H), generator=gen, device=dev).bfloat16() for _ in range(R)]
    idx, w = zip(*[make_routing(T, K, R * L, "uniform", dev, gen) for _ in range(R)])
    idx, w = list(idx), list(w)
    w1, w2 = make_experts(R, L, H, F, dev, gen)
    kw = dict(comm_sms=comm, ring_slots=slots, minibatch_tokens=mb)
    hbuf = [torch.empty((R * T * K, 2 * F), dtype=torch.bfloat16, device=dev) for _ in range(R)] if saved else None
    _, comb, tpe = mok_forward_emulated(x, idx, w, w1, w2, **kw, saved_h=hbuf)
    ref = mok_backward_emulated(go, x, idx, w, comb, w1, w2, **kw, saved_h=hbuf, wgrad=wgrad)
    tl = Timeline(cap=2048)
    got = mok_backward_emulated(go, x, idx, w, comb, w1, w2, **kw, saved_h=hbuf, wgrad=wgrad, timeline=tl)
    for a, b in zip(ref, got):  # recording does not change results (bitwise)
        if a is None:  # wgrad "none": no weight gradients
            continue
        for u, v in zip(a, b):
            assert torch.equal(u, v) if isinstance(u, torch.Tensor) else all(torch.equal(s, t) for s, t in zip(u, v))
    ev = tl.events()
    assert tl.dropped() == 0
    cpr = torch.cuda.get_device_properties(0).multi_processor_count // R
    roles = {"comm": set(), "compute": set()}
    for e in ev:
        assert e.end_us >= e.start_us >= 0.0
        roles["comm" if e.cta % cpr < comm else "compute"].add(e.kind)
    gx = {"grad_x"} if wgrad == "none" else set()
    assert roles["comm"] == {"schedule", "pull", "background"} | gx
    assert roles["compute"] == {"schedule", "dgrad1", "dgrad1_epilogue", "dgrad2", "push"} | gx
    # every minibatch pulled once per comm CTA; one stage-1 epilogue per stage-1 tile, one push per stage-2 tile
    nmb = [-(-int(t.sum()) // mb) for t in tpe]
    assert sum(1 for e in ev if e.kind == "pull") == comm * sum(nmb)
    n1 = sum(1 for e in ev if e.kind == "dgrad1")
    assert n1 > 0 and n1 == sum(1 for e in ev if e.kind == "dgrad1_epilogue")
    n2 = sum(1 for e in ev if e.kind == "dgrad2")
    assert n2 > 0 and n2 == sum(1 for e in ev if e.kind == "push")
    # per row tile: ceil(F / 128) stage-1 tiles (ceil(F / 256) with saved h) and ceil(H / 256) stage-2 tiles
    assert n1 * ((H + 255) // 256) == n2 * ((F + (255 if saved else 127)) // (256 if saved else 128))
    # grad_x starts only after every stage-2 tile's main loop ended (it needs every rank's pushes; the push
    # interval's own end is read after its counter release, so it may trail a grad_x start)
    if gx:
        assert min(e.start_us for e in ev if e.kind == "grad_x") >= max(e.end_us for e in ev if e.kind == "dgrad2")
