"""CPU, gloo, EP 1 and 2: multi-token prediction (``mtp_num_layers=1``, Megatron's own MTP block spec from
``get_gpt_mtp_block_spec``) on a small GPTModel with a MoE in every layer, the MTP layer's included, gives the
same results through ``mok`` layers as through Megatron's ``alltoall`` layers (same weights, same data): the
language-model loss per token, the MTP loss Megatron records, the load-balancing loss of every MoE layer and
every parameter's gradient, the MTP layer's included (it only gets gradients through the MTP loss)."""

from __future__ import annotations

import pytest
import torch

from megatron_mok.testing import assert_grad_close, gpt_moe_layer_spec, moe_transformer_config, spawn

TOL = dict(rtol=1e-5, atol=1e-6)
LAYERS, VOCAB, SEQ, BATCH = 2, 128, 16, 2


def _model(dispatcher: str, ep: int) -> torch.nn.Module:
    """GPTModel (local spec, a MoE in every layer) with one MTP layer built from the decoder's layer spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    config = moe_transformer_config(
        ep_size=ep,
        dispatcher=dispatcher,
        num_layers=LAYERS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mtp_num_layers=1,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
    )
    spec = gpt_moe_layer_spec(config.num_moe_experts)
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    torch.manual_seed(1234)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        mtp_block_spec=mtp_spec,
    )


def _step(model: torch.nn.Module, rank: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward of one batch: the per-token LM loss, the MTP loss and the load-balancing losses
    Megatron recorded. The MTP and load-balancing losses enter the backward through Megatron's loss
    auto-scalers, not through the returned loss; their scale is process-wide state a schedule sets per
    microbatch, so it is set here to what a one-microbatch schedule without loss scaling sets (1)."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    loss = model(tokens[:, :-1], positions, attention_mask=causal, labels=tokens[:, 1:])
    loss.float().mean().backward()
    mtp_loss = MTPLossLoggingHelper.tracker["loss_values"].clone()
    aux = {name: entry.values.clone() for name, entry in tracker.metrics.items()}
    return loss.detach(), mtp_loss, aux


def _compare(rank: int, ws: int) -> None:
    import megatron_cpu_shim

    megatron_cpu_shim.install()
    import megatron_mok

    megatron_mok.register()
    base = _model("alltoall", ws)
    mok = _model("mok", ws)
    mok.load_state_dict(base.state_dict())
    layers = [m for m in mok.modules() if type(m).__name__ == "MokMoELayer"]
    assert [m.is_mtp_layer for m in layers] == [False] * LAYERS + [True], "the MTP layer's MoE is not a MoK layer"
    loss_a, mtp_a, aux_a = _step(base, rank)
    loss_b, mtp_b, aux_b = _step(mok, rank)
    torch.testing.assert_close(loss_b, loss_a, **TOL, msg=lambda m: f"rank {rank}: LM loss {m}")
    assert mtp_a.shape == (1,) and mtp_a.item() > 0, f"rank {rank}: no MTP loss recorded ({mtp_a})"
    torch.testing.assert_close(mtp_b, mtp_a, **TOL, msg=lambda m: f"rank {rank}: MTP loss {m}")
    assert aux_a.keys() == aux_b.keys() == {"load_balancing_loss"}, f"rank {rank}: {aux_a.keys()}"
    # one entry per decoder layer and one for the MTP layer, every one recorded
    assert aux_a["load_balancing_loss"].shape == (LAYERS + 1,) and aux_a["load_balancing_loss"].all()
    torch.testing.assert_close(
        aux_b["load_balancing_loss"], aux_a["load_balancing_loss"], **TOL, msg=lambda m: f"rank {rank}: aux {m}"
    )
    got = dict(mok.named_parameters())
    assert got.keys() == dict(base.named_parameters()).keys()
    assert any(name.startswith("mtp.") for name in got)
    for name, p in base.named_parameters():
        assert p.grad is not None, f"rank {rank}: {name} has no gradient under alltoall"
        q = got[name].grad
        assert q is not None, f"rank {rank}: {name} has no gradient under mok"
        assert_grad_close(q, p.grad, f"rank {rank}: {name} grad")


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
def test_mtp_equals_alltoall(ep: int) -> None:
    spawn(_compare, ep)
