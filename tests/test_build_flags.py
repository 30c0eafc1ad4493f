"""CPU: the kernel build's compile-time choices (megatron_mok/kernel/build.py) -- a bad value is a clear
error naming the variable, never a silent default, and each choice reaches nvcc (and so the cache key)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_mok.kernel import build


def test_fp8_kloop_default_and_choices(monkeypatch):
    monkeypatch.delenv("MOK_FP8_KLOOP", raising=False)
    assert build.fp8_kloop() == build.FP8_KLOOP_DEFAULT
    for k in build.FP8_KLOOP_CHOICES:
        monkeypatch.setenv("MOK_FP8_KLOOP", str(k))
        assert build.fp8_kloop() == k
        assert f"-DMOK_FP8_KLOOP={k}" in build.nvcc_flags(Path("/inc"), Path("/src"))


@pytest.mark.parametrize("bad", ["1", "3", "4", "two", "-2", "2.0"])
def test_fp8_kloop_rejects(monkeypatch, bad):
    monkeypatch.setenv("MOK_FP8_KLOOP", bad)
    with pytest.raises(build.BuildError, match=r"MOK_FP8_KLOOP must be one of 0, 2 .*got '" + bad.replace(".", r"\.")):
        build.fp8_kloop()


def test_fp8_kloop_source_agrees():
    """The source's static_assert admits exactly the choices build.py offers."""
    src = (build.source_dir() / "fp8_kloop.cuh").read_text()
    assert "static_assert(MOK_FP8_KLOOP == 0 || MOK_FP8_KLOOP == 2" in src
    assert build.FP8_KLOOP_CHOICES == (0, 2)
