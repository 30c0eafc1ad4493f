"""Blackwell (sm_100a) units of the MXFP8 path (``mok::sm100_mxfp8_grouped_gemm``, a library of its own).

``mxfp8_grouped_gemm``: every expert's D_g = A_g B_g^T from MXFP8 operands (e4m3 + UE8M0 per 1 x 32 along K,
scales in the sm_100 MMA layout that ``kernel.mxfp8.quantize_mx_rows(..., "sm100")`` writes), bf16 out
(``csrc/mok/sm100/mxfp8_grouped_gemm.cu``, CUTLASS's sm_100 block-scaled collective). It is compiled on
every CI run but runs only on a Blackwell GPU: elsewhere it raises :class:`MokKernelError` saying so.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import ops
from .errors import MokKernelError


def require_sm100(device: torch.device) -> None:
    major, minor = torch.cuda.get_device_capability(device)
    if major != 10:
        raise MokKernelError(
            f"the MXFP8 (kernel.dtype mxfp8) units need a Blackwell sm_100 GPU; {torch.cuda.get_device_name(device)} "
            f"is sm_{major}{minor} (Hopper runs kernel.dtype fp8)"
        )


def mxfp8_grouped_gemm(
    a: Sequence[torch.Tensor], sfa: Sequence[torch.Tensor], b: Sequence[torch.Tensor], sfb: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """a[g] e4m3 [M_g, K], b[g] e4m3 [N, K] (the expert weight), sfa / sfb their scales in the sm_100
    layout (uint8, ``mxfp8.sm100_sf_bytes`` bytes) -> bf16 [M_g, N] per expert. Every argument is checked by the
    operator (csrc/mok/apis/sm100.cpp)."""
    dev = b[0].device
    require_sm100(dev)
    N = b[0].shape[0]
    ops.load("sm100")
    out = [torch.empty((int(t.shape[0]), N), dtype=torch.bfloat16, device=dev) for t in a]
    torch.ops.mok.sm100_mxfp8_grouped_gemm(list(a), list(sfa), list(b), list(sfb), out)
    return out
