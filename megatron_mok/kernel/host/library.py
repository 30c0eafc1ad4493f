"""The forward library's C ABI (the launch struct, mirrored field for field from csrc/mok/host/forward.cu:
MokLaunchArgs) and its loading: built on first use (build.py), loaded once per process."""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


class _Args(ctypes.Structure):
    _fields_ = [
        ("R", ctypes.c_int),
        ("L", ctypes.c_int),
        ("H", ctypes.c_int),
        ("F", ctypes.c_int),
        ("K", ctypes.c_int),
        ("comm_sms", ctypes.c_int),
        ("ring_slots", ctypes.c_int),
        ("minibatch", ctypes.c_int),
        ("ctas_per_rank", ctypes.c_int),
        ("stall_rank", ctypes.c_int),
        ("stall_slot", ctypes.c_int),
        ("device", ctypes.c_int),
        ("timeout_ms", ctypes.c_double),
        ("T", ctypes.c_void_p),
        ("x", ctypes.c_void_p),
        ("idx", ctypes.c_void_p),
        ("w", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("combine", ctypes.c_void_p),
        ("tpe", ctypes.c_void_p),
        ("w1", ctypes.c_void_p),
        ("w1_ld", ctypes.c_void_p),
        ("w2", ctypes.c_void_p),
        ("w2_ld", ctypes.c_void_p),
        ("workspace", ctypes.c_ulonglong),
        ("workspace_bytes", ctypes.c_ulonglong),
        ("err", ctypes.c_ulonglong),
        # per-rank launch only (mok_forward_rank_launch; see comm.py)
        ("rank", ctypes.c_int),
        ("epoch", ctypes.c_uint),
        ("signal", ctypes.c_void_p),
        # optional in-kernel timeline (see Timeline)
        ("timeline", ctypes.c_ulonglong),
        ("timeline_count", ctypes.c_ulonglong),
        ("timeline_cap", ctypes.c_int),
        # optional: owners' fc1-output buffers kept for the backward (see mok_forward_emulated)
        ("saved_h", ctypes.c_void_p),
        ("saved_h_rows", ctypes.c_longlong),
        # FP8 kernel (kernel.dtype fp8): w1 / w2 then point at e4m3 weights, w1s / w2s at their scales
        ("fp8", ctypes.c_int),
        ("w1s", ctypes.c_void_p),
        ("w2s", ctypes.c_void_p),
        # optional kept expert input / SwiGLU output rows (KeptRows), bf16 only
        ("keep_x", ctypes.c_ulonglong),
        ("keep_act", ctypes.c_ulonglong),
        ("keep_rows", ctypes.c_longlong),
        # FP8 per-rank launch: every rank's source-quantised copy (comm.py)
        ("xq", ctypes.c_void_p),
        ("xs", ctypes.c_void_p),
        # the SwiGLU variant (clamp / offset; cargs.bind_glu)
        ("glu", ctypes.c_int),
        ("glu_clamp", ctypes.c_float),
        ("glu_offset", ctypes.c_float),
        # tuning (config kernel.tile_raster / macrobatches / fast_silu; cargs.bind_tuning) and the ablation bits
        ("raster", ctypes.c_int),
        ("macrobatches", ctypes.c_int),
        ("fast_silu", ctypes.c_int),
        ("debug", ctypes.c_int),
    ]


def load_library(path: Path | None = None) -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        if path is None:
            from .build import build_library

            path = build_library()
        lib = ctypes.CDLL(str(path))
        lib.mok_workspace_bytes.restype = ctypes.c_longlong
        lib.mok_workspace_bytes.argtypes = [ctypes.POINTER(_Args)]
        lib.mok_forward_check.restype = ctypes.c_int
        lib.mok_forward_check.argtypes = [ctypes.POINTER(_Args), ctypes.c_char_p, ctypes.c_int]
        for fn in (lib.mok_forward_emulated_launch, lib.mok_forward_rank_launch):
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.POINTER(_Args), ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        lib.mok_device_info.restype = ctypes.c_int
        lib.mok_device_info.argtypes = [ctypes.c_int] + [ctypes.POINTER(ctypes.c_int)] * 3
        lib.mok_version.restype = ctypes.c_char_p
        _lib = lib
        return lib
