"""CPU: the Megatron-LM launch script expands to the intended pretrain_gpt.py flags (stub torchrun)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _expand(tmp_path: Path, **env: str) -> list[str]:
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    (stub / "torchrun").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    (stub / "torchrun").chmod(0o755)
    (stub / "python").write_text(f'#!/usr/bin/env bash\nexec {sys.executable} "$@"\n')
    (stub / "python").chmod(0o755)
    e = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "MEGATRON_LM": "/mlm", **env}
    out = subprocess.run(
        ["bash", str(ROOT / "examples" / "pretrain_moe.sh")], env=e, cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_pretrain_script_full_and_no_te_variants(tmp_path):
    full = _expand(tmp_path, MODEL="kimi-k2")
    assert "--multi-latent-attention" in full and "--moe-token-dispatcher-type" in full
    assert full[full.index("--mok-config") + 1] == "kimi-k2"
    assert full[full.index("--num-experts") + 1] == "384"
    assert full[full.index("--transformer-impl") + 1] == "transformer_engine"

    cfg = tmp_path / "small.yaml"
    small = _expand(tmp_path, MODEL="kimi-k2", SCALE="small", TE="0", GPUS_PER_NODE="1", MOK_CONFIG_PATH=str(cfg))
    assert "--multi-latent-attention" not in small and "--group-query-attention" in small
    assert small[small.index("--transformer-impl") + 1] == "local"
    for flag in ("--no-rope-fusion", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion"):
        assert flag in small
    assert small[small.index("--vocab-size") + 1] == "32768"
    assert small[small.index("--nproc-per-node") + 1] == "1"
    # Megatron 0.19 divides train_iters by eval_interval (no default): the script must set it
    assert int(small[small.index("--eval-interval") + 1]) > 0 and "--eval-interval" in full
    # the generated MoK config matches the small model (16 experts) and loads back
    from megatron_mok.config import load_config

    assert yaml.safe_load(cfg.read_text())["model"]["num_moe_experts"] == 16
    assert str(load_config(str(cfg)).model.num_moe_experts) == small[small.index("--num-experts") + 1]

    with pytest.raises(AssertionError):
        _expand(tmp_path, MODEL="qwen")  # unknown model: a clear error, exit 2
