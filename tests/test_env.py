"""CPU: megatron-mok reads at most eight environment variables, all through megatron_mok/env.py; the CUDA sources
read none. A new variable anywhere else fails here: settings belong in the YAML config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_mok import env

ROOT = Path(__file__).resolve().parents[1]
# reads of the environment: os.environ / os.getenv / getenv( in C
_PY_READ = re.compile(r"os\.environ|os\.getenv|getenv\(")
_C_READ = re.compile(r"\bgetenv\s*\(|\bsecure_getenv\s*\(|\benviron\b")


def test_at_most_eight_documented_variables():
    assert len(env.VARIABLES) <= 8, sorted(env.VARIABLES)
    assert set(env.VARIABLES) == {
        "MOK_BACKEND",
        "MOK_CONFIG",
        "MOK_CACHE_DIR",
        "MOK_NVCC",
        "CUDA_HOME",
        "MOK_CUTLASS_INCLUDE",
        "MOK_NVLINK_FABRIC",
        "MOK_DEBUG",
    }


def test_only_env_module_reads_the_environment():
    offenders = []
    for p in (ROOT / "megatron_mok").rglob("*.py"):
        if p.name == "env.py" and p.parent.name == "megatron_mok":
            continue
        if p.name == "testing.py":  # test helpers set the rendezvous address of spawned ranks, they read nothing
            text = "\n".join(ln for ln in p.read_text().splitlines() if "MASTER_" not in ln)
        else:
            text = p.read_text()
        if _PY_READ.search(text):
            offenders.append(str(p.relative_to(ROOT)))
    for p in (ROOT / "csrc").rglob("*"):
        if p.suffix in (".cu", ".cuh", ".h", ".cpp") and _C_READ.search(re.sub(r"//[^\n]*", "", p.read_text())):
            offenders.append(str(p.relative_to(ROOT)))
    assert not offenders, f"read the environment outside megatron_mok/env.py: {offenders}"


def test_every_variable_read_is_documented():
    text = (ROOT / "megatron_mok" / "env.py").read_text()
    read = set(re.findall(r'_get\("([A-Z_]+)"\)', text))
    assert read == set(env.VARIABLES), read ^ set(env.VARIABLES)


def test_debug_switch(monkeypatch):
    monkeypatch.delenv("MOK_DEBUG", raising=False)
    assert env.debug() == env.Debug()
    monkeypatch.setenv("MOK_DEBUG", "sync")
    assert env.debug() == env.Debug(sync=True)
    monkeypatch.setenv("MOK_DEBUG", "ablation=0x120, sync")
    assert env.debug() == env.Debug(sync=True, ablation=0x120)
    monkeypatch.setenv("MOK_DEBUG", "ablation")
    assert env.debug() == env.Debug(ablation=0)
    for bad, msg in (
        ("verbose", "unknown word 'verbose'"),
        ("ablation=x", "non-negative integer"),
        ("sync=1", "unknown"),
    ):
        monkeypatch.setenv("MOK_DEBUG", bad)
        with pytest.raises(env.MokEnvError, match=msg):
            env.debug()


def test_backend_choice(monkeypatch):
    monkeypatch.setenv("MOK_BACKEND", " Kernel ")
    assert env.backend() == "kernel"
    monkeypatch.setenv("MOK_BACKEND", "cuda")
    with pytest.raises(env.MokEnvError, match="MOK_BACKEND='cuda' is not one of auto, reference, kernel"):
        env.backend()
