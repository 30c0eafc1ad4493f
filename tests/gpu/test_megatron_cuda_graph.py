"""GPU: MoK layers inside Megatron-Core's own CUDA graphs (``cuda_graph_impl="local"``, ``CudaGraphManager``), EP 1.

A two-layer block of Megatron's local GPT layers (self-attention + a MoE built with
``moe_token_dispatcher_type="mok"``) is trained through Megatron's path: the first step runs eagerly and records
what to capture, ``create_cudagraphs()`` captures the forward and backward graphs, later steps replay them. A twin
block with the same weights and no CUDA graphs gives the eager answers; the MoK kernels are deterministic, so every
replay must match them bit for bit: the output, the input gradient and every parameter's gradient (as Megatron's
DDP sees it: ``main_grad`` plus any ``.grad`` not already added there).

The scopes of ``cuda_graph_modules`` that reach a MoE layer:

* whole layer (``"full"``, i.e. none listed): the MoK forward and backward kernels are captured with the rest of the
  layer (at EP 1 their launches have fixed shapes and the routing is read on the device);
* ``moe_router`` (the local implementation adds ``moe_preprocess``), on Megatron's ``MoETransformerLayer``: the
  router and MoK's routing preprocessing are captured, MoK runs eagerly between the router and post-process graphs
  on the top-k ids the router graph returns (the dispatcher's ``cudagraph_attrs``). GPT's own layer specs build
  plain ``TransformerLayer``, whose local graphs ignore this scope;
* ``moe``: Megatron's config accepts it only for drop-and-pad MoE, which MoK refuses at build time.

``cuda_graph_impl="transformer_engine"`` (needs Transformer Engine) and ``"full_iteration"`` (one graph of a whole
training step, built by Megatron's schedules) are not covered here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

H, F, E, K = 512, 256, 8, 4  # multiples of 128: the fp8 kernel's block scales tile them too
HEADS, LAYERS = 4, 2
SEQ, BATCH = 256, 2
SEED = 1234
DEVICE = torch.device("cuda")


@pytest.fixture(scope="module")
def megatron_ep1() -> Iterator[None]:
    """One NCCL rank with Megatron's parallel state (TP = PP = EP = 1) and a CUDA RNG tracker Megatron's CUDA
    graphs accept (``use_cudagraphable_rng``); afterwards the tracker is a plain one again."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from megatron.core import tensor_parallel

    from megatron_mok.testing import init_one_rank

    init_one_rank()
    tensor_parallel.model_parallel_cuda_manual_seed(SEED, use_cudagraphable_rng=True, force_reset_rng=True)
    yield
    tensor_parallel.model_parallel_cuda_manual_seed(SEED, force_reset_rng=True)


@pytest.fixture(autouse=True)
def _no_graphs_left_behind() -> Iterator[None]:
    """Megatron keeps its graphs, capture flags and a side stream in module globals: every test starts and ends
    without them, also after a failed capture."""
    yield
    if not torch.cuda.is_available():
        return
    from megatron.core.transformer import cuda_graphs

    cuda_graphs.delete_cuda_graphs()
    cuda_graphs._set_capture_end()
    cuda_graphs._set_warmup_end()
    torch.cuda.set_stream(torch.cuda.default_stream())


def _mok_config(dtype: str) -> Any:
    from megatron_mok.config import parse_config

    model = {
        "name": "graph-test",
        "hidden_size": H,
        "moe_ffn_hidden_size": F,
        "num_moe_experts": E,
        "moe_router_topk": K,
    }
    kernel = {"dtype": dtype, "comm_sms": 16, "ring_slots": 3, "minibatch_tokens": 256}
    return parse_config({"model": model, "kernel": kernel}, "cuda-graph-test")


def _config(scope: str, impl: str, **overrides: Any) -> Any:
    from megatron_mok.testing import moe_transformer_config

    return moe_transformer_config(
        hidden_size=H,
        ffn_hidden_size=F,
        num_experts=E,
        topk=K,
        dtype=torch.bfloat16,
        num_layers=LAYERS,
        num_attention_heads=HEADS,
        # no dropout: replays and eager calls draw from the RNG differently, and only the kernels are under test
        hidden_dropout=0.0,
        attention_dropout=0.0,
        cuda_graph_impl=impl,
        cuda_graph_modules=scope,
        **overrides,
    )


def _block(scope: str, impl: str, dtype: str = "bf16", fuse_wgrad: bool = False) -> torch.nn.Module:
    """Megatron's TransformerBlock of LAYERS local GPT layers with a MoK MoE each, bf16 on the GPU, every parameter
    with an fp32 ``main_grad`` as Megatron's DDP gives it (the local CUDA graphs add their weight gradients there).

    ``moe_router`` scopes build Megatron's ``MoETransformerLayer`` (the layer class with partial MoE graphs).
    ``fuse_wgrad``: gradient-accumulation fusion, set once the block is built: Megatron's own linear layers need
    Apex for it and read it at build time, MoK reads it at every call, so only the expert weight gradients fuse."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

    import megatron_mok

    megatron_mok.register()
    config = _config(scope, impl)
    config.mok_config = _mok_config(dtype)
    layer = MoETransformerLayer if "moe_router" in scope else TransformerLayer
    spec = ModuleSpec(module=layer, submodules=get_gpt_layer_local_submodules(num_experts=E, moe_grouped_gemm=False))
    # as Megatron's Float16Module: every parameter in bf16 (the norms are built in fp32)
    block = TransformerBlock(config, spec).bfloat16().to(DEVICE)
    config.gradient_accumulation_fusion = fuse_wgrad
    for p in block.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=DEVICE)
        p.grad_added_to_main_grad = False
    return block


def _mok_layers(block: torch.nn.Module) -> list[Any]:
    from megatron_mok.moe_layer import MokMoELayer

    layers = [m for m in block.modules() if isinstance(m, MokMoELayer)]
    assert len(layers) == LAYERS, f"{len(layers)} MoK layers built, expected one per transformer layer"
    return layers


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [S, B, H] and the output gradient, bf16."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn((SEQ, BATCH, H), generator=g, device=DEVICE).bfloat16()
    gy = torch.randn((SEQ, BATCH, H), generator=g, device=DEVICE).bfloat16()
    return x, gy


def _causal_mask() -> torch.Tensor:
    return torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device=DEVICE), 1)[None, None]  # True: masked out


def _gradient(p: torch.nn.Parameter) -> torch.Tensor:
    """The gradient Megatron's DDP reduces: main_grad, plus .grad unless that was added to main_grad already."""
    g = p.main_grad.clone()
    if p.grad is not None and not p.grad_added_to_main_grad:
        g += p.grad.float()
    return g


def _step(block: torch.nn.Module, x: torch.Tensor, gy: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward + backward from zeroed gradients; the output, the input gradient and every parameter's gradient,
    cloned (a replay returns the graphs' static buffers, which the next replay overwrites)."""
    for p in block.parameters():
        p.grad = None
        p.main_grad.zero_()
        p.grad_added_to_main_grad = False
    xi = x.clone().requires_grad_()
    out = block(hidden_states=xi, attention_mask=mask)
    out.backward(gy)
    assert xi.grad is not None, "no gradient reached the block's input"
    got = {"output": out.detach().clone(), "input gradient": xi.grad.clone()}
    got.update({f"gradient of {n}": _gradient(p) for n, p in block.named_parameters()})
    return got


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert torch.isfinite(w).all(), f"{what}: eager {name} is not finite"
        if not torch.equal(g, w):
            diff = (g.float() - w.float()).abs().max().item()
            raise AssertionError(f"{what}: {name} differs from the eager call (max abs difference {diff:.3e})")


def _perturb(block: torch.nn.Module, seed: int) -> None:
    """An optimizer step's in-place weight update (the same one for blocks of the same structure)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            step = torch.randn(p.shape, generator=g, device=DEVICE) * 0.1 * p.float().abs().mean()
            p.add_(step.to(p.dtype))


def _graphs_captured(block: torch.nn.Module, scope: str) -> None:
    """Every transformer layer owns captured forward and backward graphs of the scope's part."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layers = [m for m in block.modules() if isinstance(m, TransformerLayer)]
    assert len(layers) == LAYERS
    managers = (
        ["cudagraph_manager_router", "cudagraph_manager_postprocess"]
        if "moe_router" in scope
        else ["cudagraph_manager"]
    )
    for layer in layers:
        for name in managers:
            runners = getattr(layer, name).cudagraph_runners
            assert runners, f"layer {layer.layer_number}: {name} recorded nothing"
            for r in runners:
                assert r.fwd_graph is not None, f"layer {layer.layer_number}: {name} has no forward graph"
                assert r.bwd_graph is not None, f"layer {layer.layer_number}: {name} has no backward graph"


def _graph_run(
    scope: str, dtype: str, fuse_wgrad: bool, update_weights: bool, kernel: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eager recording step, capture, replays of two inputs (and, with ``update_weights``, a replay after an in-place
    weight update), each compared with the twin block's eager call."""
    from megatron.core.transformer.cuda_graphs import create_cudagraphs

    monkeypatch.setenv("MOK_BACKEND", "kernel")  # an error, not the reference, if the kernel cannot run
    torch.manual_seed(SEED)
    graphed = _block(scope, "local", dtype, fuse_wgrad)
    eager = _block(scope, "none", dtype, fuse_wgrad)
    eager.load_state_dict(graphed.state_dict())
    mask = _causal_mask()
    data = [_inputs(seed) for seed in (1, 2)]
    want = [_step(eager, x, gy, mask) for x, gy in data]
    kernel.check_pending_errors(wait=True)
    assert all(m.token_dispatcher.last_backend == "kernel" for m in _mok_layers(eager))

    # Megatron's first step runs eagerly and records which graphs to capture, in execution order
    _assert_same(_step(graphed, *data[0], mask), want[0], "the recording step")
    mok = _mok_layers(graphed)
    assert all(m.token_dispatcher.last_backend == "kernel" for m in mok)
    create_cudagraphs()
    _graphs_captured(graphed, scope)

    plans = [m.token_dispatcher.last_plan for m in mok]
    for step, i in enumerate((1, 0, 1)):  # new values in the graphs' static inputs at every replay
        got = _step(graphed, *data[i], mask)
        kernel.check_last_error()  # a captured launch's error record is read after a replay
        _assert_same(got, want[i], f"replay {step} (input {i})")
    ran_eagerly = [m.token_dispatcher.last_plan is not p for m, p in zip(mok, plans)]
    if "moe_router" in scope:
        assert all(ran_eagerly), "MoK should run eagerly between the router and post-process graphs"
    else:
        assert not any(ran_eagerly), "MoK should run inside the layer's graphs, not from the host"

    if update_weights:
        _perturb(graphed, seed=3)
        _perturb(eager, seed=3)
        want_updated = _step(eager, *data[0], mask)
        got = _step(graphed, *data[0], mask)
        kernel.check_last_error()
        _assert_same(got, want_updated, "the replay after a weight update")


SCOPES = ["full", "moe_router"]


@pytest.mark.parametrize("fuse_wgrad", [False, True], ids=["wgrad", "wgrad-into-main-grad"])
@pytest.mark.parametrize("scope", SCOPES)
def test_bf16_graph_replays_equal_eager_calls(megatron_ep1, kernel, monkeypatch, scope, fuse_wgrad):
    _graph_run(scope, "bf16", fuse_wgrad, update_weights=True, kernel=kernel, monkeypatch=monkeypatch)


@pytest.mark.parametrize(
    "scope, update_weights",
    [
        ("full", False),
        ("full", True),  # quantised inside the graph: every replay quantises the current weights
        ("moe_router", True),  # MoK runs eagerly: its FP8 weight cache sees every weight update
    ],
    ids=["full", "full-weight-update", "moe_router-weight-update"],
)
def test_fp8_graph_replays_equal_eager_calls(megatron_ep1, kernel, monkeypatch, scope, update_weights):
    """kernel.dtype fp8: the FP8 forward and FP8-dgrad backward kernels in the same graphs."""
    _graph_run(scope, "fp8", False, update_weights=update_weights, kernel=kernel, monkeypatch=monkeypatch)


def test_moe_scope_is_refused(megatron_ep1):
    """The ``moe`` scope never reaches a MoK layer: Megatron's config accepts it only for drop-and-pad MoE, and MoK
    refuses padding to capacity when the layer is built (one line naming the setting)."""
    from megatron_mok.testing import build_moe_layer

    with pytest.raises(AssertionError, match="moe cuda graph is only supported with drop-padding MoE"):
        _config("moe", "local")
    padded = _config("moe", "local", moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    padded.mok_config = _mok_config("bf16")
    with pytest.raises(
        ValueError, match="moe_pad_expert_input_to_capacity is not supported with moe_token_dispatcher_type='mok'"
    ):
        build_moe_layer(padded)
