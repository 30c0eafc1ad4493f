"""CPU: the kernel build's compile-time choices (megatron_mok/kernel/build.py) -- a bad value is a clear
error naming the variable, never a silent default, and each choice reaches nvcc (and so the cache key)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_mok.kernel import build

# (variable, its reader, the default it must give, the module constant holding it, the accepted values,
# values it must refuse)
SWITCHES = [
    (
        "MOK_FP8_KLOOP",
        build.fp8_kloop,
        build.FP8_KLOOP_DEFAULT,
        build.FP8_KLOOP_DEFAULT,
        build.FP8_KLOOP_CHOICES,
        ["1", "3", "4", "two", "-2", "2.0"],
    ),
    ("MOK_FP8_ORDERED", build.fp8_ordered, 0, build.FP8_ORDERED_DEFAULT, (0, 1), ["2", "yes", "01", "-1"]),
    ("MOK_FP8_SRC_QUANT", build.fp8_src_quant, 1, build.FP8_SRC_QUANT_DEFAULT, (0, 1), ["2", "on", "01", "-1"]),
    (
        "MOK_FP8_SCALE_KMAJOR",
        build.fp8_scale_kmajor,
        1,
        build.FP8_SCALE_KMAJOR_DEFAULT,
        (0, 1),
        ["2", "t", "1.0", "-1", "01"],
    ),
]


@pytest.mark.parametrize("var,read,default,const,choices,_bad", SWITCHES, ids=[s[0] for s in SWITCHES])
def test_switch_default_and_choices(monkeypatch, var, read, default, const, choices, _bad):
    monkeypatch.delenv(var, raising=False)
    assert read() == default == const
    for k in choices:
        monkeypatch.setenv(var, str(k))
        assert read() == k
        assert f"-D{var}={k}" in build.nvcc_flags(Path("/inc"), Path("/src"))


@pytest.mark.parametrize(
    "var,read,choices,bad",
    [(s[0], s[1], s[4], bad) for s in SWITCHES for bad in s[5]],
    ids=[f"{s[0]}={bad}" for s in SWITCHES for bad in s[5]],
)
def test_switch_rejects(monkeypatch, var, read, choices, bad):
    monkeypatch.setenv(var, bad)
    with pytest.raises(
        build.BuildError, match=rf"{var} must be one of {', '.join(map(str, choices))} .*got '" + re.escape(bad) + "'"
    ):
        read()


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
    assert "static_assert(MOK_FP8_SCALE_KMAJOR == 0 || MOK_FP8_SCALE_KMAJOR == 1" in common
    assert build.FP8_SCALE_KMAJOR_CHOICES == (0, 1)
