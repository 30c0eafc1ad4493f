"""MXFP8 rows through the MoK library's quantiser (``csrc/mok/quant/mxfp8_quant.cuh``): the device code the
Blackwell (sm_100a) megakernel fuses into its pull and SwiGLU epilogue, run here as a unit kernel so the
recipe (``megatron_mok.mxfp8``) can be checked bit for bit on any GPU, the H200 included."""

from __future__ import annotations

import torch

from . import ops

_LAYOUTS = {"row": 0, "sm100": 1}


def quantize_mx_rows(x: torch.Tensor, scale_layout: str = "row") -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, H] bf16 on a CUDA device (unit inner stride, row stride a multiple of 8, 16-byte aligned)
    -> (e4m3 [M, H], UE8M0 exponents): ``[M, H / 32]`` for ``scale_layout="row"``, or the sm_100 MMA's
    scale-factor layout as a flat uint8 tensor of ``mxfp8.sm100_sf_bytes(M, H / 32)`` bytes (padding 0)
    for ``"sm100"``. Every argument is checked by the operator (ValueError naming the problem)."""
    if scale_layout not in _LAYOUTS:
        raise ValueError(f"scale_layout must be one of {sorted(_LAYOUTS)}, got {scale_layout!r}")
    ops.load()
    q, sf = torch.ops.mok.mxfp8_quantize_rows(x, _LAYOUTS[scale_layout])
    return q, sf
