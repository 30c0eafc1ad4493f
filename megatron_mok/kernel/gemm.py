"""FP8 (e4m3) block-scaled grouped GEMM on Hopper: the unit kernel of the FP8 path.

``fp8_grouped_gemm`` runs ``csrc/mok/gemm/fp8_gemm.cuh`` (in the forward library): for each expert's rows
(segments back to back from row 0) ``out = x @ w_e^T`` from e4m3 operands with DeepSeek-V3 block scales
(1 x 128 for activations, 128 x 128 for weights), fp32 accumulation with per-K-block scale promotion,
bf16 output. ``megatron_mok.fp8.fp8_linear`` is its oracle. The row counts are host integers here (a
unit kernel and benchmark); the fused FP8 expert FFN will take them from the in-kernel schedule.
"""

from __future__ import annotations

import ctypes

import torch

from .forward import _lazy_checker
from .host.cargs import LaunchArrays
from .host.errors import MokKernelError, format_error
from .host.library import load_library

BLOCK = 128


class _Fp8Args(ctypes.Structure):
    _fields_ = [
        ("L", ctypes.c_int),
        ("N", ctypes.c_int),
        ("K", ctypes.c_int),
        ("device", ctypes.c_int),
        ("rows", ctypes.c_longlong),
        ("counts", ctypes.c_void_p),
        ("xq", ctypes.c_ulonglong),
        ("xs", ctypes.c_ulonglong),
        ("wq", ctypes.c_void_p),
        ("ws", ctypes.c_void_p),
        ("out", ctypes.c_ulonglong),
        ("workspace", ctypes.c_ulonglong),
        ("workspace_bytes", ctypes.c_ulonglong),
        ("err", ctypes.c_ulonglong),
        ("timeout_ms", ctypes.c_double),
    ]


def _lib() -> ctypes.CDLL:
    lib = load_library()
    if not getattr(lib, "_mok_fp8_bound", False):
        lib.mok_fp8_gemm_workspace_bytes.restype = ctypes.c_longlong
        lib.mok_fp8_gemm_workspace_bytes.argtypes = [ctypes.POINTER(_Fp8Args)]
        lib.mok_fp8_gemm_launch.restype = ctypes.c_int
        lib.mok_fp8_gemm_launch.argtypes = [ctypes.POINTER(_Fp8Args), ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        lib._mok_fp8_bound = True
    return lib


def _fail(msg: str) -> None:
    raise ValueError(f"fp8_grouped_gemm: {msg}")


def _error_message(err: list[int], R: int, L: int, timeout_ms: float) -> str:
    return format_error(err, R, L, timeout_ms, kernel="MoK fp8 GEMM", phases={6: "internal smem pipeline"})


def fp8_grouped_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: list[torch.Tensor],
    ws: list[torch.Tensor],
    counts: list[int],
    *,
    out: torch.Tensor | None = None,
    timeout_ms: float = 10000.0,
) -> torch.Tensor:
    """xq e4m3 [rows, K], xs fp32 [rows, K / 128]; per expert e: wq[e] e4m3 [N, K], ws[e] fp32
    [N / 128, K / 128]; counts[e] rows of expert e (segments from row 0, sum <= rows). Returns bf16
    [rows, N] (rows past the last expert are left as they were in ``out``)."""
    if not isinstance(xq, torch.Tensor) or xq.dtype != torch.float8_e4m3fn or xq.dim() != 2:
        _fail(f"xq must be a 2-D float8_e4m3fn tensor, got {getattr(xq, 'dtype', type(xq))}")
    rows, K = xq.shape
    device = xq.device
    if device.type != "cuda" or not xq.is_contiguous():
        _fail("xq must be a contiguous CUDA tensor")
    if K % BLOCK:
        _fail(f"K={K} must be a multiple of {BLOCK}")
    L = len(wq)
    if L < 1 or len(ws) != L or len(counts) != L:
        _fail(f"wq, ws and counts need one entry per expert (got {len(wq)}, {len(ws)}, {len(counts)})")
    if xs.dtype != torch.float32 or tuple(xs.shape) != (rows, K // BLOCK) or not xs.is_contiguous():
        _fail(f"xs must be contiguous float32 [{rows}, {K // BLOCK}], got {xs.dtype} {tuple(xs.shape)}")
    N = wq[0].shape[0] if wq[0].dim() == 2 else -1
    if N < BLOCK or N % BLOCK:
        _fail(f"weights must be [N, K] with N a positive multiple of {BLOCK}, got {tuple(wq[0].shape)}")
    for e in range(L):
        if wq[e].dtype != torch.float8_e4m3fn or tuple(wq[e].shape) != (N, K) or not wq[e].is_contiguous():
            _fail(f"wq[{e}] must be contiguous float8_e4m3fn [{N}, {K}], got {wq[e].dtype} {tuple(wq[e].shape)}")
        if ws[e].dtype != torch.float32 or tuple(ws[e].shape) != (N // BLOCK, K // BLOCK) or not ws[e].is_contiguous():
            _fail(f"ws[{e}] must be contiguous float32 [{N // BLOCK}, {K // BLOCK}], got {tuple(ws[e].shape)}")
        if wq[e].device != device or ws[e].device != device or xs.device != device:
            _fail(f"expert {e}: every tensor must be on {device}")
    if any(int(c) < 0 for c in counts) or sum(int(c) for c in counts) > rows:
        _fail(f"counts {list(counts)} must be >= 0 and sum to at most {rows} rows")
    if out is None:
        out = torch.empty((rows, N), dtype=torch.bfloat16, device=device)
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != (rows, N) or not out.is_contiguous():
        _fail(f"out must be contiguous bf16 [{rows}, {N}]")

    lib = _lib()
    arrays = LaunchArrays()  # host arrays the struct points at, alive until the launch returned
    arr, arr_i64 = arrays.u64, arrays.i64

    a = _Fp8Args()
    a.L, a.N, a.K = L, N, K
    a.device = device.index if device.index is not None else torch.cuda.current_device()
    a.rows = rows
    a.counts = arr_i64([int(c) for c in counts])
    a.xq, a.xs, a.out = xq.data_ptr(), xs.data_ptr(), out.data_ptr()
    a.wq = arr([t.data_ptr() for t in wq])
    a.ws = arr([t.data_ptr() for t in ws])
    a.timeout_ms = float(timeout_ms)
    nbytes = lib.mok_fp8_gemm_workspace_bytes(ctypes.byref(a))
    if nbytes < 0:
        _fail("sizes rejected by the library")
    wsbuf = torch.empty((nbytes + 256,), dtype=torch.uint8, device=device)  # per call: stream-ordered reuse
    a.workspace = (wsbuf.data_ptr() + 255) // 256 * 256
    a.workspace_bytes = nbytes
    err = torch.zeros((16,), dtype=torch.int32, device=device)
    a.err = err.data_ptr()
    ebuf = ctypes.create_string_buffer(1024)
    stream = torch.cuda.current_stream(device)
    if lib.mok_fp8_gemm_launch(ctypes.byref(a), ctypes.c_void_p(stream.cuda_stream), ebuf, 1024) != 0:
        raise MokKernelError(f"MoK fp8 GEMM launch failed: {ebuf.value.decode(errors='replace')}")
    # its error record (an internal pipeline stall) is read without a host sync, like the other kernels'
    _lazy_checker(a.device).after_launch(err, stream, R=1, L=L, timeout_ms=timeout_ms, fmt=_error_message)
    return out
