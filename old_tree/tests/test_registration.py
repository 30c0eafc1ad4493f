"""``mok`` reaches Megatron: config, MoELayer construction, and Megatron-LM's real CLI parser."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_mok.testing import build_moe_layer, moe_transformer_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _init_single_rank():
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_mok.testing import free_port

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)


def test_transformer_config_builds_a_mok_moe_layer():
    _init_single_rank()
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_mok.dispatcher import MoKTokenDispatcher
    from megatron_mok.moe_layer import MokMoELayer

    cfg = moe_transformer_config(dispatcher="mok")
    layer = build_moe_layer(cfg)  # through the stock spec: partial(MoELayer, ...)
    assert isinstance(layer, MokMoELayer) and isinstance(layer, MoELayer)
    assert isinstance(layer.token_dispatcher, MoKTokenDispatcher)
    assert isinstance(
        layer.token_dispatcher,
        __import__(
            "megatron.core.transformer.moe.token_dispatcher", fromlist=["MoETokenDispatcher"]
        ).MoETokenDispatcher,
    )
    assert cfg.moe_token_dispatcher_type == "mok"  # the placeholder used during build is restored
    out, bias = layer(torch.randn(4, 2, cfg.hidden_size))
    assert out.shape == (4, 2, cfg.hidden_size) and bias is None
    # other dispatcher types are untouched by the patch
    other = build_moe_layer(moe_transformer_config(dispatcher="allgather"))
    assert type(other) is MoELayer


def test_config_for_another_model_is_rejected_at_build():
    _init_single_rank()
    from megatron_mok.config import MokConfigError

    cfg = moe_transformer_config(dispatcher="mok")
    cfg.mok_config = "kimi-k2"
    with pytest.raises(MokConfigError, match="model.hidden_size.*7168.*64"):
        build_moe_layer(cfg)


FAKE_PRETRAIN = textwrap.dedent(
    """
    from megatron.training.arguments import parse_args
    args = parse_args()
    print("DISPATCHER", args.moe_token_dispatcher_type, "MOKCFG", args.mok_config)
    """
)


def _run(args, tmp_path):
    script = tmp_path / "pretrain_fake.py"
    script.write_text(FAKE_PRETRAIN)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, *args(str(script))], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path
    )


@pytest.mark.slow
def test_launch_flag_with_megatron_lm_parser(tmp_path):
    flags = ["--moe-token-dispatcher-type", "mok", "--mok-config", "deepseek-v3"]
    stock = _run(
        lambda s: [
            "-c",
            "import typing, typing_extensions; typing.override = typing_extensions.override; "
            f"import runpy, sys; sys.argv = [{s!r}, *{flags!r}]; runpy.run_path({s!r}, run_name='__main__')",
        ],
        tmp_path,
    )
    assert stock.returncode != 0 and "invalid choice: 'mok'" in stock.stderr  # Megatron alone rejects it
    launched = _run(lambda s: ["-m", "megatron_mok.launch", s, *flags], tmp_path)
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert "DISPATCHER mok MOKCFG deepseek-v3" in launched.stdout
    bad = _run(lambda s: ["-m", "megatron_mok.launch", s, "--moe-token-dispatcher-type", "mokk"], tmp_path)
    assert bad.returncode != 0 and "invalid choice: 'mokk'" in bad.stderr


def test_extra_args_provider_widens_choices():
    import argparse

    from megatron_mok.registration import add_mok_args

    p = argparse.ArgumentParser()
    p.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall", "flex"), default="allgather")
    add_mok_args(add_mok_args(p))  # idempotent
    ns = p.parse_args(["--moe-token-dispatcher-type", "mok", "--mok-config", "kimi-k2"])
    assert (ns.moe_token_dispatcher_type, ns.mok_config) == ("mok", "kimi-k2")


def test_kernel_backend_is_shared_per_setting():
    # EP > 1 keeps its symmetric-memory buffers in the backend: one instance per setting per process,
    # not one per layer call (that would re-allocate and re-rendezvous every forward)
    from megatron_mok.backend import kernel_backend

    a = kernel_backend(16, 5000.0)
    assert kernel_backend(16, 5000.0) is a
    assert kernel_backend(8, 5000.0) is not a and kernel_backend(16, 100.0) is not a


def test_launch_skips_the_dataset_helper_build_of_a_wheel(monkeypatch):
    """A megatron-core wheel has the dataset helpers prebuilt but no Makefile: Megatron-LM's
    initialize would run `make` there and exit; the launcher replaces that step (source trees keep it)."""
    import os

    from megatron.core.datasets import utils

    from megatron_mok import launch

    monkeypatch.setattr(utils, "compile_helpers", utils.compile_helpers)  # restored afterwards
    has_makefile = os.path.isfile(os.path.join(os.path.dirname(utils.__file__), "Makefile"))
    before = utils.compile_helpers
    replaced = launch._prebuilt_dataset_helpers()
    assert replaced is (not has_makefile)
    if replaced:
        assert utils.compile_helpers is not before
        utils.compile_helpers()  # a no-op that says why (no `make`, no sys.exit)
    else:
        assert utils.compile_helpers is before
