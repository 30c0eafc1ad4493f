"""Host arrays of a launch's ctypes argument struct (device pointers, row strides, token counts)."""

from __future__ import annotations

import array
import math
from dataclasses import dataclass

from ... import env
from ...activation import Glu


class LaunchArrays:
    """Builds the host arrays an argument struct points at and keeps them alive as long as this object
    (keep it until the launch call has returned: the library copies what it needs).

    ``array.array`` rather than ctypes arrays: building ``(c_ulonglong * n)(*vals)`` costs ~5 us for 32
    values on the development host, ``array.array('Q', vals)`` ~1 us, and a launch with 32 local experts
    builds six such tables (host time per call counts whenever the GPU waits for the launch)."""

    def __init__(self) -> None:
        self._keep: list[array.array] = []

    def _array(self, typecode: str, vals) -> int:
        a = array.array(typecode, vals if len(vals) else (0,))
        self._keep.append(a)
        return a.buffer_info()[0]  # the address for a c_void_p field

    def u64(self, vals) -> int:
        """unsigned 64-bit values (device pointers)"""
        return self._array("Q", vals)

    def i64(self, vals) -> int:
        """signed 64-bit values (row strides, token counts)"""
        return self._array("q", vals)


def bind_glu(args, glu: Glu | None) -> None:
    """Set a forward or backward argument struct's SwiGLU variant (csrc/mok/gemm/swiglu.cuh) from ``glu``
    (None or the plain SwiGLU: glu 0, the kernels' plain code)."""
    if glu is None or glu.plain:
        args.glu, args.glu_clamp, args.glu_offset = 0, math.inf, 0.0
        return
    args.glu = 1
    args.glu_clamp = math.inf if glu.clamp is None else float(glu.clamp)
    args.glu_offset = float(glu.offset)


@dataclass(frozen=True)
class ForwardTuning:
    """The forward kernel's tuning (config keys ``kernel.tile_raster`` / ``macrobatches`` / ``fast_silu``): the
    GEMM ticket order (None: the kernel's measured default per dtype), token chunks (EP 1; same results) and,
    for FP8, the tanh.approx SiLU of the fc1 epilogue (moves a few e4m3 roundings)."""

    tile_raster: int | None = None
    macrobatches: int = 1
    fast_silu: bool = False

    def __post_init__(self) -> None:
        if self.tile_raster is not None and not (type(self.tile_raster) is int and 0 <= self.tile_raster <= 64):
            raise ValueError(f"kernel.tile_raster must be None or an integer in [0, 64], got {self.tile_raster!r}")
        if not (type(self.macrobatches) is int and 1 <= self.macrobatches <= 64):
            raise ValueError(f"kernel.macrobatches must be an integer in [1, 64], got {self.macrobatches!r}")
        if type(self.fast_silu) is not bool:
            raise ValueError(f"kernel.fast_silu must be True or False, got {self.fast_silu!r}")


def bind_tuning(args, tuning: ForwardTuning | None) -> None:
    """Set a forward argument struct's tuning fields, and the timing-ablation bits of ``MOK_DEBUG=ablation=BITS``
    (read by the ablation build only)."""
    t = tuning or ForwardTuning()
    args.raster = -1 if t.tile_raster is None else int(t.tile_raster)
    args.macrobatches = int(t.macrobatches)
    args.fast_silu = int(bool(t.fast_silu))
    args.debug = env.debug().ablation or 0
