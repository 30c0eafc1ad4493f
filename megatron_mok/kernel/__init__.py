"""MoK megakernels (BF16 and FP8 e4m3 with block scales, Hopper sm_90a) as PyTorch operators.

Importing this module is cheap and safe on CPU-only machines: the ``mok`` operators' schemas and fake
implementations are registered (``ops.py``), nothing is built. The CUDA implementations are built on first use
(``build.py``: nvcc for the kernels, the host compiler for the operators) or at install, and cached.

  is_available() -> bool       CUDA torch + an sm_90 device + the operators build and load; never raises
  unavailable_reason() -> str
  mok_forward (forward.py)     one rank's forward launch; EP 1 with ``PeerBuffers.local()``, EP > 1 over the
                               ranks' symmetric regions (``PeerBuffers.symmetric``; ``on_one_gpu`` in tests)
  mok_backward (backward.py)   one rank's backward launch, then the wgrad kernel
  KeptRows, Timeline, MokKernelError, check_pending_errors / check_last_error (errors.py)
  quant.py: FP8 expert weights (quantised once per optimizer step); gemm.py / mxfp8.py: unit kernels;
  sm100.py: the Blackwell MXFP8 grouped GEMM unit (runs only on sm_100)
"""

from __future__ import annotations

from . import ops
from .availability import KernelAvailability
from .backward import mok_backward
from .comm import PeerBuffers
from .errors import MokKernelError, check_last_error, check_pending_errors
from .forward import KeptRows, mok_forward
from .ops import MOK_MAX_RANKS
from .timeline import Timeline

__all__ = [
    "MOK_MAX_RANKS",
    "KeptRows",
    "MokKernelError",
    "PeerBuffers",
    "Timeline",
    "check_last_error",
    "check_pending_errors",
    "is_available",
    "mok_backward",
    "mok_forward",
    "unavailable_reason",
]

_AVAILABILITY = KernelAvailability("MoK kernel", ops.load)
is_available = _AVAILABILITY.is_available
unavailable_reason = _AVAILABILITY.unavailable_reason
