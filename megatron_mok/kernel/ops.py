"""The MoK operators in PyTorch's dispatcher (namespace ``mok``): their schemas and fake implementations.

The schemas are defined here, in Python, so they exist without the CUDA build: the CPU suite checks the fake
implementations' shapes, and ``torch.compile`` traces a MoK layer with fake tensors. The CUDA implementations
come from the C++ extension (``csrc/mok/apis/*.cpp``, ``TORCH_LIBRARY_IMPL(mok, CUDA, ...)``), built on first use
or at install (``build.py``) and loaded by :func:`load`; every argument is checked there (``TORCH_CHECK``).

Peer memory enters as integers: ``peer_bases`` (every rank's symmetric-region base address, empty at EP 1) and
``peer_offsets`` (the region's field offsets, ``comm.PeerRegion``); the own rank's region views are passed as
tensors, so the dispatcher sees what a launch reads and writes.
"""

from __future__ import annotations

import threading

import torch

# the limits every launch is checked against (csrc/mok/mok_limits.h)
MOK_MAX_RANKS = 72
MOK_MAX_LOCAL_EXPERTS = 512
MOK_MAX_SLOTS = 64

_DEF = torch.library.Library("mok", "DEF")  # noqa: TOR901 - the project's own operator namespace

_DEF.define(
    "forward(Tensor x, Tensor topk_idx, Tensor topk_weight, Tensor[] w1, Tensor[] w2, Tensor[] w1_scale, "
    "Tensor[] w2_scale, Tensor(a!) combine, Tensor(b!) err, int[] peer_bases, int[] peer_offsets, "
    "Tensor(c!)? saved_h, Tensor(d!)? keep_x, Tensor(e!)? keep_act, Tensor(f!)? timeline, "
    "Tensor(g!)? timeline_count, int rank, int epoch, int comm_sms, int ring_slots, int minibatch, int ctas, "
    "float timeout_ms, int glu, float glu_clamp, float glu_offset, int raster, int debug, int stall_rank, "
    "int stall_slot) -> (Tensor out, Tensor tokens_per_expert)"
)
_DEF.define(
    "backward(Tensor grad_out, Tensor x, Tensor topk_idx, Tensor topk_weight, Tensor combine, Tensor[] w1, "
    "Tensor[] w2, Tensor[] w2t, Tensor(a!) grad_buf, Tensor(b!) xl, Tensor(c!) gyl, Tensor(d!) dh, Tensor(e!) act, "
    "Tensor(f!) err, int[] peer_bases, int[] peer_offsets, Tensor? saved_h, Tensor[] fp8_weights, "
    "Tensor(g!)[] fp8_buffers, Tensor(h!)? timeline, Tensor(i!)? timeline_count, int rank, int epoch, int comm_sms, "
    "int ring_slots, int minibatch, int ctas, float timeout_ms, int glu, float glu_clamp, float glu_offset, "
    "bool defer_home, bool x_kept, bool act_kept, int stall_rank, int stall_slot) "
    "-> (Tensor grad_x, Tensor grad_topk_weight, Tensor tokens_per_expert)"
)
_DEF.define(
    "wgrad(Tensor tokens_per_expert, Tensor xl, Tensor gyl, Tensor dh, Tensor act, Tensor(a!)[] grad_w1, "
    "Tensor(b!)[] grad_w2, Tensor(c!) err, bool accumulate, int rank, float timeout_ms, Tensor? home_grad_out, "
    "Tensor? home_combine, Tensor? home_grad_buf, Tensor? home_idx, Tensor(d!)? home_grad_w, "
    "Tensor(e!)? home_grad_x) -> ()"
)
_DEF.define("fp8_quantize_weight(Tensor w) -> (Tensor, Tensor)")
_DEF.define(
    "fp8_grouped_gemm(Tensor xq, Tensor xs, Tensor[] wq, Tensor[] ws, int[] counts, Tensor(a!) out, "
    "Tensor(b!) err, float timeout_ms) -> ()"
)
_DEF.define(
    "fp8_wgrad_gemm(Tensor a, Tensor sa, Tensor b, Tensor sb, Tensor counts, Tensor(a!)[] out, Tensor(b!) err, "
    "bool accumulate, float timeout_ms) -> ()"
)
_DEF.define("fp8_quantize_tokens(Tensor rows, Tensor counts, int kcap, Tensor(a!) err) -> (Tensor, Tensor)")
_DEF.define("mxfp8_quantize_rows(Tensor x, int scale_layout) -> (Tensor, Tensor)")
_DEF.define("topk_from_routing_map(Tensor routing_map, Tensor probs, int topk) -> (Tensor, Tensor)")
_DEF.define("sm100_mxfp8_grouped_gemm(Tensor[] a, Tensor[] sfa, Tensor[] b, Tensor[] sfb, Tensor(a!)[] out) -> ()")


@torch.library.register_fake("mok::forward")
def _forward_fake(x, topk_idx, topk_weight, w1, *args, **kwargs):
    return torch.empty_like(x), x.new_empty((len(w1),), dtype=torch.int32)


@torch.library.register_fake("mok::backward")
def _backward_fake(grad_out, x, topk_idx, topk_weight, combine, w1, *args, **kwargs):
    return (
        torch.empty_like(x),
        topk_weight.new_empty(topk_idx.shape, dtype=torch.float32),
        x.new_empty((len(w1),), dtype=torch.int32),
    )


@torch.library.register_fake("mok::wgrad")
def _wgrad_fake(*args, **kwargs) -> None:
    return None


@torch.library.register_fake("mok::fp8_quantize_weight")
def _fp8_quantize_weight_fake(w):
    N, K = w.shape
    return w.new_empty((N, K), dtype=torch.float8_e4m3fn), w.new_empty((N // 128, K // 128), dtype=torch.float32)


@torch.library.register_fake("mok::fp8_grouped_gemm")
def _fp8_grouped_gemm_fake(*args, **kwargs) -> None:
    return None


@torch.library.register_fake("mok::fp8_wgrad_gemm")
def _fp8_wgrad_gemm_fake(*args, **kwargs) -> None:
    return None


@torch.library.register_fake("mok::fp8_quantize_tokens")
def _fp8_quantize_tokens_fake(rows, counts, kcap, err):
    F = rows.shape[1]
    return rows.new_empty((F, kcap), dtype=torch.float8_e4m3fn), rows.new_empty((kcap // 128, F), dtype=torch.float32)


@torch.library.register_fake("mok::mxfp8_quantize_rows")
def _mxfp8_quantize_rows_fake(x, scale_layout):
    M, H = x.shape
    nkb = H // 32
    nbytes = -(-M // 128) * -(-nkb // 4) * 512
    sf = x.new_empty((M, nkb), dtype=torch.uint8) if scale_layout == 0 else x.new_empty((nbytes,), dtype=torch.uint8)
    return x.new_empty((M, H), dtype=torch.float8_e4m3fn), sf


# its gradient (to probs) is registered in C++ with the CUDA implementation (csrc/mok/apis/units.cpp): the op runs in
# front of every layer call, and a formula registered here would put a Python autograd layer on each call's path
@torch.library.register_fake("mok::topk_from_routing_map")
def _topk_from_routing_map_fake(routing_map, probs, topk):
    T = routing_map.shape[0]
    return routing_map.new_empty((T, topk), dtype=torch.int32), probs.new_empty((T, topk))


@torch.library.register_fake("mok::sm100_mxfp8_grouped_gemm")
def _sm100_fake(*args, **kwargs) -> None:
    return None


_lock = threading.Lock()
_loaded: dict[str, str] = {}


def load(which: str = "sm90") -> str:
    """Build (or reuse from the cache) and load the CUDA implementations: ``"sm90"`` the Hopper kernels (every
    operator but the sm_100 one), ``"sm100"`` the Blackwell unit. Returns the library's path; loads once per
    process. Raises ``build.BuildError`` naming what is missing. While torch.compile traces a call (no lock
    there), the library is the one a call before loaded, or none yet: tracing needs only the schemas."""
    if torch.compiler.is_compiling():
        return _loaded.get(which, "")
    with _lock:
        path = _loaded.get(which)
        if path is None:
            from . import build

            path = str(build.build_extension(which))
            torch.ops.load_library(path)
            _loaded[which] = path
        return path
