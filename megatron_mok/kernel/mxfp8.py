"""MXFP8 rows through the MoK library's quantiser (``csrc/mok/quant/mxfp8_quant.cuh``): the device code the
Blackwell (sm_100a) megakernel fuses into its pull and SwiGLU epilogue, run here as a unit kernel so the
recipe (``megatron_mok.mxfp8``) can be checked bit for bit on any GPU, the H200 included."""

from __future__ import annotations

import ctypes

import torch

from .. import mxfp8

_LAYOUTS = {"row": 0, "sm100": 1}


def quantize_mx_rows(x: torch.Tensor, scale_layout: str = "row") -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, H] bf16 on a CUDA device (unit inner stride, row stride a multiple of 8, 16-byte aligned)
    -> (e4m3 [M, H], UE8M0 exponents): ``[M, H / 32]`` for ``scale_layout="row"``, or the sm_100 MMA's
    scale-factor layout as a flat uint8 tensor of ``mxfp8.sm100_sf_bytes(M, H / 32)`` bytes (padding 0)
    for ``"sm100"``. Raises ValueError naming the problem for any other input."""
    from .host.errors import MokKernelError
    from .host.library import load_library

    if scale_layout not in _LAYOUTS:
        raise ValueError(f"scale_layout must be one of {sorted(_LAYOUTS)}, got {scale_layout!r}")
    if not (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2):
        raise ValueError(f"mxfp8 rows must be a 2-D CUDA bfloat16 tensor, got {x.dtype} {tuple(x.shape)} on {x.device}")
    M, H = x.shape
    if H % mxfp8.MX_BLOCK or H == 0:
        raise ValueError(f"mxfp8 rows: H={H} must be a positive multiple of {mxfp8.MX_BLOCK}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError(
            f"mxfp8 rows need unit inner stride, a row stride multiple of 8, 16-byte alignment ({x.stride()})"
        )
    lib = load_library()
    if not getattr(lib, "_mok_mxq_bound", False):
        lib.mok_mxfp8_quantize_rows.restype = ctypes.c_int
        lib.mok_mxfp8_quantize_rows.argtypes = [
            ctypes.c_ulonglong, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_ulonglong,
            ctypes.c_ulonglong, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p,
            ctypes.c_int,
        ]  # fmt: skip
        lib._mok_mxq_bound = True
    nkb = H // mxfp8.MX_BLOCK
    q = torch.empty((M, H), dtype=torch.float8_e4m3fn, device=x.device)
    if scale_layout == "row":
        sf = torch.empty((M, nkb), dtype=torch.uint8, device=x.device)
    else:
        sf = torch.zeros(mxfp8.sm100_sf_bytes(M, nkb), dtype=torch.uint8, device=x.device)
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    ebuf = ctypes.create_string_buffer(512)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    with torch.cuda.device(x.device):
        rc = lib.mok_mxfp8_quantize_rows(
            x.data_ptr(), x.stride(0), M, H, q.data_ptr(), sf.data_ptr(), sf.numel(), _LAYOUTS[scale_layout], dev,
            ctypes.c_void_p(stream), ebuf, 512,
        )  # fmt: skip
    if rc != 0:
        raise MokKernelError(f"MoK mxfp8 quantisation failed: {ebuf.value.decode(errors='replace')}")
    return q, sf
