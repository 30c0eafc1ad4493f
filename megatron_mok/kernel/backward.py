"""MoK backward megakernel (BF16, Hopper sm_90a): build, ctypes binding and the emulated-EP entry point.

What runs where:

* ONE persistent cooperative kernel launch (``csrc/mok/host/backward.cu``) does, for R emulated ranks:
  the schedule (the forward's layout, recomputed from the routing), the pull reverse-combine
  (x rows and ``w * grad_out`` rows pulled from the home ranks into layout order), the dgrad GEMMs
  (stage 1: fc1 recompute + fc2 dgrad + SwiGLU backward -> dH, act; stage 2: dX = dH @ W1) with WGMMA
  + TMA, the push reverse-dispatch of dX rows into the home ranks' ``grad_buf[t, k]``, the top-k sum
  ``grad_x[t] = sum_k grad_buf[t, k]`` and (fused) the router-weight gradient
  ``grad_w[t, k] = <grad_out[t], combine_buf[t, k]>``.
* The expert weight gradients run right after, on the same stream, from the layout-order buffers the
  kernel leaves (``gy``, ``act``, ``dH``, ``x``) and its per-expert row counts:
  ``wgrad="kernel"`` (default) our persistent WGMMA wgrad kernel (``csrc/mok/backward/wgrad.cuh``: fp32
  accumulation and output, added straight into ``main_grad`` when given; no host sync, no transposes);
  ``wgrad="mm"`` one cuBLAS ``torch.mm(..., out_dtype=float32)`` per expert (one host sync for the
  expert offsets); ``wgrad="grouped"`` one ``torch._grouped_mm`` per weight (bf16-rounded output);
  ``wgrad="none"`` skips them.
* The dgrad kernel reads W1 and W2 as stored; only the recompute path's stage 1 reads a W2^T copy
  materialised once per call (``.t().contiguous()``).
"""

from __future__ import annotations

import ctypes
import hashlib
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ..activation import Glu
from .forward import _lazy_checker, capture_check, launch_workspace, refuse_capture
from .host import build as _build
from .host.availability import KernelAvailability
from .host.cargs import LaunchArrays, bind_glu
from .host.errors import MokKernelError, format_error, raise_recorded_error
from .host.weight_memo import dense_weights_ok

LIB_NAME = "libmok_backward"
MAIN_SOURCE = "host/backward.cu"
MOK_MAX_RANKS = 72
MOK_MAX_LOCAL_EXPERTS = 512
MOK_MAX_SLOTS = 64
WGRAD_MODES = ("kernel", "mm", "grouped", "none")

_PHASES = {
    1: "grid barrier (schedule)",
    2: "pull-ready (dgrad stage 1 waits for the pulled x / grad_out rows of its minibatch)",
    3: "slot-free (pull waits for the reverse-dispatch of the slot's previous minibatch)",
    4: "stage-1-done (dX tile waits for dH of its row block)",
    5: "compute-done (grad_x sum waits for all ranks' reverse-dispatch pushes)",
    6: "internal smem pipeline",
    7: "schedule",
    8: "peer start signal (a peer rank has not launched this call)",
    9: "peer compute-done signal (a peer rank has not pushed all its input-row gradients)",
    10: "peer token count",
    11: "wgrad (per-expert row counts do not fit the layout buffers: the dgrad launch did not finish)",
}


# ---------------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------------
def _sources(src: Path) -> list[Path]:
    return _build.library_sources(src)


def _check_tools() -> tuple[str, Path, Path]:
    nvcc = _build.find_nvcc()
    if nvcc is None:
        raise _build.BuildError("nvcc not found (set MOK_NVCC or CUDA_HOME)")
    inc = _build.cutlass_include()
    if inc is None:
        raise _build.BuildError("CUTLASS/CuTe headers not found: pip install --no-deps nvidia-cutlass==4.2.0.0")
    src = _build.source_dir()
    if not (src / MAIN_SOURCE).is_file() or not (src / "backward").is_dir():
        raise _build.BuildError(f"MoK backward sources not found under {src}")
    return nvcc, inc, src


def compile_only(output: Path | None = None, verbose: bool = False) -> Path:
    """Compile the backward kernel for sm_90a into a cubin (no GPU needed). Returns the cubin path."""
    nvcc, inc, src = _check_tools()
    out = Path(output) if output else Path(tempfile.mkdtemp(prefix="mok_bwd_cc_")) / f"{LIB_NAME}.cubin"
    cmd = [nvcc, *_build.nvcc_flags(inc, src), "-cubin", "-Xptxas", "-v", "-o", str(out), str(src / MAIN_SOURCE)]
    _build._run(cmd, verbose)
    return out


def build_library(verbose: bool = False, force: bool = False) -> Path:
    nvcc, inc, src = _check_tools()
    flags = _build.nvcc_flags(inc, src) + ["-shared", "-Xptxas", "-v"]
    h = hashlib.sha256()
    for f in _sources(src):
        h.update(str(f.relative_to(src)).encode())
        h.update(f.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(_build._nvcc_version(nvcc).encode())
    return _build.cached_library(LIB_NAME, h.hexdigest()[:20], nvcc, flags, src / MAIN_SOURCE, verbose, force)


# ---------------------------------------------------------------------------------------------------
# ctypes binding
# ---------------------------------------------------------------------------------------------------
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
        ("cap", ctypes.c_longlong),
        ("T", ctypes.c_void_p),
        ("x", ctypes.c_void_p),
        ("idx", ctypes.c_void_p),
        ("w", ctypes.c_void_p),
        ("grad_out", ctypes.c_void_p),
        ("combine", ctypes.c_void_p),
        ("grad_buf", ctypes.c_void_p),
        ("grad_x", ctypes.c_void_p),
        ("grad_w", ctypes.c_void_p),
        ("tpe", ctypes.c_void_p),
        ("xl", ctypes.c_void_p),
        ("gyl", ctypes.c_void_p),
        ("dh", ctypes.c_void_p),
        ("act", ctypes.c_void_p),
        ("w1", ctypes.c_void_p),
        ("w1_ld", ctypes.c_void_p),
        ("w2", ctypes.c_void_p),
        ("w2_ld", ctypes.c_void_p),
        ("w2t", ctypes.c_void_p),
        ("workspace", ctypes.c_ulonglong),
        ("workspace_bytes", ctypes.c_ulonglong),
        ("err", ctypes.c_ulonglong),
        ("saved_h", ctypes.c_void_p),
        # optional in-kernel timeline (megatron_mok.kernel.timeline.Timeline)
        ("timeline", ctypes.c_ulonglong),
        ("timeline_count", ctypes.c_ulonglong),
        ("timeline_cap", ctypes.c_int),
        # per-rank launch (mok_backward_rank) only
        ("rank", ctypes.c_int),
        ("epoch", ctypes.c_uint),
        ("signal", ctypes.c_void_p),
        # FP8 dgrad (kernel.dtype fp8): transposed e4m3 weights + scales per expert, e4m3 gy / dH per rank
        ("fp8", ctypes.c_int),
        ("w2t8", ctypes.c_void_p),
        ("w2ts", ctypes.c_void_p),
        ("w1t8", ctypes.c_void_p),
        ("w1ts", ctypes.c_void_p),
        ("gyl8", ctypes.c_void_p),
        ("gys", ctypes.c_void_p),
        ("dh8", ctypes.c_void_p),
        ("dhs", ctypes.c_void_p),
        # 1: the wgrad launch that follows does the router grad and the grad_x sum (HomeReductions)
        ("defer_home", ctypes.c_int),
        # 1: xl / act are the forward's kept rows (KeptRows): pull grad_out only, no act rows from h
        ("x_kept", ctypes.c_int),
        ("act_kept", ctypes.c_int),
        # the SwiGLU variant (clamp / offset; cargs.bind_glu)
        ("glu", ctypes.c_int),
        ("glu_clamp", ctypes.c_float),
        ("glu_offset", ctypes.c_float),
    ]


class _WgradArgs(ctypes.Structure):
    _fields_ = [
        ("np", ctypes.c_int),
        ("L", ctypes.c_int),
        ("H", ctypes.c_int),
        ("F", ctypes.c_int),
        ("rank0", ctypes.c_int),
        ("device", ctypes.c_int),
        ("accumulate", ctypes.c_int),
        ("timeout_ms", ctypes.c_double),
        ("cap", ctypes.c_longlong),
        ("tpe", ctypes.c_void_p),
        ("xl", ctypes.c_void_p),
        ("gyl", ctypes.c_void_p),
        ("dh", ctypes.c_void_p),
        ("act", ctypes.c_void_p),
        ("gw1", ctypes.c_void_p),
        ("gw1_ld", ctypes.c_void_p),
        ("gw2", ctypes.c_void_p),
        ("gw2_ld", ctypes.c_void_p),
        ("workspace", ctypes.c_ulonglong),
        ("workspace_bytes", ctypes.c_ulonglong),
        ("err", ctypes.c_ulonglong),
        # home-side reductions of a dgrad launch made with defer_home (HomeReductions)
        ("K", ctypes.c_int),
        ("home_parts", ctypes.c_int),
        ("h_T", ctypes.c_void_p),
        ("h_grad_out", ctypes.c_void_p),
        ("h_combine", ctypes.c_void_p),
        ("h_grad_buf", ctypes.c_void_p),
        ("h_idx", ctypes.c_void_p),
        ("h_grad_w", ctypes.c_void_p),
        ("h_grad_x", ctypes.c_void_p),
    ]


@dataclass
class HomeReductions:
    """The router-weight gradient and the grad_x top-k sum of home ranks, left by a dgrad launch with
    ``defer_home`` to the wgrad launch that follows (csrc/mok/backward/home_reduce.cuh). Per home rank:
    grad_out [T, H], combine [T, K, H], grad_buf [T, K, H] bf16, idx [T, K] int32; outputs grad_w [T, K]
    fp32 and grad_x [T, H] bf16 (device pointers only: every tensor is checked by the dgrad entry point)."""

    grad_out: list[torch.Tensor]
    combine: list[torch.Tensor]
    grad_buf: list[torch.Tensor]
    idx: list[torch.Tensor]
    grad_w: list[torch.Tensor]
    grad_x: list[torch.Tensor]
    K: int


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_ws_cache: dict[int, torch.Tensor] = {}
_err_cache: dict[int, torch.Tensor] = {}


def load_library(path: Path | None = None) -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        lib = ctypes.CDLL(str(path or build_library()))
        lib.mok_bwd_workspace_bytes.restype = ctypes.c_longlong
        lib.mok_bwd_workspace_bytes.argtypes = [ctypes.POINTER(_Args)]
        lib.mok_bwd_emulated_launch.restype = ctypes.c_int
        lib.mok_bwd_emulated_launch.argtypes = [ctypes.POINTER(_Args), ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        lib.mok_bwd_version.restype = ctypes.c_char_p
        lib.mok_wgrad_workspace_bytes.restype = ctypes.c_longlong
        lib.mok_wgrad_workspace_bytes.argtypes = [ctypes.POINTER(_WgradArgs)]
        lib.mok_wgrad_launch.restype = ctypes.c_int
        lib.mok_wgrad_launch.argtypes = [ctypes.POINTER(_WgradArgs), ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        _lib = lib
        return lib


_AVAILABILITY = KernelAvailability("MoK backward kernel", load_library)
is_available = _AVAILABILITY.is_available
unavailable_reason = _AVAILABILITY.unavailable_reason


# ---------------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------------
def _fail(msg: str, who: str = "mok_backward_emulated") -> None:
    raise ValueError(f"{who}: {msg}")


def _check(t, name, dtype, shape, device, contiguous=True, who: str = "mok_backward_emulated"):
    try:
        _check_tensor(t, name, dtype, shape, device, contiguous)
    except ValueError as exc:
        raise ValueError(f"{who}: {exc}") from None


def _check_tensor(t, name, dtype, shape, device, contiguous):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_expert(suffix: str, w1e, w2e, H: int, F: int, device, who: str = "mok_backward_emulated") -> None:
    """One expert's weights: w1 [2F, H], w2 [H, F] bf16, both read in place by TMA."""
    _check(w1e, f"w1{suffix}", torch.bfloat16, (2 * F, H), device, contiguous=False, who=who)
    _check(w2e, f"w2{suffix}", torch.bfloat16, (H, F), device, contiguous=False, who=who)
    for n, a in ((f"w1{suffix}", w1e), (f"w2{suffix}", w2e)):
        if a.stride(1) != 1 or a.stride(0) % 8 or a.data_ptr() % 16:
            _fail(f"{n} needs unit inner stride, row stride % 8 == 0, 16-byte aligned start", who)


def _check_launch(comm_sms, ring_slots, minibatch_tokens, timeout_ms, wgrad, who: str = "mok_backward_emulated"):
    """The launch settings both entry points take."""
    if not isinstance(comm_sms, int) or comm_sms < 1:
        _fail(f"comm_sms must be an int >= 1, got {comm_sms!r}", who)
    if not isinstance(ring_slots, int) or not 1 <= ring_slots <= MOK_MAX_SLOTS:
        _fail(f"ring_slots must be an int in [1, {MOK_MAX_SLOTS}], got {ring_slots!r}", who)
    if not isinstance(minibatch_tokens, int) or minibatch_tokens < 1:
        _fail(f"minibatch_tokens must be an int >= 1, got {minibatch_tokens!r}", who)
    if not timeout_ms > 0:
        _fail(f"timeout_ms must be > 0, got {timeout_ms!r}", who)
    if wgrad not in WGRAD_MODES:
        _fail(f"wgrad must be one of {WGRAD_MODES}, got {wgrad!r}", who)


def _check_fp8(fp8, has_saved_h: bool, R: int, L: int, H: int, F: int, device, fail) -> None:
    """The FP8 dgrad's preconditions: saved fc1 output, block-scale sizes, the transposed weights."""
    if not has_saved_h:
        fail("the fp8 dgrad reads the forward's saved fc1 output: pass saved_h (fc1 recompute is bf16 only)")
    if H % 128 or F % 128:
        fail(f"the fp8 dgrad needs hidden ({H}) and ffn ({F}) sizes multiples of 128 (block scales)")
    try:
        fp8.validate_transposes(R, L, H, F, device)
    except ValueError as exc:
        fail(str(exc))


def _fp8_buffers(cap: int, H: int, F: int, device) -> dict[str, torch.Tensor]:
    """One owner's e4m3 gy / dH rows (layout order) with their 1 x 128 block scales."""
    f32 = dict(dtype=torch.float32, device=device)
    e4 = dict(dtype=torch.float8_e4m3fn, device=device)
    return dict(
        gyl8=torch.empty((cap, H), **e4),
        gys=torch.empty((cap, H // 128), **f32),
        dh8=torch.empty((cap, 2 * F), **e4),
        dhs=torch.empty((cap, 2 * F // 128), **f32),
    )


def _error_message(err: list[int], R: int, L: int, timeout_ms: float) -> str:
    return format_error(err, R, L, timeout_ms, kernel="MoK backward kernel", phases=_PHASES)


def check_last_error(device=None, *, R: int = 0, L: int = 0, timeout_ms: float = 0.0) -> None:
    """Synchronize the current stream; raise MokKernelError if the last backward launch recorded an error."""
    raise_recorded_error(_err_cache, device, lambda vals: _error_message(vals, R, L, timeout_ms))


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with bf16 operands, fp32 accumulation and fp32 output."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # older torch: no mm.dtype overload
        return a.float() @ b.float()


def weight_grads(tpe, xl, gyl, dh, act, *, mode: str = "mm", main_grad_w1=None, main_grad_w2=None):
    """Expert weight gradients of one owner rank from the kernel's layout-order buffers.

    dW2_e = gy_e^T @ act_e [H, F], dW1_e = dH_e^T @ x_e [2F, H] (fp32). With main_grad_* (lists of
    fp32 tensors) the results are added into them and those are returned.
    """
    L = tpe.numel()
    H, F = gyl.shape[1], act.shape[1]
    dev = gyl.device
    if mode == "kernel":
        gw1s, gw2s = weight_grads_kernel(
            [tpe],
            [xl],
            [gyl],
            [dh],
            [act],
            main_grad_w1=None if main_grad_w1 is None else [main_grad_w1],
            main_grad_w2=None if main_grad_w2 is None else [main_grad_w2],
        )
        return gw1s[0], gw2s[0]
    if mode == "grouped":
        offs = torch.cumsum(tpe, 0, dtype=torch.int32)
        nonempty = (tpe > 0).view(L, 1, 1)
        g2 = torch._grouped_mm(gyl.t(), act, offs=offs)  # [L, H, F] (bf16 output)
        g1 = torch._grouped_mm(dh.t(), xl, offs=offs)  # [L, 2F, H]
        g2 = torch.where(nonempty, g2.float(), torch.zeros((), device=dev))
        g1 = torch.where(nonempty, g1.float(), torch.zeros((), device=dev))
        gw2, gw1 = list(g2.unbind(0)), list(g1.unbind(0))
    elif mode == "mm":
        counts = tpe.tolist()  # one host sync per call
        gw1, gw2 = [], []
        a = 0
        for e in range(L):
            b = a + counts[e]
            if b > a:
                gw2.append(_mm_fp32(gyl[a:b].t(), act[a:b]))
                gw1.append(_mm_fp32(dh[a:b].t(), xl[a:b]))
            else:
                gw2.append(torch.zeros((H, F), dtype=torch.float32, device=dev))
                gw1.append(torch.zeros((2 * F, H), dtype=torch.float32, device=dev))
            a = b
    else:
        raise ValueError(f"wgrad mode must be one of {WGRAD_MODES[:3]}, got {mode!r}")
    if main_grad_w1 is not None:
        for m, g in zip(main_grad_w1, gw1):
            m.add_(g)
        gw1 = list(main_grad_w1)
    if main_grad_w2 is not None:
        for m, g in zip(main_grad_w2, gw2):
            m.add_(g)
        gw2 = list(main_grad_w2)
    return gw1, gw2


def wgrad_output_ok(t: torch.Tensor) -> bool:
    """A tensor the wgrad kernel can write (or add into) in place: fp32 2-D, unit inner stride, even row
    stride, 8-byte aligned (its epilogue stores fp32 pairs)."""
    return (
        t.dtype == torch.float32
        and t.dim() == 2
        and t.stride(1) == 1
        and t.stride(0) % 2 == 0
        and t.data_ptr() % 8 == 0
    )


def weight_grads_kernel(
    tpe,
    xl,
    gyl,
    dh,
    act,
    *,
    main_grad_w1=None,
    main_grad_w2=None,
    err: torch.Tensor | None = None,
    timeout_ms: float = 10000.0,
    rank0: int = 0,
    home: HomeReductions | None = None,
):
    """Expert weight gradients of one or more owner ranks (partitions) in ONE launch of the wgrad kernel.

    Per partition p: tpe[p] int32 [L] (rows per local expert, device), xl[p] / gyl[p] [cap, H], dh[p]
    [cap, 2F], act[p] [cap, F] bf16 in layout order (experts back to back from row 0; rows past the
    last expert are never read as data). Returns (grad_w1[p][e] fp32 [2F, H], grad_w2[p][e] fp32 [H, F]).
    With main_grad_w1 / main_grad_w2 (per partition, lists of L fp32 tensors with unit inner stride) the
    results are added into them (gradient-accumulation fusion) and those are returned. No host sync.
    err: the int32 error record of the preceding dgrad launch: if that launch failed, every output
    (main_grad too) is set to NaN, so a training step stops at Megatron's gradient NaN check even when
    the record is read lazily. None: a fresh record, read through the lazy checker
    (``megatron_mok.kernel.check_pending_errors``). rank0: rank of partition 0, for error reports.
    home: the deferred home-side reductions of the preceding dgrad launch, computed by this launch's
    otherwise idle producer warps.
    """
    WHO = "weight_grads_kernel"

    def fail(msg: str) -> None:
        raise ValueError(f"{WHO}: {msg}")

    parts = len(tpe)
    if parts < 1 or not all(len(t) == parts for t in (xl, gyl, dh, act)):
        fail("tpe / xl / gyl / dh / act must be lists with one entry per partition")
    device = xl[0].device
    L = tpe[0].numel()
    cap, H = xl[0].shape
    F = act[0].shape[1]
    for p in range(parts):
        _check(tpe[p], f"tpe[{p}]", torch.int32, (L,), device, who=WHO)
        _check(xl[p], f"xl[{p}]", torch.bfloat16, (cap, H), device, who=WHO)
        _check(gyl[p], f"gyl[{p}]", torch.bfloat16, (cap, H), device, who=WHO)
        _check(dh[p], f"dh[{p}]", torch.bfloat16, (cap, 2 * F), device, who=WHO)
        _check(act[p], f"act[{p}]", torch.bfloat16, (cap, F), device, who=WHO)
    if (main_grad_w1 is None) != (main_grad_w2 is None):
        fail("give both main_grad_w1 and main_grad_w2, or neither")
    accumulate = main_grad_w1 is not None
    if accumulate:
        for name, mg, shape in (("main_grad_w1", main_grad_w1, (2 * F, H)), ("main_grad_w2", main_grad_w2, (H, F))):
            if len(mg) != parts or any(len(m) != L for m in mg):
                fail(f"{name} must hold {parts} list(s) of {L} tensors")
            for p in range(parts):
                for e, m in enumerate(mg[p]):
                    _check(m, f"{name}[{p}][{e}]", torch.float32, shape, device, contiguous=False, who=WHO)
                    if not wgrad_output_ok(m):
                        fail(f"{name}[{p}][{e}] needs unit inner stride, an even row stride, 8-byte alignment")
        gw1, gw2 = [list(m) for m in main_grad_w1], [list(m) for m in main_grad_w2]
    else:
        gw1 = [list(torch.empty((L, 2 * F, H), dtype=torch.float32, device=device).unbind(0)) for _ in range(parts)]
        gw2 = [list(torch.empty((L, H, F), dtype=torch.float32, device=device).unbind(0)) for _ in range(parts)]
    lib = load_library()
    dev = device.index if device.index is not None else torch.cuda.current_device()
    own_record = err is None
    if own_record:
        err = torch.zeros((16,), dtype=torch.int32, device=device)
    a = _WgradArgs()
    a.np, a.L, a.H, a.F = parts, L, H, F
    a.rank0 = rank0
    a.device = dev
    a.accumulate = 1 if accumulate else 0
    a.timeout_ms = float(timeout_ms)
    a.cap = cap
    arrays = LaunchArrays()  # host arrays the struct points at, alive until the launch returned
    arr, arr_i64 = arrays.u64, arrays.i64

    a.tpe = arr([t.data_ptr() for t in tpe])
    a.xl, a.gyl = arr([t.data_ptr() for t in xl]), arr([t.data_ptr() for t in gyl])
    a.dh, a.act = arr([t.data_ptr() for t in dh]), arr([t.data_ptr() for t in act])
    a.gw1 = arr([m.data_ptr() for row in gw1 for m in row])
    a.gw1_ld = arr_i64([m.stride(0) for row in gw1 for m in row])
    a.gw2 = arr([m.data_ptr() for row in gw2 for m in row])
    a.gw2_ld = arr_i64([m.stride(0) for row in gw2 for m in row])
    if home is not None:
        ptrs = lambda ts: arr([t.data_ptr() for t in ts])  # noqa: E731
        a.K, a.home_parts = home.K, len(home.grad_x)
        a.h_T = arr_i64([t.shape[0] for t in home.grad_x])
        a.h_grad_out, a.h_combine, a.h_grad_buf = ptrs(home.grad_out), ptrs(home.combine), ptrs(home.grad_buf)
        a.h_idx, a.h_grad_w, a.h_grad_x = ptrs(home.idx), ptrs(home.grad_w), ptrs(home.grad_x)
    nbytes = lib.mok_wgrad_workspace_bytes(ctypes.byref(a))
    if nbytes < 0:
        fail(f"sizes rejected by the library (L={L}, H={H}, F={F}, cap={cap})")
    # per call (stream-ordered by the caching allocator), so launches on several streams never share it
    ws = torch.empty((nbytes + 256,), dtype=torch.uint8, device=device)
    a.workspace = (ws.data_ptr() + 255) // 256 * 256
    a.workspace_bytes = nbytes
    a.err = err.data_ptr()
    ebuf = ctypes.create_string_buffer(1024)
    stream = torch.cuda.current_stream(device)
    if lib.mok_wgrad_launch(ctypes.byref(a), ctypes.c_void_p(stream.cuda_stream), ebuf, 1024) != 0:
        raise MokKernelError(f"MoK wgrad launch failed: {ebuf.value.decode(errors='replace')}")
    if own_record and capture_check("lazy", WHO):  # captured: the record is read after a replay instead
        _lazy_checker(dev).after_launch(err, stream, R=parts, L=L, timeout_ms=timeout_ms, fmt=_error_message)
    return gw1, gw2


def _kept_or_new(kept, parts: int, cap: int, H: int, F: int, saved: bool, device, fail=_fail):
    """Owner-side xl / act buffers [cap, H] / [cap, F] per part: views of the forward's kept rows
    (KeptRows; act only with saved h: the recompute path writes its own), or new ones."""
    bf = dict(dtype=torch.bfloat16, device=device)
    if kept is None:
        return [torch.empty((cap, H), **bf) for _ in range(parts)], [torch.empty((cap, F), **bf) for _ in range(parts)]
    if not kept.filled:
        fail("kept rows were never laid out by a forward launch (mok_forward_*(..., keep=...))")
    kept.check_storage(device, fail)
    if tuple(kept.x.shape[::2]) != (parts, H) or tuple(kept.act.shape[::2]) != (parts, F):
        fail(f"kept rows are [{tuple(kept.x.shape)}, {tuple(kept.act.shape)}], need {parts} parts of H={H} / F={F}")
    if kept.rows < cap:
        fail(f"kept rows hold {kept.rows} rows per owner, the backward needs {cap}")
    xl = [kept.x[p, :cap] for p in range(parts)]
    act = [kept.act[p, :cap] for p in range(parts)] if saved else [torch.empty((cap, F), **bf) for _ in range(parts)]
    return xl, act


def mok_backward_emulated(
    grad_out,
    x,
    topk_idx,
    topk_weight,
    combine_buf,
    w1,
    w2,
    *,
    comm_sms: int,
    ring_slots: int,
    minibatch_tokens: int,
    timeout_ms: float = 10000.0,
    wgrad: str = "kernel",
    main_grad_w1=None,
    main_grad_w2=None,
    debug_stall: tuple[int, int] | None = None,
    ctas_per_rank: int = 0,
    check: bool | str = True,
    return_buffers: bool = False,
    saved_h=None,
    timeline=None,
    fp8=None,
    kept=None,
    glu: Glu | None = None,
):
    """MoE layer backward over R emulated EP ranks (one kernel launch + the wgrad GEMMs).

    grad_out[r] [T_r, H] bf16, x[r] [T_r, H] bf16, topk_idx[r] [T_r, K] int32, topk_weight[r] [T_r, K] fp32,
    combine_buf[r] [T_r, K, H] bf16 (the forward's unweighted expert outputs), w1[q][e] [2F, H] bf16,
    w2[q][e] [H, F] bf16. Returns (grad_x[r] bf16, grad_topk_weight[r] fp32 [T_r, K], grad_w1[q][e] fp32,
    grad_w2[q][e] fp32); wgrad="none" returns None for the weight gradients.
    saved_h[q] [>= sum_r T_r * K, 2F] bf16: the forward kernel's fc1 output (``mok_forward_emulated(...,
    saved_h=...)``); stage 1 then reads h instead of recomputing x @ W1^T (None: recompute).
    timeline: a ``megatron_mok.kernel.timeline.Timeline`` to record per-SM intervals of this launch.
    fp8: a ``kernel.fp8_weights.Fp8ExpertWeights`` of w1 / w2 with its transposes (``with_transposes()``)
    selects the FP8 dgrad (kernel.dtype fp8): needs saved_h and hidden / ffn sizes multiples of 128; the
    wgrad stays bf16 x bf16 -> fp32.
    glu: the forward's SwiGLU variant (clamp / offset, ``megatron_mok.activation.Glu``); None: plain.
    kept: the ``KeptRows`` of the matching ``mok_forward_emulated(..., keep=...)``: xl (and with saved_h
    act) are read there (layout order, whatever the two minibatches), so the comm SMs pull only grad_out.
    """
    check = capture_check(check, "mok_backward_emulated")
    if timeline is not None:
        refuse_capture("a timeline launch", "its event buffer is read back after each launch")
    if wgrad == "mm":
        refuse_capture("mok_backward_emulated(wgrad='mm')", "it reads the per-expert row counts on the host")
    if not isinstance(x, (list, tuple)) or not x:
        _fail("x must be a non-empty list of per-rank tensors")
    R = len(x)
    if R > MOK_MAX_RANKS:
        _fail(f"at most {MOK_MAX_RANKS} ranks, got {R}")
    for name, lst in (
        ("grad_out", grad_out),
        ("topk_idx", topk_idx),
        ("topk_weight", topk_weight),
        ("combine_buf", combine_buf),
        ("w1", w1),
        ("w2", w2),
    ):
        if not isinstance(lst, (list, tuple)) or len(lst) != R:
            _fail(f"{name} must be a list of {R} entries (one per rank)")
    device = x[0].device
    if device.type != "cuda":
        _fail("x[0] must be a CUDA tensor")
    if not isinstance(w1[0], (list, tuple)) or not w1[0]:
        _fail("w1[q] must be a non-empty list of per-expert weights")
    L = len(w1[0])
    if L > MOK_MAX_LOCAL_EXPERTS:
        _fail(f"at most {MOK_MAX_LOCAL_EXPERTS} local experts, got {L}")
    if not isinstance(w2[0], (list, tuple)) or len(w2[0]) != L or not isinstance(w2[0][0], torch.Tensor):
        _fail("w2[q] must be a list of L expert weights")
    H, F = w2[0][0].shape
    if H % 64 or F % 64 or H == 0 or F == 0:
        _fail(f"hidden ({H}) and ffn ({F}) sizes must be positive multiples of 64")
    K = topk_idx[0].shape[1] if topk_idx[0].dim() == 2 else -1
    if not 1 <= K <= 64:
        _fail(f"top-k must be in [1, 64], got {K}")
    Ts = []
    for r in range(R):
        T = x[r].shape[0] if x[r].dim() == 2 else -1
        _check(x[r], f"x[{r}]", torch.bfloat16, (T, H), device)
        _check(grad_out[r], f"grad_out[{r}]", torch.bfloat16, (T, H), device)
        _check(topk_idx[r], f"topk_idx[{r}]", torch.int32, (T, K), device)
        _check(topk_weight[r], f"topk_weight[{r}]", torch.float32, (T, K), device)
        _check(combine_buf[r], f"combine_buf[{r}]", torch.bfloat16, (T, K, H), device)
        Ts.append(T)
    for q in range(R):
        if (
            not isinstance(w1[q], (list, tuple))
            or len(w1[q]) != L
            or not isinstance(w2[q], (list, tuple))
            or len(w2[q]) != L
        ):
            _fail(f"w1[{q}] and w2[{q}] must each hold {L} expert weights")
        if not (
            dense_weights_ok([w1[q]], 1, L, torch.bfloat16, (2 * F, H), device)
            and dense_weights_ok([w2[q]], 1, L, torch.bfloat16, (H, F), device)
        ):  # the cheap pass failed: check each expert in detail (names the bad one)
            for e in range(L):
                _check_expert(f"[{q}][{e}]", w1[q][e], w2[q][e], H, F, device)
    _check_launch(comm_sms, ring_slots, minibatch_tokens, timeout_ms, wgrad)
    if debug_stall is not None and not (0 <= debug_stall[0] < R and 0 <= debug_stall[1] < ring_slots):
        _fail(f"debug_stall {debug_stall} out of range")

    lib = load_library()
    dev = device.index if device.index is not None else torch.cuda.current_device()
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cpr = ctas_per_rank or num_sms // R
    if comm_sms >= cpr:
        _fail(f"comm_sms={comm_sms} leaves no compute SM: {R} rank(s) on {num_sms} SMs give {cpr} SMs per rank")

    # W1 / W2 are read as stored (MN-major B operands); only the recompute path's 128-column stage-1
    # tiles read W2^T (K-major), materialised here once per call
    w2t = (
        [[w2[q][e].t().contiguous() for e in range(L)] for q in range(R)] if saved_h is None else [[] for _ in range(R)]
    )

    cap = max(1, sum(Ts) * K)  # rows per owner rank's layout-order buffers (upper bound, no host sync)
    if saved_h is not None:
        if not isinstance(saved_h, (list, tuple)) or len(saved_h) != R:
            _fail(f"saved_h must be a list of {R} tensors (one per owner rank) or None")
        for q, t in enumerate(saved_h):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] < cap or t.shape[1] != 2 * F:
                _fail(f"saved_h[{q}] must be [>= {cap}, {2 * F}] (every routed row may land on one owner)")
            _check(t, f"saved_h[{q}]", torch.bfloat16, tuple(t.shape), device)
    if fp8 is not None:
        _check_fp8(fp8, saved_h is not None, R, L, H, F, device, _fail)
    bf = dict(dtype=torch.bfloat16, device=device)
    grad_x = [torch.empty((T, H), **bf) for T in Ts]
    grad_w = [torch.empty((T, K), dtype=torch.float32, device=device) for T in Ts]
    grad_buf = [torch.empty((T, K, H), **bf) for T in Ts]
    tpe = [torch.empty((L,), dtype=torch.int32, device=device) for _ in range(R)]
    xl, act = _kept_or_new(kept, R, cap, H, F, saved_h is not None, device)
    gyl = [torch.empty((cap, H), **bf) for _ in range(R)]
    dh = [torch.empty((cap, 2 * F), **bf) for _ in range(R)]
    f8 = [_fp8_buffers(cap, H, F, device) for _ in range(R)] if fp8 is not None else []

    arrays = LaunchArrays()  # host arrays the struct points at, alive until the launch returned
    arr, arr_i64 = arrays.u64, arrays.i64

    ptrs = lambda ts: arr([t.data_ptr() for t in ts])  # noqa: E731
    args = _Args()
    bind_glu(args, glu)  # the forward's SwiGLU variant
    args.R, args.L, args.H, args.F, args.K = R, L, H, F, K
    args.comm_sms, args.ring_slots, args.minibatch = comm_sms, ring_slots, minibatch_tokens
    args.ctas_per_rank = cpr
    args.stall_rank, args.stall_slot = debug_stall if debug_stall is not None else (-1, -1)
    args.rank = -1  # emulated EP: every rank in this launch
    args.device = dev
    args.timeout_ms = float(timeout_ms)
    args.cap = cap
    args.T = arr_i64(Ts)
    args.x, args.idx, args.w = ptrs(x), ptrs(topk_idx), ptrs(topk_weight)
    args.grad_out, args.combine, args.grad_buf = ptrs(grad_out), ptrs(combine_buf), ptrs(grad_buf)
    args.grad_x, args.grad_w, args.tpe = ptrs(grad_x), ptrs(grad_w), ptrs(tpe)
    args.xl, args.gyl, args.dh, args.act = ptrs(xl), ptrs(gyl), ptrs(dh), ptrs(act)
    args.w1 = arr([w1[q][e].data_ptr() for q in range(R) for e in range(L)])
    args.w1_ld = arr_i64([w1[q][e].stride(0) for q in range(R) for e in range(L)])
    args.w2 = arr([w2[q][e].data_ptr() for q in range(R) for e in range(L)])
    args.w2_ld = arr_i64([w2[q][e].stride(0) for q in range(R) for e in range(L)])
    if saved_h is None:
        args.w2t = arr([w2t[q][e].data_ptr() for q in range(R) for e in range(L)])
    if saved_h is not None:
        args.saved_h = ptrs(saved_h)
    if fp8 is not None:
        flat = lambda lst: arr([t.data_ptr() for q in range(R) for t in lst[q]])  # noqa: E731
        args.fp8 = 1
        args.w2t8, args.w2ts, args.w1t8, args.w1ts = flat(fp8.w2tq), flat(fp8.w2ts), flat(fp8.w1tq), flat(fp8.w1ts)
        args.gyl8, args.gys = ptrs([b["gyl8"] for b in f8]), ptrs([b["gys"] for b in f8])
        args.dh8, args.dhs = ptrs([b["dh8"] for b in f8]), ptrs([b["dhs"] for b in f8])
    if timeline is not None:
        args.timeline, args.timeline_count, args.timeline_cap = timeline.prepare(R * cpr, device)
    if kept is not None:
        args.x_kept, args.act_kept = 1, int(saved_h is not None)
    # the wgrad kernel that follows takes the router grad and the grad_x sum (its idle producer warps)
    home = None
    if wgrad == "kernel":
        args.defer_home = 1
        home = HomeReductions(grad_out, combine_buf, grad_buf, topk_idx, grad_w, grad_x, K)

    nbytes = lib.mok_bwd_workspace_bytes(ctypes.byref(args))
    if nbytes < 0:
        _fail("invalid sizes (rejected by the library)")
    ws = launch_workspace(_ws_cache, dev, nbytes, device)
    err = _err_cache.get(dev)
    if err is None:
        err = torch.zeros((16,), dtype=torch.int32, device=device)
        _err_cache[dev] = err
    args.workspace = ws.data_ptr()
    args.workspace_bytes = ws.numel()
    args.err = err.data_ptr()

    stream = torch.cuda.current_stream(device)
    ebuf = ctypes.create_string_buffer(1024)
    rc = lib.mok_bwd_emulated_launch(ctypes.byref(args), ctypes.c_void_p(stream.cuda_stream), ebuf, 1024)
    if rc != 0:
        raise MokKernelError(f"MoK backward launch failed: {ebuf.value.decode(errors='replace')}")
    # keep the transposed weights alive until the kernel has read them (stream-ordered free)
    for t in [t for row in w2t for t in row]:
        t.record_stream(stream)
    gw1 = gw2 = None
    if wgrad == "kernel":  # every partition in one launch, before the (synchronising) error check
        gw1, gw2 = weight_grads_kernel(
            tpe,
            xl,
            gyl,
            dh,
            act,
            main_grad_w1=main_grad_w1,
            main_grad_w2=main_grad_w2,
            err=err,
            timeout_ms=timeout_ms,
            home=home,
        )
    if check == "lazy":  # no host sync: the record is read asynchronously (kernel.check_pending_errors)
        _lazy_checker(dev).after_launch(err, stream, R=R, L=L, timeout_ms=timeout_ms, fmt=_error_message)
    elif check:
        check_last_error(device, R=R, L=L, timeout_ms=timeout_ms)

    if wgrad not in ("none", "kernel"):
        gw1, gw2 = [], []
        for q in range(R):
            a1, a2 = weight_grads(
                tpe[q],
                xl[q],
                gyl[q],
                dh[q],
                act[q],
                mode=wgrad,
                main_grad_w1=None if main_grad_w1 is None else main_grad_w1[q],
                main_grad_w2=None if main_grad_w2 is None else main_grad_w2[q],
            )
            gw1.append(a1)
            gw2.append(a2)
    if return_buffers:
        extra = {k: [b[k] for b in f8] for k in ("gyl8", "gys", "dh8", "dhs")} if f8 else {}
        return grad_x, grad_w, gw1, gw2, dict(tpe=tpe, xl=xl, gyl=gyl, dh=dh, act=act, grad_buf=grad_buf, **extra)
    return grad_x, grad_w, gw1, gw2


# ---------------------------------------------------------------------------------------------------
# per-rank launch (real EP over torch symmetric memory; see kernel/comm.py)
# ---------------------------------------------------------------------------------------------------
def mok_backward_rank(
    bufs,
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    combine_buf: torch.Tensor,
    w1: list[torch.Tensor],
    w2: list[torch.Tensor],
    *,
    comm_sms: int,
    ring_slots: int,
    minibatch_tokens: int,
    timeout_ms: float = 10000.0,
    wgrad: str = "kernel",
    main_grad_w1=None,
    main_grad_w2=None,
    saved_h: torch.Tensor | None = None,
    owner_rows: int = 0,
    ctas: int = 0,
    stream: torch.cuda.Stream | None = None,
    kept=None,
    check: bool | str = True,
    timeline=None,
    return_buffers: bool = False,
    fp8=None,
    glu: Glu | None = None,
):
    """MoE layer backward of rank ``bufs.rank`` (a :class:`~megatron_mok.kernel.comm.PeerBuffers`):
    one launch of the same backward kernel as :func:`mok_backward_emulated`, with one partition, meeting
    its peers on their signal pads. Every rank must make the matching call (same epoch sequence as the
    forward calls on these buffers, same token count).

    grad_out / x [T, H] bf16, topk_idx [T, K] int32/int64, topk_weight [T, K] fp32, combine_buf [T, K, H]
    bf16 (this rank's forward output rows before the weighted sum: ``mok_forward_rank``'s combine, which
    must be a copy when a later forward may have reused the symmetric buffer; a view of it is copied
    here because the backward receives gradients in those bytes), w1[e] [2F, H] / w2[e] [H, F] this
    rank's L experts. saved_h [>= world * T * K, 2F] bf16: this rank's forward-kept fc1 output in layout
    order (``mok_forward_rank(..., saved_h=...)``), or None to recompute. Returns (grad_x [T, H] bf16,
    grad_topk_weight [T, K] fp32, grad_w1 [L] fp32, grad_w2 [L] fp32; None with wgrad="none").

    ``wgrad="kernel"`` (default) runs the wgrad kernel right after, without a host sync. ``wgrad="mm"``
    reads the per-expert row counts on the host (one sync after the launch); several ranks driven from
    one process (tests) must then use "kernel" / "none" / "grouped" or compute :func:`weight_grads` from
    ``return_buffers=True`` after every rank has launched.

    Memory: the owner-side layout-order buffers (x rows, scaled output-gradient rows, dH, act) hold
    ``owner_rows`` rows; 0 = world * T * K, the worst case of every routed row landing on this rank (no
    host sync to learn the real count). With fewer, a routing that sends this rank more rows is reported
    by the kernel (MokKernelError naming the rank and both counts) before any row is written.

    fp8: this rank's ``Fp8ExpertWeights`` (one rank: ``w1q[0][e]``...) with transposes selects the FP8
    dgrad, as in :func:`mok_backward_emulated`. kept: the one-part ``KeptRows`` of this rank's matching
    ``mok_forward_rank(..., keep=...)``: xl (and with saved_h act) are read there, only grad_out is pulled.
    """
    refuse_capture("mok_backward_rank", "each launch meets its peers under a new epoch, which a replay would repeat")
    WHO = "mok_backward_rank"

    def fail(msg: str) -> None:
        raise ValueError(f"{WHO}: {msg}")

    R, rank, reg = bufs.world, bufs.rank, bufs.region
    device = bufs.x.device
    H, K = reg.hidden, reg.topk
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        fail("x must be a [T, H] tensor")
    T = x.shape[0]
    if T > reg.tokens_cap:
        fail(f"{T} tokens exceed the peer buffers' capacity of {reg.tokens_cap}")
    _check(x, "x", torch.bfloat16, (T, H), device, who=WHO)
    _check(grad_out, "grad_out", torch.bfloat16, (T, H), device, contiguous=False, who=WHO)
    _check(topk_weight, "topk_weight", torch.float32, (T, K), device, contiguous=False, who=WHO)
    _check(combine_buf, "combine_buf", torch.bfloat16, (T, K, H), device, contiguous=False, who=WHO)
    if topk_idx.dtype not in (torch.int32, torch.int64) or tuple(topk_idx.shape) != (T, K):
        fail(f"topk_idx must be int32/int64 [{T}, {K}], got {topk_idx.dtype} {tuple(topk_idx.shape)}")
    L = len(w1)
    if L < 1 or len(w2) != L or L > MOK_MAX_LOCAL_EXPERTS:
        fail(f"w1 / w2 must hold this rank's experts (got {len(w1)} and {len(w2)})")
    F = w2[0].shape[1]
    if H % 64 or F % 64:
        fail(f"hidden ({H}) and ffn ({F}) sizes must be multiples of 64")
    if not (
        dense_weights_ok([w1], 1, L, torch.bfloat16, (2 * F, H), device)
        and dense_weights_ok([w2], 1, L, torch.bfloat16, (H, F), device)
    ):
        for e in range(L):
            _check_expert(f"[{e}]", w1[e], w2[e], H, F, device, who=WHO)
    _check_launch(comm_sms, ring_slots, minibatch_tokens, timeout_ms, wgrad, who=WHO)
    if not isinstance(owner_rows, int) or owner_rows < 0:
        fail(f"owner_rows must be an int >= 0 (0: world * T * K), got {owner_rows!r}")
    cap = owner_rows or max(1, R * T * K)
    if saved_h is not None:
        if saved_h.dim() != 2 or saved_h.shape[0] < cap or saved_h.shape[1] != 2 * F:
            fail(f"saved_h must be [>= {cap}, {2 * F}] (owner_rows rows: the forward's saved fc1 output)")
        _check(saved_h, "saved_h", torch.bfloat16, tuple(saved_h.shape), device, who=WHO)
    if fp8 is not None:
        _check_fp8(fp8, saved_h is not None, 1, L, H, F, device, fail)

    stream = stream or torch.cuda.current_stream(device)
    bf = dict(dtype=torch.bfloat16, device=device)
    with torch.cuda.stream(stream):
        # the backward receives gradients in the combine bytes: keep the forward's rows apart first
        lo, hi = bufs.grad_buf.data_ptr(), bufs.grad_buf.data_ptr() + bufs.grad_buf.numel() * 2
        if lo <= combine_buf.data_ptr() < hi:
            combine_buf = combine_buf.clone()
        combine_buf = combine_buf.contiguous()
        # publish this call's inputs where peers read them
        for dst, src in ((bufs.x, x), (bufs.grad_out, grad_out), (bufs.topk_w, topk_weight)):
            if src.data_ptr() != dst.data_ptr():
                dst[:T].copy_(src)
        if topk_idx.data_ptr() != bufs.idx.data_ptr() or topk_idx.dtype != torch.int32:
            bufs.idx[:T].copy_(topk_idx)
        grad_x = torch.empty((T, H), **bf)
        grad_w = torch.empty((T, K), dtype=torch.float32, device=device)
        tpe = torch.empty((L,), dtype=torch.int32, device=device)
        (xl,), (act,) = _kept_or_new(kept, 1, cap, H, F, saved_h is not None, device, fail)
        gyl = torch.empty((cap, H), **bf)
        dh = torch.empty((cap, 2 * F), **bf)
        w2t = [w.t().contiguous() for w in w2] if saved_h is None else []  # recompute path only
        f8 = _fp8_buffers(cap, H, F, device) if fp8 is not None else None

    lib = load_library()
    arrays = LaunchArrays()  # host arrays the struct points at, alive until the launch returned
    arr, arr_i64 = arrays.u64, arrays.i64

    def own_only(ptr: int):
        return arr([ptr if r == rank else 0 for r in range(R)])

    args = _Args()
    bind_glu(args, glu)  # the forward's SwiGLU variant
    args.R, args.L, args.H, args.F, args.K = R, L, H, F, K
    args.comm_sms, args.ring_slots, args.minibatch = comm_sms, ring_slots, minibatch_tokens
    args.ctas_per_rank = ctas
    args.stall_rank, args.stall_slot = -1, -1
    args.device = device.index if device.index is not None else torch.cuda.current_device()
    args.timeout_ms = float(timeout_ms)
    args.cap = cap
    args.T = arr_i64([T] * R)  # equal on every rank (checked in the kernel)
    args.x = arr([bufs.peer(r, reg.x_off) for r in range(R)])
    args.idx = arr([bufs.peer(r, reg.idx_off) for r in range(R)])
    args.w = arr([bufs.peer(r, reg.topk_w_off) for r in range(R)])
    args.grad_out = arr([bufs.peer(r, reg.grad_out_off) for r in range(R)])
    args.grad_buf = arr([bufs.peer(r, reg.combine_off) for r in range(R)])
    args.signal = arr([bufs.peer(r, reg.signal_off) for r in range(R)])
    args.combine = own_only(combine_buf.data_ptr())
    args.grad_x, args.grad_w, args.tpe = (
        own_only(grad_x.data_ptr()),
        own_only(grad_w.data_ptr()),
        own_only(tpe.data_ptr()),
    )
    args.xl, args.gyl = own_only(xl.data_ptr()), own_only(gyl.data_ptr())
    args.dh, args.act = own_only(dh.data_ptr()), own_only(act.data_ptr())
    args.w1 = arr([t.data_ptr() for t in w1])
    args.w1_ld = arr_i64([t.stride(0) for t in w1])
    args.w2 = arr([t.data_ptr() for t in w2])
    args.w2_ld = arr_i64([t.stride(0) for t in w2])
    if w2t:
        args.w2t = arr([t.data_ptr() for t in w2t])
    if saved_h is not None:
        args.saved_h = own_only(saved_h.data_ptr())
    if f8 is not None:
        args.fp8 = 1
        args.w2t8, args.w2ts = arr([t.data_ptr() for t in fp8.w2tq[0]]), arr([t.data_ptr() for t in fp8.w2ts[0]])
        args.w1t8, args.w1ts = arr([t.data_ptr() for t in fp8.w1tq[0]]), arr([t.data_ptr() for t in fp8.w1ts[0]])
        args.gyl8, args.gys = own_only(f8["gyl8"].data_ptr()), own_only(f8["gys"].data_ptr())
        args.dh8, args.dhs = own_only(f8["dh8"].data_ptr()), own_only(f8["dhs"].data_ptr())
    if kept is not None:
        args.x_kept, args.act_kept = 1, int(saved_h is not None)
    args.rank = rank
    args.epoch = (bufs.epoch + 1) & 0xFFFFFFFF or 1
    if timeline is not None:
        grid = ctas or torch.cuda.get_device_properties(args.device).multi_processor_count
        args.timeline, args.timeline_count, args.timeline_cap = timeline.prepare(grid, device)
    home = None
    if wgrad == "kernel":  # this rank's router grad and grad_x sum: in the wgrad launch (see emulated)
        args.defer_home = 1
        home = HomeReductions(
            [bufs.grad_out[:T]], [combine_buf], [bufs.grad_buf[:T]], [bufs.idx[:T]], [grad_w], [grad_x], K
        )
    nbytes = lib.mok_bwd_workspace_bytes(ctypes.byref(args))
    if nbytes < 0:
        fail("invalid sizes (rejected by the library)")
    if bufs.bwd_workspace is None or bufs.bwd_workspace.numel() < nbytes:
        bufs.bwd_workspace = torch.empty((max(nbytes, 1) + 4096,), dtype=torch.uint8, device=device)
    args.workspace = bufs.bwd_workspace.data_ptr()
    args.workspace_bytes = bufs.bwd_workspace.numel()
    args.err = bufs.bwd_err.data_ptr()

    ebuf = ctypes.create_string_buffer(1024)
    rc = lib.mok_bwd_rank_launch(ctypes.byref(args), ctypes.c_void_p(stream.cuda_stream), ebuf, 1024)
    if rc != 0:
        raise MokKernelError(f"MoK backward rank {rank} launch failed: {ebuf.value.decode(errors='replace')}")
    bufs.epoch = args.epoch
    for t in w2t:
        t.record_stream(stream)
    gw1 = gw2 = None
    if wgrad == "kernel":  # same stream, no host sync; skipped by the kernel if the dgrad launch failed
        with torch.cuda.stream(stream):
            g1, g2 = weight_grads_kernel(
                [tpe],
                [xl],
                [gyl],
                [dh],
                [act],
                main_grad_w1=None if main_grad_w1 is None else [main_grad_w1],
                main_grad_w2=None if main_grad_w2 is None else [main_grad_w2],
                err=bufs.bwd_err,
                timeout_ms=timeout_ms,
                rank0=rank,
                home=home,
            )
        gw1, gw2 = g1[0], g2[0]
    if check == "lazy":
        _lazy_checker(args.device).after_launch(
            bufs.bwd_err, stream, R=R, L=L, timeout_ms=timeout_ms, fmt=_error_message
        )
    elif check:
        check_rank_backward_error(bufs, stream, L=L, timeout_ms=timeout_ms)

    if wgrad not in ("none", "kernel"):
        with torch.cuda.stream(stream):
            gw1, gw2 = weight_grads(
                tpe, xl, gyl, dh, act, mode=wgrad, main_grad_w1=main_grad_w1, main_grad_w2=main_grad_w2
            )
    if return_buffers:
        return grad_x, grad_w, gw1, gw2, dict(tpe=tpe, xl=xl, gyl=gyl, dh=dh, act=act, **(f8 or {}))
    return grad_x, grad_w, gw1, gw2


def check_rank_backward_error(bufs, stream=None, *, L: int, timeout_ms: float) -> None:
    """Wait for the rank's last backward launch; raise MokKernelError if it recorded an error."""
    from .comm import raise_rank_error

    raise_rank_error(bufs.bwd_err, stream, lambda v: _error_message(v, bufs.world, L, timeout_ms))
