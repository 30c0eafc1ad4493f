"""CPU, gloo: a distributed checkpoint of a MoE layer saved under one dispatcher loads under the other, at another EP
size too -- MoK keeps Megatron's parameters, so its sharded state dict is Megatron's: EP 2 ``alltoall`` -> EP 1 and
EP 2 ``mok``, EP 1 ``mok`` -> EP 2 ``alltoall``. Every expert's weights land at its global index, the router's as
saved."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_mok.testing import build_moe_layer, moe_transformer_config, spawn

E = 8


def _layer(ws: int, dispatcher: str, seed: int):
    import megatron_cpu_shim

    megatron_cpu_shim.install()
    torch.manual_seed(seed)
    return build_moe_layer(moe_transformer_config(ep_size=ws, dispatcher=dispatcher, num_experts=E))


def _global_weights(layer, rank: int, ws: int) -> dict[str, torch.Tensor]:
    """This rank's parameters by global name: experts by their global index."""
    L = E // ws
    out = {}
    for name, p in layer.named_parameters():
        if name.startswith("experts.local_experts."):
            local, rest = name.removeprefix("experts.local_experts.").split(".", 1)
            name = f"expert{rank * L + int(local)}.{rest}"
        out[name] = p.detach().clone()
    return out


def _save(rank: int, ws: int, path: str, dispatcher: str) -> None:
    from megatron.core import dist_checkpointing

    layer = _layer(ws, dispatcher, seed=1)
    dist_checkpointing.save(layer.sharded_state_dict(prefix="moe."), path)
    torch.save(_global_weights(layer, rank, ws), os.path.join(path, f"weights-{rank}.pt"))


def _load(rank: int, ws: int, path: str, dispatcher: str, saved_ranks: int) -> None:
    from megatron.core import dist_checkpointing

    layer = _layer(ws, dispatcher, seed=2)  # other initial weights: everything checked comes from the checkpoint
    sharded = layer.sharded_state_dict(prefix="moe.")
    loaded = dist_checkpointing.load(sharded, path)
    result = layer.load_state_dict({k.removeprefix("moe."): v for k, v in loaded.items()}, strict=False)
    assert not result.missing_keys, result.missing_keys
    saved: dict[str, torch.Tensor] = {}
    for r in range(saved_ranks):
        saved.update(torch.load(os.path.join(path, f"weights-{r}.pt")))
    got = _global_weights(layer, rank, ws)
    for name, value in got.items():
        assert torch.equal(value, saved[name]), f"rank {rank}: {name} differs from the checkpoint"


@pytest.mark.slow
@pytest.mark.parametrize(
    "save_ep, save_with, load_ep, load_with",
    [(2, "alltoall", 2, "mok"), (2, "alltoall", 1, "mok"), (1, "mok", 2, "alltoall")],
)
def test_checkpoint_moves_between_dispatchers_and_ep_sizes(tmp_path, save_ep, save_with, load_ep, load_with):
    spawn(_save, save_ep, str(tmp_path), save_with)
    spawn(_load, load_ep, str(tmp_path), load_with, save_ep)
