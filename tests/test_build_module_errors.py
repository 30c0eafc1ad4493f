"""CPU: every exception type of the project survives Megatron's ``build_module`` re-raise
(``type(e)(f"{e} when instantiating ...")``) with the project's own message, and a MoK layer built through
``build_module`` from a stock spec reports a bad config by name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from megatron_mok.backend import MokBackendError
from megatron_mok.config import MokConfigError
from megatron_mok.env import MokEnvError
from megatron_mok.kernel.build import BuildError
from megatron_mok.kernel.errors import MokKernelError
from megatron_mok.layout import RoutingError
from megatron_mok.topology import MokTopologyError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


LAUNCHED_PRETRAIN = textwrap.dedent(
    """
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args

    from megatron_mok.testing import free_port, moe_transformer_config

    global_vars._GLOBAL_ARGS = parse_args()  # what Megatron-LM's initialize_megatron does
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    mlp = get_gpt_layer_local_submodules(num_experts=8, moe_grouped_gemm=False).mlp
    build_module(ModuleSpec(module=MoELayer, submodules=mlp.keywords["submodules"]),
                 config=moe_transformer_config(dispatcher="mok"))
    print("BUILT")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mok_config", "expected"),
    [("doesnotexist", "doesnotexist"), ("kimi-k2", "model.hidden_size")],
    ids=["unknown-config", "config-for-another-model"],
)
def test_bad_config_through_megatron_lm_launcher(tmp_path, mok_config, expected):
    """``python -m megatron_mok.launch pretrain.py --mok-config X``: the last line the user sees is the
    project's MokConfigError, naming the problem, not a wrapper's TypeError."""
    script = tmp_path / "pretrain_fake.py"
    script.write_text(LAUNCHED_PRETRAIN)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="ignore")
    env.pop("MOK_CONFIG", None)
    flags = ["--moe-token-dispatcher-type", "mok", "--mok-config", mok_config]
    run = subprocess.run(
        [sys.executable, "-m", "megatron_mok.launch", str(script), *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert run.returncode != 0 and "BUILT" not in run.stdout, run.stdout[-2000:]
    last = [line for line in run.stderr.splitlines() if line.strip()][-1]
    # torch prefixes an uncaught error's lines with the rank once a process group exists
    last = re.sub(r"^\[rank\d+\]: ", "", last)
    assert last.startswith("megatron_mok.config.MokConfigError:"), run.stderr[-3000:]
    assert expected in last and "when instantiating MoELayer" in last, last
