"""CPU: the forward launcher's own refusals (csrc/mok/host/forward.cu: validate, via mok_forward_check), with the
library built here by nvcc and loaded without a GPU -- the launch-time knobs' errors name the knob and value."""

from __future__ import annotations

import ctypes

import pytest

pytestmark = pytest.mark.nvcc


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    from megatron_mok.kernel.host import build

    if build.find_nvcc() is None or build.cutlass_include() is None:
        pytest.skip("needs nvcc and the CUTLASS headers")
    return ctypes.CDLL(str(build.build_library()))


def _args(arrays, Ts: list[int] | None = None, **kw):
    """The launch struct of a small launch (L 4, H 256, F 128, top-2, 2 comm SMs) with the given fields; Ts: the
    ranks' token counts (default 300 each)."""
    from megatron_mok.kernel.host.library import _Args

    a = _Args()
    a.R, a.L, a.H, a.F, a.K = len(Ts) if Ts else 1, 4, 256, 128, 2
    a.comm_sms, a.ring_slots, a.minibatch, a.ctas_per_rank, a.rank = 2, 2, 128, 0, -1
    for k, v in kw.items():
        setattr(a, k, v)
    a.T = arrays.i64(Ts or [300] * a.R)
    return a


def _check(lib, **kw) -> str:
    """mok_forward_check's message for a small launch with the given fields ('' = accepted)."""
    from megatron_mok.kernel.host.cargs import LaunchArrays

    arrays = LaunchArrays()
    a = _args(arrays, **kw)
    buf = ctypes.create_string_buffer(512)
    rc = lib.mok_forward_check(ctypes.byref(a), buf, 512)
    msg = buf.value.decode()
    assert (rc == 0) == (msg == ""), (rc, msg)
    return msg


def test_plain_launch_is_accepted(lib):
    assert _check(lib) == ""
    assert _check(lib, comm_sms=3, ctas_per_rank=65) == ""  # odd splits are fine


def test_tuning_fields(lib):
    """The config's tuning reaches the launcher as struct fields (the sources read no environment); a value a
    caller of the library passes outside the range is refused by config-key name."""
    assert _check(lib, macrobatches=4) == ""
    assert _check(lib, macrobatches=0) == ""  # 0: no chunks (a zeroed struct)
    assert "kernel.macrobatches=4 needs EP 1" in _check(lib, macrobatches=4, Ts=[300, 300])
    assert "kernel.macrobatches must be an integer in [1, 64], got 65" in _check(lib, macrobatches=65)
    assert "row segments" in _check(lib, macrobatches=3, L=200)
    assert _check(lib, raster=-1) == "" and _check(lib, raster=64) == ""
    assert "kernel.tile_raster must be an integer in [0, 64] (or unset), got 65" in _check(lib, raster=65)
    assert "kernel.fast_silu must be 0 or 1, got 2" in _check(lib, fast_silu=2)


def _workspace(lib, Ts: list[int] | None = None, **kw) -> int:
    """mok_workspace_bytes of a two-rank launch (300 + 200 tokens unless Ts) with the given fields (-1: refused)."""
    from megatron_mok.kernel.host.cargs import LaunchArrays

    arrays = LaunchArrays()
    a = _args(arrays, Ts or [300, 200], **kw)
    lib.mok_workspace_bytes.restype = ctypes.c_longlong
    return int(lib.mok_workspace_bytes(ctypes.byref(a)))


def _kb(n: int) -> int:
    return -(-n // 1024) * 1024  # a workspace area: 1 KB-aligned


def test_fp8_source_copies(lib):
    """The FP8 forward quantises each token once at its source: an emulated launch sizes every token's e4m3 copy
    and scales into its workspace (500 tokens x 256 bytes + 500 x 2 scales) beside the two ranks' pointer
    tables; a per-rank FP8 launch keeps the copies in the ranks' symmetric regions (only the tables in its
    workspace) and is refused, by name, without them."""
    from megatron_mok.kernel.host.cargs import LaunchArrays

    assert _check(lib, fp8=1) == ""  # emulated launch
    msg = _check(lib, fp8=1, rank=0)  # per-rank launch without the copies
    assert "source-quantised copy" in msg and "fp8_sources=True" in msg, msg
    assert _workspace(lib, fp8=1, rank=0) == -1
    arrays = LaunchArrays()
    peers = {"xq": arrays.u64([1 << 20, 2 << 20]), "xs": arrays.u64([3 << 20, 4 << 20])}
    assert _check(lib, fp8=1, rank=0, **peers) == ""
    assert _check(lib, fp8=0, rank=0) == ""  # bf16 per-rank launches need no copy
    # 128 more tokens: their e4m3 copy rows and scales on top of whatever else grows with the routed rows
    grown = _workspace(lib, Ts=[300, 328], fp8=1) - _workspace(lib, fp8=1)
    copy_growth = _kb(628 * 256) - _kb(500 * 256) + _kb(628 * 2 * 4) - _kb(500 * 2 * 4)
    assert grown >= copy_growth > 0
