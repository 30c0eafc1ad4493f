"""MoK megakernels (BF16 and FP8 e4m3 with block scales, Hopper sm_90a): Python entry points.

Importing this module is cheap and safe on CPU-only machines: torch is imported, nothing is built.
The CUDA library is JIT-compiled with nvcc on first use (see ``host/build.py``) and cached.

Contract (used by the dispatcher):
  is_available() -> bool                  CUDA torch + sm_90 device + library builds and loads; never raises
  unavailable_reason() -> str
  MokKernelError(RuntimeError)
  mok_forward_emulated(x, topk_idx, topk_weight, w1, w2, *, comm_sms, ring_slots, minibatch_tokens,
                       timeout_ms=10000.0, debug_stall=None, saved_h=None, fp8=None)
      -> (out[r] [T_r, H] bf16, combine_buf[r] [T_r, K, H] bf16, tokens_per_expert[q] [L] int32)
      fp8=Fp8ExpertWeights (quant.py: quantize_expert_weights / Fp8WeightCache) runs the FP8 kernel;
      comm_sms=0: no comm SM, spare producer warps of every SM pull the rows (the in-SM pull)
  PeerBuffers / mok_forward_rank (comm.py): per-rank launches, real EP over torch symmetric memory
  backward.py: mok_backward_emulated / mok_backward_rank (the backward kernel, same launch shapes);
      imported on demand (``from megatron_mok.kernel.backward import ...``), it has its own library
  Timeline (timeline.py): optional in-kernel per-SM timeline of a forward or backward launch
  mxfp8.py: the MXFP8 quantiser of the Blackwell path as a unit (runs on any GPU); sm100.py: the sm_100a
      MXFP8 grouped expert GEMM unit (Blackwell only)
"""

from __future__ import annotations

from .comm import PeerBuffers, mok_forward_rank
from .forward import MOK_MAX_RANKS, KeptRows, check_last_error, check_pending_errors, mok_forward_emulated
from .host.availability import KernelAvailability
from .host.errors import MokKernelError
from .timeline import Timeline

__all__ = [
    "MOK_MAX_RANKS",
    "KeptRows",
    "MokKernelError",
    "PeerBuffers",
    "Timeline",
    "build_library",
    "check_last_error",
    "check_pending_errors",
    "compile_only",
    "is_available",
    "mok_forward_emulated",
    "mok_forward_rank",
    "unavailable_reason",
]


def build_library(verbose: bool = False, force: bool = False):
    from .host.build import build_library as _b

    return _b(verbose=verbose, force=force)


def compile_only(output=None, verbose: bool = False):
    from .host.build import compile_only as _c

    return _c(output=output, verbose=verbose)


def _load_library():
    from .host.library import load_library

    return load_library()


_AVAILABILITY = KernelAvailability("MoK kernel", _load_library)
is_available = _AVAILABILITY.is_available
unavailable_reason = _AVAILABILITY.unavailable_reason
