"""FP8 (e4m3) block-scaled grouped GEMM on Hopper: the unit kernel of the FP8 path.

``fp8_grouped_gemm`` runs ``csrc/mok/gemm/fp8_gemm.cuh`` (``mok::fp8_grouped_gemm``): for each expert's rows
(segments back to back from row 0) ``out = x @ w_e^T`` from e4m3 operands with DeepSeek-V3 block scales
(1 x 128 for activations, 128 x 128 for weights), fp32 accumulation with per-K-block scale promotion,
bf16 output. ``megatron_mok.fp8.fp8_linear`` is its oracle. The row counts are host integers here (a
unit kernel and benchmark); the fused FP8 expert FFN will take them from the in-kernel schedule.
"""

from __future__ import annotations

import torch

from . import errors, ops

BLOCK = 128


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
    [rows, N] (rows past the last expert are left as they were in ``out``). Every argument is checked by the
    operator; its error record (an internal pipeline stall) is read lazily, like the megakernels'."""
    ops.load()
    rows = xq.shape[0] if xq.dim() == 2 else 0
    N = wq[0].shape[0] if wq and wq[0].dim() == 2 else 0
    if out is None:
        out = torch.empty((rows, N), dtype=torch.bfloat16, device=xq.device)
    err = errors.new_record(xq.device)
    torch.ops.mok.fp8_grouped_gemm(xq, xs, list(wq), list(ws), [int(c) for c in counts], out, err, float(timeout_ms))
    message = lambda e: errors.format_error(  # noqa: E731
        e, 1, len(wq), timeout_ms, kernel="MoK fp8 GEMM", phases={6: "internal smem pipeline"}
    )
    check = errors.capture_check("lazy", "fp8_grouped_gemm")  # no event query while a CUDA graph captures
    errors.after_launch(err, None, check, message)  # launched on the current stream
    return out
