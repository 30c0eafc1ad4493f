"""MoK forward megakernel (BF16, Hopper sm_90a): Python entry points.

Importing this module is cheap and safe on CPU-only machines: torch is imported, nothing is built.
The CUDA library is JIT-compiled with nvcc on first use (see ``build.py``) and cached.

Contract (used by the dispatcher):
  is_available() -> bool                  CUDA torch + sm_90 device + library builds and loads; never raises
  unavailable_reason() -> str
  MokKernelError(RuntimeError)
  mok_forward_emulated(x, topk_idx, topk_weight, w1, w2, *, comm_sms, ring_slots, minibatch_tokens,
                       timeout_ms=10000.0, debug_stall=None)
      -> (out[r] [T_r, H] bf16, combine_buf[r] [T_r, K, H] bf16, tokens_per_expert[q] [L] int32)
"""

from __future__ import annotations

from .emulated import MOK_MAX_RANKS, MokKernelError, check_last_error, check_pending_errors, mok_forward_emulated

__all__ = [
    "MOK_MAX_RANKS",
    "MokKernelError",
    "build_library",
    "check_last_error",
    "check_pending_errors",
    "compile_only",
    "is_available",
    "mok_forward_emulated",
    "unavailable_reason",
]

_avail: bool | None = None
_reason: str = "not checked yet"


def build_library(verbose: bool = False, force: bool = False):
    from .build import build_library as _b

    return _b(verbose=verbose, force=force)


def compile_only(output=None, verbose: bool = False):
    from .build import compile_only as _c

    return _c(output=output, verbose=verbose)


def _probe() -> tuple[bool, str]:
    try:
        import torch
    except Exception as exc:  # pragma: no cover
        return False, f"torch import failed: {exc}"
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False)"
    try:
        major, minor = torch.cuda.get_device_capability()
    except Exception as exc:
        return False, f"cannot query the CUDA device: {exc}"
    if (major, minor) != (9, 0):
        return False, f"the MoK kernel needs an sm_90 (Hopper) GPU, found sm_{major}{minor}"
    try:
        from .emulated import load_library

        load_library()
    except Exception as exc:
        return False, f"building/loading the MoK CUDA library failed: {exc}"
    return True, "available"


def is_available() -> bool:
    global _avail, _reason
    if _avail is None:
        try:
            _avail, _reason = _probe()
        except Exception as exc:  # never raise
            _avail, _reason = False, f"unexpected error: {exc}"
    return _avail


def unavailable_reason() -> str:
    is_available()
    return "" if _avail else _reason
