"""GPU: the kernel against the PyTorch reference (emulated EP) and inside a Megatron MoE layer."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from emulated import mok_forward_emulated  # noqa: E402

pytestmark = pytest.mark.gpu

TOL = dict(rtol=2e-2, atol=2e-2)  # bf16 operands, fp32 accumulation


def _kernel_or_skip():
    from megatron_mok import kernel

    if not kernel.is_available():
        pytest.skip(f"MoK kernel unavailable: {kernel.unavailable_reason()}")
    return kernel


@pytest.mark.parametrize("R", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["random", "skewed", "empty_experts", "all_to_one"])
def test_kernel_equals_reference_emulated_ep(R, kind):
    _kernel_or_skip()
    from routings import make_topk

    from megatron_mok.function import mok_moe
    from megatron_mok.plan import MokPlan, RingSpec
    from megatron_mok.transport import run_emulated

    g = torch.Generator().manual_seed(R * 31 + len(kind))
    L, H, F, K = 4, 512, 256, 4
    E = R * L
    tokens = [300 + 37 * r for r in range(R)]
    if R > 1:
        tokens[1] = 0  # a rank with no tokens still serves and receives
    dev = torch.device("cuda")
    xs = [torch.randn(t, H, generator=g).to(dev, torch.bfloat16) for t in tokens]
    idx = [make_topk(kind, t, E, K, g).to(dev) for t in tokens]
    ws = [torch.rand(t, K, generator=g).to(dev) for t in tokens]
    w1 = [(torch.randn(2 * F, H, generator=g) / H**0.5).to(dev, torch.bfloat16) for _ in range(E)]
    w2 = [(torch.randn(H, F, generator=g) / F**0.5).to(dev, torch.bfloat16) for _ in range(E)]
    ring = RingSpec(minibatch_tokens=128, ring_slots=2)  # smaller than every rank's batch
    out, comb, tpe = mok_forward_emulated(
        xs,
        [i.int() for i in idx],
        ws,
        [w1[q * L : (q + 1) * L] for q in range(R)],
        [w2[q * L : (q + 1) * L] for q in range(R)],
        comm_sms=2,
        ring_slots=ring.ring_slots,
        minibatch_tokens=ring.minibatch_tokens,
    )
    plans = {}

    def ref(tp):
        r = tp.rank
        plan = MokPlan(tp, E, ring)
        plans[r] = plan
        return mok_moe(xs[r], idx[r], ws[r], w1[r * L : (r + 1) * L], w2[r * L : (r + 1) * L], plan)

    want = run_emulated(R, ref)
    for r in range(R):
        assert tpe[r].tolist() == plans[r].layout.tokens_per_expert.tolist(), f"rank {r}: layouts differ"
        torch.testing.assert_close(out[r].float(), want[r].float(), **TOL, msg=lambda m, r=r: f"rank {r}: {m}")


def _skewed_layer_problem(seed):
    """One rank's layer inputs (L 4, H 512, F 256, top-4, 700 tokens, skewed routing) on the GPU:
    (L, x, topk_idx, topk_weight, w1 list, w2 list, output gradient)."""
    from routings import make_topk

    g = torch.Generator().manual_seed(seed)
    L, H, F, K, T = 4, 512, 256, 4, 700
    dev = torch.device("cuda")
    x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    idx = make_topk("skewed", T, L, K, g).to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    w1 = [(torch.randn(2 * F, H, generator=g) / H**0.5).to(dev, torch.bfloat16) for _ in range(L)]
    w2 = [(torch.randn(H, F, generator=g) / F**0.5).to(dev, torch.bfloat16) for _ in range(L)]
    go = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    return L, x, idx, w, w1, w2, go


@pytest.mark.parametrize("save_fc1_output", [True, False])
def test_kernel_backend_adds_wgrad_into_main_grad(save_fc1_output, monkeypatch):
    """Gradient-accumulation fusion on the kernel backend: the wgrad kernel adds the expert weight
    gradients straight into fp32 main_grad (on top of what is there); autograd gets Megatron's dummy."""
    _kernel_or_skip()

    from megatron_mok.backend import kernel_backend
    from megatron_mok.function import mok_moe
    from megatron_mok.plan import MokPlan, RingSpec
    from megatron_mok.transport import run_emulated

    L, x, idx, w, w1, w2, go = _skewed_layer_problem(5)
    dev = x.device
    backend = kernel_backend(comm_sms=2, timeout_ms=5000.0)
    ring = RingSpec(minibatch_tokens=256, ring_slots=2)
    import megatron_mok.kernel.backward as kb

    calls = []  # the wgrad kernel itself must receive main_grad (not a later main_grad.add_)
    real = kb.weight_grads_kernel

    def spy(*a, **k):
        calls.append(k.get("main_grad_w1") is not None)
        return real(*a, **k)

    monkeypatch.setattr(kb, "weight_grads_kernel", spy)

    def run(fuse):
        def body(tp):
            ps = [t.clone().requires_grad_() for t in (*w1, *w2)]
            for p in ps:
                p.main_grad = torch.full(p.shape, 0.5, dtype=torch.float32, device=dev)
                p.grad_added_to_main_grad = False
            plan = MokPlan(tp, L, ring, save_fc1_output=save_fc1_output, fuse_wgrad_into_main_grad=fuse)
            out = mok_moe(x, idx, w, ps[:L], ps[L:], plan, backend)
            out.backward(go)
            return [(p.grad, p.main_grad, p.grad_added_to_main_grad) for p in ps]

        return run_emulated(1, body)[0]

    plain = run(False)
    assert calls == [False]
    fused = run(True)
    assert calls == [False, True], calls
    assert backend.last_backward == "kernel"
    for (gp, mp, ap), (_, mf, af) in zip(plain, fused):
        assert not ap and torch.equal(mp, torch.full_like(mp, 0.5))
        assert af, "grad_added_to_main_grad not set"
        got, want = mf - 0.5, gp.float()
        assert (got - want).norm() <= 1e-2 * want.norm(), "main_grad != 0.5 + the unfused weight gradient"


@pytest.mark.parametrize(
    "glu_settings",
    [{}, {"glu_linear_offset": 1.0, "activation_func_clamp_value": 0.5}],
    ids=["swiglu", "clamped-offset-swiglu"],
)
def test_megatron_layer_kernel_backend_equals_alltoall(monkeypatch, glu_settings):
    _kernel_or_skip()
    pytest.importorskip("megatron.core")
    from megatron_mok.config import parse_config
    from megatron_mok.testing import build_moe_layer, init_one_rank, moe_transformer_config

    init_one_rank()

    H, F, E, K = 1024, 512, 8, 2
    kw = dict(hidden_size=H, ffn_hidden_size=F, num_experts=E, topk=K, dtype=torch.bfloat16, **glu_settings)
    torch.manual_seed(0)
    base = build_moe_layer(moe_transformer_config(dispatcher="alltoall", **kw)).cuda()
    tc = moe_transformer_config(dispatcher="mok", **kw)
    tc.mok_config = parse_config(
        {
            "model": {
                "name": "g",
                "hidden_size": H,
                "moe_ffn_hidden_size": F,
                "num_moe_experts": E,
                "moe_router_topk": K,
            },
            "kernel": {"comm_sms": 16, "ring_slots": 3, "minibatch_tokens": 256},
        },
        "gpu-test",
    )
    mok = build_moe_layer(tc).cuda()
    mok.load_state_dict(base.state_dict())
    x = torch.randn(1024, 2, H, device="cuda", dtype=torch.bfloat16)
    results = {}
    for name, layer, backend in (
        ("alltoall", base, "auto"),
        ("kernel", mok, "kernel"),
        ("reference", mok, "reference"),
    ):
        monkeypatch.setenv("MOK_BACKEND", backend)
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out, _ = layer(xi)
        out.float().sum().backward()
        grads = {n: p.grad.float().clone() for n, p in layer.named_parameters() if p.grad is not None}
        results[name] = (out.float(), xi.grad.float(), grads)
        if name != "alltoall":
            assert mok.token_dispatcher.last_backend == name  # the kernel path really ran
    for other in ("kernel", "reference"):
        o, gx, gw = results[other]
        ob, gxb, gwb = results["alltoall"]
        rel = (o - ob).norm() / ob.norm()
        assert rel < 1e-2, f"{other}: output rel err {rel:.3e}"
        assert (gx - gxb).norm() / gxb.norm() < 2e-2
        for n in gwb:
            assert (gw[n] - gwb[n]).norm() / gwb[n].norm().clamp_min(1e-6) < 3e-2, f"{other}: grad {n}"


def test_lazy_error_check_reports_a_stall_without_host_sync():
    """check="lazy" (the layer's default): the launch returns at once; the stall is raised by the
    next check, naming the rank, and later calls work."""
    kernel = _kernel_or_skip()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    R, L, H, F, K = 2, 4, 256, 128, 2
    xs = [torch.randn(600, H, generator=g).to(dev, torch.bfloat16) for _ in range(R)]
    idx = [torch.randint(0, R * L, (600, K), generator=g).to(dev, torch.int32) for _ in range(R)]
    ws = [torch.rand(600, K, generator=g).to(dev) for _ in range(R)]
    w1 = [[(torch.randn(2 * F, H, generator=g) / H**0.5).to(dev, torch.bfloat16) for _ in range(L)] for _ in range(R)]
    w2 = [[(torch.randn(H, F, generator=g) / F**0.5).to(dev, torch.bfloat16) for _ in range(L)] for _ in range(R)]
    kw = dict(comm_sms=2, ring_slots=16, minibatch_tokens=128)
    mok_forward_emulated(xs, idx, ws, w1, w2, **kw, timeout_ms=300.0, debug_stall=(1, 1), check="lazy")
    with pytest.raises(kernel.MokKernelError, match=r"timed out: rank 1"):
        kernel.check_pending_errors(wait=True)
    out, _, _ = mok_forward_emulated(xs, idx, ws, w1, w2, **kw, check="lazy")
    kernel.check_pending_errors(wait=True)  # a clean launch leaves nothing pending
    assert torch.isfinite(out[0].float()).all()


@pytest.mark.parametrize("save_fc1_output", [True, False])
def test_fp8_kernel_backend_trains_like_bf16(save_fc1_output):
    """kernel.dtype fp8 through the autograd path: FP8 forward kernel, then the backward kernel with FP8
    dgrad (saved fc1 output) or bf16 (recompute). Output and every gradient stay within the FP8 recipe's
    error of the bf16 backend's; weights are quantised once per weight version (an in-place update
    re-quantises)."""
    _kernel_or_skip()

    from megatron_mok.backend import select_backend
    from megatron_mok.function import mok_moe
    from megatron_mok.plan import MokPlan, RingSpec
    from megatron_mok.transport import run_emulated

    L, x, idx, w, w1, w2, go = _skewed_layer_problem(9)
    dev = x.device
    ring = RingSpec(minibatch_tokens=256, ring_slots=2)

    def run(dtype, ps):
        backend = select_backend(dev, 1, dtype, torch.bfloat16, comm_sms=2, timeout_ms=5000.0)
        assert backend.name == "kernel" and backend.dtype == dtype

        def body(tp):
            xx = x.clone().requires_grad_()
            ww = w.clone().requires_grad_()
            plan = MokPlan(tp, L, ring, save_fc1_output=save_fc1_output)
            out = mok_moe(xx, idx, ww, ps[:L], ps[L:], plan, backend)
            out.backward(go)
            return [out.detach(), xx.grad, ww.grad] + [p.grad for p in ps]

        return backend, run_emulated(1, body)[0]

    p16 = [t.clone().requires_grad_() for t in (*w1, *w2)]
    p8 = [t.clone().requires_grad_() for t in (*w1, *w2)]
    _, ref = run("bf16", p16)
    backend8, got = run("fp8", p8)
    assert backend8.last_backward == ("kernel (fp8 dgrad)" if save_fc1_output else "kernel")
    names = ["out", "grad x", "grad probs"] + [f"grad w1[{e}]" for e in range(L)] + [f"grad w2[{e}]" for e in range(L)]
    for name, a, b in zip(names, got, ref):
        assert torch.isfinite(a.float()).all(), f"{name}: not finite"
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < 0.1, f"{name}: fp8 vs bf16 rel err {err:.3e}"
    cached = [v[0]() for v in backend8._fp8_cache._entries.values()]
    assert sum(any(c is p for c in cached) for p in p8) == 2 * L, "every expert weight quantised and cached"
    q_before = backend8._fp8_cache.get(p8[0])[0]
    assert backend8._fp8_cache.get(p8[0])[0] is q_before, "unchanged weight re-quantised"
    with torch.no_grad():
        p8[0].mul_(0.5)  # an optimizer step
    assert backend8._fp8_cache.get(p8[0])[0] is not q_before, "updated weight served from the stale cache"


@pytest.mark.parametrize("save_fc1_output", [True, False])
def test_backward_minibatch_does_not_change_gradients(save_fc1_output):
    """kernel.backward_minibatch_tokens only re-cuts the backward kernel's schedule: every row's dgrad,
    the k-ascending grad_x sum and the wgrad do not depend on it, so the gradients are bit-identical to
    the forward-minibatch backward's."""
    _kernel_or_skip()

    from megatron_mok.function import mok_moe
    from megatron_mok.kernel_backend import KernelBackend
    from megatron_mok.plan import MokPlan, RingSpec
    from megatron_mok.transport import run_emulated

    L, x, idx, w, w1, w2, go = _skewed_layer_problem(13)
    ring = RingSpec(minibatch_tokens=256, ring_slots=2)

    def run(bmb):
        backend = KernelBackend(comm_sms=2, backward_comm_sms=4, timeout_ms=5000.0, backward_minibatch_tokens=bmb)

        def body(tp):
            xx = x.clone().requires_grad_()
            ww = w.clone().requires_grad_()
            ps = [t.clone().requires_grad_() for t in (*w1, *w2)]
            plan = MokPlan(tp, L, ring, save_fc1_output=save_fc1_output)
            out = mok_moe(xx, idx, ww, ps[:L], ps[L:], plan, backend)
            out.backward(go)
            return [xx.grad, ww.grad] + [p.grad for p in ps]

        return run_emulated(1, body)[0]

    base = run(0)
    for bmb in (64, 1024):
        got = run(bmb)
        for i, (a, b) in enumerate(zip(got, base)):
            assert torch.equal(a, b), f"backward minibatch {bmb}: gradient {i} differs from minibatch 256's"


def test_topk_routing_form_on_the_kernel():
    """A router giving top-k ids and probs ([T, K], Megatron's dense_output form, here in score order rather than
    ascending ids) runs on the kernel and computes what its dense routing map computes: the same rows, only the
    top-k sum in another order."""
    _kernel_or_skip()
    pytest.importorskip("megatron.core")
    from megatron_mok.config import parse_config
    from megatron_mok.testing import build_moe_layer, init_one_rank, make_fixed_router, moe_transformer_config

    init_one_rank()
    H, F, E, K = 1024, 512, 8, 4

    def router(dense: bool):
        def route(tokens: torch.Tensor, num_experts: int, topk: int):
            scores = tokens[:, :num_experts].float() * 3
            top, idx = scores.topk(topk, dim=1)
            probs = torch.softmax(top, dim=1)
            if not dense:
                return probs, idx
            dense_probs = torch.zeros_like(scores).scatter(1, idx, probs)
            return dense_probs, torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)

        return make_fixed_router(route)

    kw = dict(hidden_size=H, ffn_hidden_size=F, num_experts=E, topk=K, dtype=torch.bfloat16)
    cfg = parse_config(
        {
            "model": {"name": "g", "hidden_size": H, "moe_ffn_hidden_size": F, "num_moe_experts": E,
                      "moe_router_topk": K},
            "kernel": {"comm_sms": 16, "ring_slots": 3, "minibatch_tokens": 256},
        },
        "gpu-test",
    )  # fmt: skip
    layers = {}
    torch.manual_seed(0)
    for dense in (True, False):
        tc = moe_transformer_config(dispatcher="mok", **kw)
        tc.mok_config = cfg
        layers[dense] = build_moe_layer(tc, router(dense)).cuda()
    layers[False].load_state_dict(layers[True].state_dict())
    x = torch.randn(1024, 2, H, device="cuda", dtype=torch.bfloat16)
    got = {}
    for dense, layer in layers.items():
        xi = x.clone().requires_grad_()
        out, _ = layer(xi)
        out.float().sum().backward()
        assert layer.token_dispatcher.last_backend == "kernel"
        got[dense] = (out.float(), xi.grad.float())
    for a, b, what in zip(got[False], got[True], ("output", "grad_x")):
        rel = (a - b).norm() / b.norm()
        assert rel < 1e-2, f"{what}: top-k form vs dense map rel err {rel:.3e}"
