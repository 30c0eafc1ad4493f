"""Host arrays of a launch's ctypes argument struct (device pointers, row strides, token counts)."""

from __future__ import annotations

import ctypes


class LaunchArrays:
    """Builds the ctypes arrays an argument struct points at and keeps them alive as long as this
    object (keep it until the launch call has returned: the library copies what it needs)."""

    def __init__(self) -> None:
        self._keep: list[ctypes.Array] = []

    def _array(self, ctype, vals) -> int:
        a = (ctype * max(1, len(vals)))(*vals)
        self._keep.append(a)
        return ctypes.addressof(a)  # the address for a c_void_p field (ctypes.cast costs ~2x more per launch)

    def u64(self, vals) -> int:
        """unsigned 64-bit values (device pointers)"""
        return self._array(ctypes.c_ulonglong, vals)

    def i64(self, vals) -> int:
        """signed 64-bit values (row strides, token counts)"""
        return self._array(ctypes.c_longlong, vals)
