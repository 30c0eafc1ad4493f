"""Host arrays of a launch's ctypes argument struct (device pointers, row strides, token counts)."""

from __future__ import annotations

import array
import math

from ..activation import Glu


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
    """Set a forward or backward argument struct's SwiGLU variant (csrc/mok/swiglu.cuh) from ``glu``
    (None or the plain SwiGLU: glu 0, the kernels' plain code)."""
    if glu is None or glu.plain:
        args.glu, args.glu_clamp, args.glu_offset = 0, math.inf, 0.0
        return
    args.glu = 1
    args.glu_clamp = math.inf if glu.clamp is None else float(glu.clamp)
    args.glu_offset = float(glu.offset)
