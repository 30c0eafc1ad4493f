"""CPU: every exception type of the project survives Megatron's ``build_module`` re-raise
(``type(e)(f"{e} when instantiating ...")``) with the project's own message, and a MoK layer built through
``build_module`` from a stock spec reports a bad config by name."""

from __future__ import annotations

import pytest

from megatron_mok.backend import MokBackendError
from megatron_mok.config import MokConfigError
from megatron_mok.env import MokEnvError
from megatron_mok.kernel.host.build import BuildError
from megatron_mok.kernel.host.errors import MokKernelError
from megatron_mok.layout import RoutingError
from megatron_mok.topology import MokTopologyError

ERRORS = [MokBackendError, MokEnvError, BuildError, MokKernelError, RoutingError, MokTopologyError]


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_message_survives_megatron_reraise(cls):
    e = cls("the project's message")
    again = type(e)(f"{e} when instantiating MoELayer")
    assert str(again) == "the project's message when instantiating MoELayer"


def test_config_error_survives_megatron_reraise():
    e = MokConfigError("kimi-k2.yaml", "kernel.ring_slots", "must be >= 2, got 1")
    again = type(e)(f"{e} when instantiating MoELayer")
    assert isinstance(again, MokConfigError)
    assert str(again) == "kimi-k2.yaml: key 'kernel.ring_slots': must be >= 2, got 1 when instantiating MoELayer"


def _build_with_missing_config(rank, world_size):
    import os

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    import megatron_mok
    from megatron_mok.testing import moe_transformer_config

    megatron_mok.register()
    mlp = get_gpt_layer_local_submodules(num_experts=8, moe_grouped_gemm=False).mlp
    spec = ModuleSpec(module=MoELayer, submodules=mlp.keywords["submodules"])
    os.environ["MOK_CONFIG"] = "doesnotexist"
    with pytest.raises(MokConfigError) as info:
        build_module(spec, config=moe_transformer_config(dispatcher="mok"))
    assert "doesnotexist" in str(info.value) and "when instantiating MoELayer" in str(info.value), str(info.value)


def test_bad_config_through_build_module():
    """Megatron's build_module of a stock MoE spec with mok: the config's own message reaches the caller."""
    from megatron_mok.testing import spawn

    spawn(_build_with_missing_config, 1)
