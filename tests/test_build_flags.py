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


def test_fp8_ordered_default_and_choices(monkeypatch):
    monkeypatch.delenv("MOK_FP8_ORDERED", raising=False)
    assert build.fp8_ordered() == build.FP8_ORDERED_DEFAULT == 0
    for k in (0, 1):
        monkeypatch.setenv("MOK_FP8_ORDERED", str(k))
        assert build.fp8_ordered() == k
        assert f"-DMOK_FP8_ORDERED={k}" in build.nvcc_flags(Path("/inc"), Path("/src"))


@pytest.mark.parametrize("bad", ["2", "yes", "01", "-1"])
def test_fp8_ordered_rejects(monkeypatch, bad):
    monkeypatch.setenv("MOK_FP8_ORDERED", bad)
    with pytest.raises(build.BuildError, match=r"MOK_FP8_ORDERED must be one of 0, 1 .*got '" + bad + "'"):
        build.fp8_ordered()


def test_fp8_src_quant_default_and_choices(monkeypatch):
    monkeypatch.delenv("MOK_FP8_SRC_QUANT", raising=False)
    assert build.fp8_src_quant() == build.FP8_SRC_QUANT_DEFAULT == 0
    for k in (0, 1):
        monkeypatch.setenv("MOK_FP8_SRC_QUANT", str(k))
        assert build.fp8_src_quant() == k
        assert f"-DMOK_FP8_SRC_QUANT={k}" in build.nvcc_flags(Path("/inc"), Path("/src"))


@pytest.mark.parametrize("bad", ["2", "on", "01", "-1"])
def test_fp8_src_quant_rejects(monkeypatch, bad):
    monkeypatch.setenv("MOK_FP8_SRC_QUANT", bad)
    with pytest.raises(build.BuildError, match=r"MOK_FP8_SRC_QUANT must be one of 0, 1 .*got '" + bad + "'"):
        build.fp8_src_quant()


def test_fp8_kloop_source_agrees():
    """The source's static_assert admits exactly the choices build.py offers."""
    src = (build.source_dir() / "fp8_kloop.cuh").read_text()
    assert "static_assert(MOK_FP8_KLOOP == 0 || MOK_FP8_KLOOP == 2" in src
    assert build.FP8_KLOOP_CHOICES == (0, 2)
    common = (build.source_dir() / "common.cuh").read_text()
    assert "static_assert(MOK_FP8_ORDERED == 0 || MOK_FP8_ORDERED == 1" in common
    assert build.FP8_ORDERED_CHOICES == (0, 1)
    assert "static_assert(MOK_FP8_SRC_QUANT == 0 || MOK_FP8_SRC_QUANT == 1" in common
    assert build.FP8_SRC_QUANT_CHOICES == (0, 1)
