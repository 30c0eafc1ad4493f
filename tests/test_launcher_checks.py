"""CPU: the forward launcher's own refusals (csrc/mok/mok_forward.cu: validate, via mok_forward_check), with the
library built here by nvcc and loaded without a GPU -- the launch-time knobs' errors name the knob and value."""

from __future__ import annotations

import ctypes

import pytest

pytestmark = pytest.mark.nvcc


def _built(src_quant: str) -> ctypes.CDLL:
    """The library built with MOK_FP8_SRC_QUANT=src_quant (a build of its own: the flag is in the cache key),
    whatever the environment says."""
    from megatron_mok.kernel import build

    if build.find_nvcc() is None or build.cutlass_include() is None:
        pytest.skip("needs nvcc and the CUTLASS headers")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOK_FP8_SRC_QUANT", src_quant)
        return ctypes.CDLL(str(build.build_library()))


@pytest.fixture(scope="module")
def lib():
    return _built("0")


def _args(arrays, Ts: list[int] | None = None, **kw):
    """The launch struct of a small launch (L 4, H 256, F 128, top-2, 2 comm SMs) with the given fields; Ts: the
    ranks' token counts (default 300 each)."""
    from megatron_mok.kernel.emulated import _Args

    a = _Args()
    a.R, a.L, a.H, a.F, a.K = len(Ts) if Ts else 1, 4, 256, 128, 2
    a.comm_sms, a.ring_slots, a.minibatch, a.ctas_per_rank, a.rank = 2, 2, 128, 0, -1
    for k, v in kw.items():
        setattr(a, k, v)
    a.T = arrays.i64(Ts or [300] * a.R)
    return a


def _check(lib, **kw) -> str:
    """mok_forward_check's message for a small launch with the given fields ('' = accepted)."""
    from megatron_mok.kernel.cargs import LaunchArrays

    arrays = LaunchArrays()
    a = _args(arrays, **kw)
    buf = ctypes.create_string_buffer(512)
    rc = lib.mok_forward_check(ctypes.byref(a), buf, 512)
    msg = buf.value.decode()
    assert (rc == 0) == (msg == ""), (rc, msg)
    return msg


def test_plain_launch_is_accepted(lib, monkeypatch):
    for var in ("MOK_CLUSTER", "MOK_MACROBATCHES"):
        monkeypatch.delenv(var, raising=False)
    assert _check(lib) == ""


@pytest.mark.parametrize("bad", ["0", "3", "two", "2x"])
def test_cluster_knob_values(lib, monkeypatch, bad):
    monkeypatch.setenv("MOK_CLUSTER", bad)
    assert _check(lib) == f"MOK_CLUSTER must be 1 or 2, got '{bad}'"


def test_cluster_needs_even_splits(lib, monkeypatch):
    monkeypatch.setenv("MOK_CLUSTER", "2")
    assert _check(lib) == ""
    assert _check(lib, ctas_per_rank=64) == ""
    assert "comm_sms=3 must be even" in _check(lib, comm_sms=3)
    assert "ctas_per_rank=65 must be even" in _check(lib, ctas_per_rank=65)
    monkeypatch.setenv("MOK_CLUSTER", "1")
    assert _check(lib, comm_sms=3, ctas_per_rank=65) == ""  # odd splits are fine without clusters


def test_token_chunk_knob(lib, monkeypatch):
    monkeypatch.delenv("MOK_CLUSTER", raising=False)
    monkeypatch.setenv("MOK_MACROBATCHES", "4")
    assert _check(lib) == ""
    assert "needs EP 1" in _check(lib, R=2)
    monkeypatch.setenv("MOK_MACROBATCHES", "65")
    assert "MOK_MACROBATCHES must be an integer in [1, 64], got '65'" in _check(lib)
    monkeypatch.setenv("MOK_MACROBATCHES", "3")
    assert "row segments" in _check(lib, L=200)


@pytest.fixture(scope="module")
def srcq_lib():
    return _built("1")


def _workspace(lib, **kw) -> int:
    """mok_workspace_bytes of a two-rank launch of 300 + 200 tokens with the given fields (-1: refused)."""
    from megatron_mok.kernel.cargs import LaunchArrays

    arrays = LaunchArrays()
    a = _args(arrays, [300, 200], **kw)
    lib.mok_workspace_bytes.restype = ctypes.c_longlong
    return int(lib.mok_workspace_bytes(ctypes.byref(a)))


def _kb(n: int) -> int:
    return -(-n // 1024) * 1024  # a workspace area: 1 KB-aligned


def test_fp8_source_quantisation_build(lib, srcq_lib, monkeypatch):
    """MOK_FP8_SRC_QUANT=1: the library says so; an emulated FP8 launch sizes every token's e4m3 copy and scales
    into its workspace (500 tokens x 256 bytes + 500 x 2 scales) beside the two ranks' pointer tables; a per-rank
    FP8 launch keeps the copies in the ranks' symmetric regions (only the tables in its workspace) and is refused,
    by name, without them."""
    from megatron_mok.kernel.cargs import LaunchArrays

    for var in ("MOK_CLUSTER", "MOK_MACROBATCHES"):
        monkeypatch.delenv(var, raising=False)
    assert lib.mok_fp8_src_quant_build() == 0 and srcq_lib.mok_fp8_src_quant_build() == 1
    tables = _kb(2 * 2 * 8)  # [R] e4m3 row pointers + [R] scale pointers
    copy = _kb(500 * 256) + _kb(500 * 2 * 4)
    assert _workspace(srcq_lib, fp8=1) - _workspace(lib, fp8=1) == tables + copy
    assert _workspace(srcq_lib, fp8=0) == _workspace(lib, fp8=0)  # the bf16 kernel has no copy
    assert _check(srcq_lib, fp8=1) == ""  # emulated launch
    msg = _check(srcq_lib, fp8=1, rank=0)  # per-rank launch without the copies
    assert "MOK_FP8_SRC_QUANT=1" in msg and "fp8_sources=True" in msg, msg
    assert _workspace(srcq_lib, fp8=1, rank=0) == -1
    arrays = LaunchArrays()
    peers = {"xq": arrays.u64([1 << 20, 2 << 20]), "xs": arrays.u64([3 << 20, 4 << 20])}
    assert _check(srcq_lib, fp8=1, rank=0, **peers) == ""
    assert _workspace(srcq_lib, fp8=1, rank=0, **peers) - _workspace(lib, fp8=1, rank=0) == tables
    assert _check(srcq_lib, fp8=0, rank=0) == ""  # bf16 per-rank launches need no copy
    assert _check(lib, fp8=1, rank=0) == ""
