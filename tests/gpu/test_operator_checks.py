"""GPU: the ``mok`` operators refuse bad arguments with one ValueError naming the operator, the argument, what was
expected and what came (csrc/mok/apis/*.cpp: TORCH_CHECK_VALUE), and the launcher's own refusals (config keys by
name) reach Python the same way -- nothing is launched."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

T, H, F, K, L = 300, 256, 128, 2, 4


def _forward_args(**over):
    """The raw mok::forward arguments of a small EP-1 launch (L 4, H 256, F 128, top-2), with overrides."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    args = dict(
        x=torch.randn((T, H), generator=g, device=dev).bfloat16(),
        topk_idx=torch.randint(0, L, (T, K), generator=g, device=dev, dtype=torch.int32),
        topk_weight=torch.rand((T, K), generator=g, device=dev),
        w1=[torch.randn((2 * F, H), device=dev).bfloat16() for _ in range(L)],
        w2=[torch.randn((H, F), device=dev).bfloat16() for _ in range(L)],
        w1_scale=[],
        w2_scale=[],
        combine=torch.empty((T, K, H), dtype=torch.bfloat16, device=dev),
        err=torch.zeros(16, dtype=torch.int32, device=dev),
        peer_bases=[],
        peer_offsets=[],
        saved_h=None,
        keep_x=None,
        keep_act=None,
        timeline=None,
        timeline_count=None,
        rank=0,
        epoch=0,
        comm_sms=2,
        ring_slots=2,
        minibatch=128,
        ctas=0,
        timeout_ms=5000.0,
        glu=0,
        glu_clamp=float("inf"),
        glu_offset=0.0,
        raster=-1,
        debug=0,
        stall_rank=-1,
        stall_slot=-1,
    )
    args.update(over)
    return args


def _forward(**over):
    return torch.ops.mok.forward(*_forward_args(**over).values())


def _refused(fn, *needles: str) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value).splitlines()[0]
    for n in needles:
        assert n in msg, msg
    return msg


def test_a_valid_launch_runs(kernel):
    out, tpe = _forward()
    torch.cuda.synchronize()
    assert out.shape == (T, H) and tpe.tolist() and int(tpe.sum()) == T * K


def test_tensor_arguments_are_named(kernel):
    dev = torch.device("cuda")
    bad_w1 = [torch.zeros((2 * F, H), device=dev).bfloat16() for _ in range(L)]
    bad_w1[2] = bad_w1[2].float()
    _refused(lambda: _forward(w1=bad_w1), "mok.forward", "w1[2]", "BFloat16", "Float")
    bad_w2 = list(_forward_args()["w2"])
    bad_w2[1] = bad_w2[1][:, : F // 2]
    _refused(lambda: _forward(w2=bad_w2), "mok.forward", "w2[1]", f"[{H}, {F}]", f"[{H}, {F // 2}]")
    x = torch.zeros((H, T), device=dev).bfloat16().t()
    _refused(lambda: _forward(x=x), "mok.forward", "x must be contiguous")
    _refused(lambda: _forward(topk_idx=torch.zeros((T, K), dtype=torch.int64, device=dev)), "topk_idx", "Int", "Long")
    _refused(lambda: _forward(topk_weight=torch.zeros((T, K + 1), device=dev)), "topk_weight", f"[{T}, {K}]")
    _refused(lambda: _forward(combine=torch.zeros((T, K, H), device="cpu").bfloat16()), "combine", "cpu")
    _refused(lambda: _forward(rank=1), "rank 1 out of [0, 1)")


def test_launcher_refusals_name_the_config_key(kernel):
    _refused(lambda: _forward(raster=65), "kernel.tile_raster must be an integer in [0, 64] (or unset), got 65")
    _refused(lambda: _forward(ring_slots=65), "ring_slots=65")
    _refused(lambda: _forward(glu=1, glu_clamp=0.0), "glu_clamp must be > 0")


def test_sm_split_is_checked(kernel):
    n = torch.cuda.get_device_properties(0).multi_processor_count
    _refused(lambda: _forward(comm_sms=n), f"comm_sms={n} leaves no compute SM: the launch runs on {n} SMs")
    _refused(lambda: _forward(comm_sms=8, ctas=8), "comm_sms=8 leaves no compute SM: the launch runs on 8 SMs")


def test_fp8_at_ep2_needs_the_source_copies(kernel):
    from megatron_mok.kernel import PeerBuffers
    from megatron_mok.kernel.quant import quantize_expert_weights

    bufs = PeerBuffers.on_one_gpu(2, T, H, K, fp8_sources=False)[0]
    a = _forward_args()
    q = quantize_expert_weights([a["w1"]], [a["w2"]])
    over = dict(
        x=bufs.x[:T], topk_idx=bufs.idx[:T], combine=bufs.combine[:T], peer_bases=bufs.ptrs,
        peer_offsets=bufs.forward_offsets(), epoch=1, w1=q.w1q[0], w2=q.w2q[0], w1_scale=q.w1s[0], w2_scale=q.w2s[0],
    )  # fmt: skip
    _refused(lambda: _forward(**over), "source", "fp8_sources=True")
    over["x"] = _forward_args()["x"]
    _refused(lambda: _forward(**over), "symmetric-region views")


def test_backward_and_wgrad_arguments_are_named(kernel):
    from megatron_mok.kernel import PeerBuffers, mok_backward

    a = _forward_args()
    go = torch.zeros_like(a["x"])
    kw = dict(comm_sms=2, ring_slots=2, minibatch_tokens=128)
    bufs = PeerBuffers.local()
    bad = [w.float() for w in a["w2"]]
    _refused(lambda: mok_backward(bufs, go, a["x"], a["topk_idx"], a["topk_weight"], a["combine"], a["w1"], bad, **kw),
             "mok.backward", "w2[0]", "Float")  # fmt: skip
    dev = go.device
    gw1 = [torch.zeros((2 * F, H), device=dev) for _ in range(L)]
    gw2 = [torch.zeros((H, F), device=dev).bfloat16() for _ in range(L)]
    rows = torch.zeros((8, H), device=dev).bfloat16()
    _refused(
        lambda: torch.ops.mok.wgrad(torch.zeros(L, dtype=torch.int32, device=dev), rows, rows,
                                    torch.zeros((8, 2 * F), device=dev).bfloat16(),
                                    torch.zeros((8, F), device=dev).bfloat16(), gw1, gw2,
                                    torch.zeros(16, dtype=torch.int32, device=dev), False, 0, 1000.0,
                                    None, None, None, None, None, None),
        "mok.wgrad", "grad_w2[0]", "Float", "BFloat16",
    )  # fmt: skip
