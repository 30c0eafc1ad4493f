"""Blackwell (sm_100a) units of the MXFP8 path, through ctypes like the rest of the library.

``mxfp8_grouped_gemm``: every expert's D_g = A_g B_g^T from MXFP8 operands (e4m3 + UE8M0 per 1 x 32 along K,
scales in the sm_100 MMA layout that ``kernel.mxfp8.quantize_mx_rows(..., "sm100")`` writes), bf16 out
(``csrc/mok/sm100/mxfp8_grouped_gemm.cu``, CUTLASS's sm_100 block-scaled collective). It is compiled on
every CI run but runs only on a Blackwell GPU: elsewhere it raises :class:`MokKernelError` saying so.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from .. import mxfp8
from .host.errors import MokKernelError

_lib = None


def _load():
    global _lib
    if _lib is None:
        from .host.build import build_sm100_library

        lib = ctypes.CDLL(str(build_sm100_library()))
        lib.mok_sm100_mxfp8_gemm_workspace_bytes.restype = ctypes.c_longlong
        lib.mok_sm100_mxfp8_gemm_workspace_bytes.argtypes = [
            ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ]  # fmt: skip
        lib.mok_sm100_mxfp8_grouped_gemm.restype = ctypes.c_int
        lib.mok_sm100_mxfp8_grouped_gemm.argtypes = [
            ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int,
            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p), ctypes.c_longlong, ctypes.c_void_p,
            ctypes.c_ulonglong, ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int,
        ]  # fmt: skip
        _lib = lib
    return _lib


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
    layout (uint8, ``mxfp8.sm100_sf_bytes`` bytes) -> bf16 [M_g, N] per expert."""
    G = len(a)
    if not (G and len(sfa) == len(b) == len(sfb) == G):
        raise ValueError(f"mxfp8_grouped_gemm: {G} / {len(sfa)} / {len(b)} / {len(sfb)} a / sfa / b / sfb tensors")
    dev = a[0].device
    require_sm100(dev)
    N, K = b[0].shape
    for g in range(G):
        for name, t, shape in (("a", a[g], (a[g].shape[0], K)), ("b", b[g], (N, K))):
            if t.dtype != torch.float8_e4m3fn or tuple(t.shape) != shape or not t.is_contiguous() or t.device != dev:
                raise ValueError(f"mxfp8_grouped_gemm: {name}[{g}] must be contiguous e4m3 {shape} on {dev}, got "
                                 f"{t.dtype} {tuple(t.shape)}")  # fmt: skip
        for name, t, rows in (("sfa", sfa[g], a[g].shape[0]), ("sfb", sfb[g], N)):
            need = mxfp8.sm100_sf_bytes(rows, K // mxfp8.MX_BLOCK)
            if t.dtype != torch.uint8 or t.numel() < need or t.device != dev:
                raise ValueError(f"mxfp8_grouped_gemm: {name}[{g}] must hold {need} uint8 scales on {dev}")
    lib = _load()
    M = (ctypes.c_int * G)(*[int(t.shape[0]) for t in a])
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    ws_bytes = lib.mok_sm100_mxfp8_gemm_workspace_bytes(G, M, N, K, index)
    if ws_bytes < 0:
        raise ValueError(f"mxfp8_grouped_gemm: unsupported shapes (N={N}, K={K}: K a multiple of 128, N of 16)")
    out = [torch.empty((int(t.shape[0]), N), dtype=torch.bfloat16, device=dev) for t in a]
    ws = torch.empty(max(int(ws_bytes), 1), dtype=torch.uint8, device=dev)
    ptrs = lambda ts: (ctypes.c_void_p * G)(*[t.data_ptr() for t in ts])  # noqa: E731
    ebuf = ctypes.create_string_buffer(512)
    with torch.cuda.device(dev):
        rc = lib.mok_sm100_mxfp8_grouped_gemm(
            G, M, N, K, ptrs(a), ptrs(b), ptrs(sfa), ptrs(sfb), ptrs(out), N, ws.data_ptr(), ws.numel(), index,
            ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream), ebuf, 512,
        )  # fmt: skip
    if rc != 0:
        raise MokKernelError(f"MoK sm_100 MXFP8 grouped GEMM failed: {ebuf.value.decode(errors='replace')}")
    return out
