"""GPU: a Megatron MoE layer built with ``moe_token_dispatcher_type="mok"`` is bitwise deterministic run to run.

Same weights, same inputs, forward + backward again and again (with a launch of another token count in between,
which leaves other contents in the caching allocator's blocks the workspaces come from), and once more on a second layer rebuilt from the
first one's state dict (new parameter objects: the FP8 weight copies are quantised afresh): the output, the input
gradient, the router weight's gradient and every expert weight's gradient must be the same bits every time, for the
bf16 and the FP8 kernel, with the forward's dedicated pull SMs and with the in-SM pull, and with the expert weight
gradients stored or added into Megatron's fp32 ``main_grad``.

Why bit-exact is the right expectation: no floating-point value of the MoK kernels is reduced across CTAs or
warps in a run-dependent order. The integer atomics in the kernels hand out work (GEMM tile tickets, the push and
home-reduction cursors) or count progress (ring and grid barriers); they decide which CTA computes a tile, never
the order of a sum. The layout rows of an expert follow (token, k) order, computed by prefix sums, not by arrival;
each wgrad output tile is reduced over its expert's rows by one CTA in row order, and written (or added to
``main_grad``) by one thread per element; the router-weight gradient of a (token, k) entry is one warp's dot
product with a fixed lane split and shuffle tree; the top-k sum of grad_x adds k in ascending order. The rest of
the layer (Megatron's router: a cuBLAS GEMM, softmax, top-k, gathers and scatters with one value per element) is
deterministic on one GPU too.

The routing is skewed on purpose (a constant per-expert bias on the router's logits): a few experts get most of
the 2048 x top-4 rows, so many CTAs work on the same experts' tiles, ring slots and counters at once, and the last
experts get few or no rows.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytestmark = pytest.mark.gpu

H, F, E, K = 1024, 512, 8, 4
SEQ, BATCH = 1024, 2  # 2048 tokens
OTHER_SEQ = 300  # the launch of another token count between the compared calls
#: added to the router's logits: experts 0-3 win most top-4 choices, 6 and 7 rarely any
SKEW = (3.0, 2.5, 2.0, 1.5, 0.0, -1.0, -3.0, -6.0)
DEVICE = torch.device("cuda")


@pytest.fixture(scope="module")
def megatron_ep1() -> Iterator[None]:
    """One NCCL rank with Megatron's parallel state (TP = PP = EP = 1)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from megatron_mok.testing import init_one_rank

    init_one_rank()
    yield


def _skewed_router() -> type:
    """Megatron's top-k router (its gating, softmax, top-k and their backward) on logits with SKEW added."""
    from megatron_mok.testing import make_portable_router

    base = make_portable_router()

    class SkewedRouter(base):  # type: ignore[misc, valid-type]
        def gating(self, input: torch.Tensor) -> torch.Tensor:
            logits = super().gating(input)
            return logits + torch.tensor(SKEW, dtype=logits.dtype, device=logits.device)

    return SkewedRouter


def _layer(dtype: str, comm_sms: int, fuse_wgrad: bool) -> torch.nn.Module:
    """A Megatron MoE layer (local spec, SequentialMLP experts) with the MoK kernel config ``dtype`` / ``comm_sms``;
    with ``fuse_wgrad`` the expert weights carry an fp32 ``main_grad`` that the wgrad kernel adds into."""
    from megatron_mok.config import parse_config
    from megatron_mok.testing import build_moe_layer, moe_transformer_config

    tc = moe_transformer_config(hidden_size=H, ffn_hidden_size=F, num_experts=E, topk=K, dtype=torch.bfloat16)
    model = {
        "name": "determinism",
        "hidden_size": H,
        "moe_ffn_hidden_size": F,
        "num_moe_experts": E,
        "moe_router_topk": K,
    }
    # comm_sms 0: the pull runs on spare warps of the compute SMs (the backward still needs its own comm SMs)
    kernel = {"dtype": dtype, "comm_sms": comm_sms, "backward_comm_sms": 16, "ring_slots": 3, "minibatch_tokens": 512}
    tc.mok_config = parse_config({"model": model, "kernel": kernel}, "determinism-test")
    layer = build_moe_layer(tc, router=_skewed_router()).to(DEVICE)
    # set once the layer is built: Megatron's own linear layers would want Apex for it at build time; MoK reads it
    # at every call
    tc.gradient_accumulation_fusion = fuse_wgrad
    if fuse_wgrad:
        for p in _expert_weights(layer).values():
            p.main_grad = torch.empty(p.shape, dtype=torch.float32, device=DEVICE)
            p.grad_added_to_main_grad = False
    return layer


def _expert_weights(layer: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    weights = {n: p for n, p in layer.named_parameters() if n.startswith("experts.")}
    assert len(weights) == 2 * E, sorted(weights)
    return weights


def _inputs(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn((tokens // BATCH, BATCH, H), generator=g, device=DEVICE).bfloat16()
    gy = torch.randn((tokens // BATCH, BATCH, H), generator=g, device=DEVICE).bfloat16()
    return x, gy


def _run(layer: torch.nn.Module, x: torch.Tensor, gy: torch.Tensor, fuse_wgrad: bool) -> dict[str, torch.Tensor]:
    """One forward + backward: the output, the input gradient, the router weight's gradient and every expert
    weight's gradient (with ``fuse_wgrad``: its main_grad, which starts from the same non-zero values every run, so
    the kernel's read-add-write is compared too)."""
    layer.zero_grad(set_to_none=True)
    experts = _expert_weights(layer)
    if fuse_wgrad:
        g = torch.Generator(device=DEVICE).manual_seed(7)
        for p in experts.values():
            p.main_grad.copy_(torch.randn(p.shape, generator=g, device=DEVICE))
            p.grad_added_to_main_grad = False
    xi = x.clone().requires_grad_()
    out, _ = layer(xi)
    out.backward(gy)
    assert layer.token_dispatcher.last_backend == "kernel", layer.token_dispatcher.last_backend
    got = {"output": out.detach().clone(), "input gradient": xi.grad.clone()}
    got["router weight gradient"] = layer.router.weight.grad.clone()
    for name, p in experts.items():
        if fuse_wgrad:
            assert p.grad_added_to_main_grad, f"{name}: the wgrad kernel did not add into main_grad"
            got[f"{name} main_grad"] = p.main_grad.clone()
        else:
            got[f"{name} gradient"] = p.grad.clone()
    return got


def _routed_rows(layer: torch.nn.Module) -> torch.Tensor:
    """Rows per expert of the layer's last call."""
    idx = layer.token_dispatcher.topk_idx
    return torch.bincount(idx[idx >= 0].flatten(), minlength=E)


@pytest.mark.parametrize("fuse_wgrad", [False, True], ids=["wgrad", "wgrad-into-main-grad"])
@pytest.mark.parametrize("comm_sms", [16, 0], ids=["comm-sms", "in-sm-pull"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_layer_is_bitwise_deterministic(megatron_ep1, kernel, monkeypatch, dtype, comm_sms, fuse_wgrad):
    monkeypatch.setenv("MOK_BACKEND", "kernel")  # an error, not the reference, if the kernel cannot run
    torch.manual_seed(0)
    layer = _layer(dtype, comm_sms, fuse_wgrad)
    assert layer.token_dispatcher.mok_config.kernel.dtype == dtype  # fp8 never falls back: it runs or raises
    x, gy = _inputs(SEQ * BATCH, seed=1)
    other = _inputs(OTHER_SEQ * BATCH, seed=2)

    first = _run(layer, x, gy, fuse_wgrad)
    rows = _routed_rows(layer)
    assert int(rows.sum()) == SEQ * BATCH * K
    assert int(rows.max()) > 1.5 * SEQ * BATCH * K / E, f"routing not skewed: rows per expert {rows.tolist()}"
    for name, t in first.items():
        assert torch.isfinite(t).all(), f"{name} is not finite"
    for name in ("output", "input gradient", "router weight gradient"):
        assert first[name].abs().max() > 0, f"{name} is all zero"

    runs = {"the second call": _run(layer, x, gy, fuse_wgrad)}
    _run(layer, *other, fuse_wgrad)  # another token count between calls
    runs["a call after one of another token count"] = _run(layer, x, gy, fuse_wgrad)
    twin = _layer(dtype, comm_sms, fuse_wgrad)
    twin.load_state_dict(layer.state_dict())
    runs["a layer rebuilt from the state dict"] = _run(twin, x, gy, fuse_wgrad)
    kernel.check_pending_errors(wait=True)

    for what, got in runs.items():
        for name, want in first.items():
            if not torch.equal(got[name], want):
                diff = (got[name].float() - want.float()).abs().max().item()
                raise AssertionError(f"{what}: {name} differs from the first call's (max abs difference {diff:.3e})")
