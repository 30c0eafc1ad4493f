"""FP8 (e4m3) block-scaled grouped GEMMs on Hopper: the unit kernels of the FP8 path.

``fp8_grouped_gemm`` runs ``csrc/mok/gemm/fp8_gemm.cuh`` (``mok::fp8_grouped_gemm``): for each expert's rows
(segments back to back from row 0) ``out = x @ w_e^T`` from e4m3 operands with DeepSeek-V3 block scales
(1 x 128 for activations, 128 x 128 for weights), fp32 accumulation with per-K-block scale promotion,
bf16 output. ``megatron_mok.fp8.fp8_linear`` is its oracle. The row counts are host integers here (a
unit kernel and benchmark); the fused FP8 expert FFN will take them from the in-kernel schedule.

``fp8_wgrad_gemm`` runs ``csrc/mok/gemm/fp8_wgrad_gemm.cuh`` (``mok::fp8_wgrad_gemm``): the weight gradients of
DeepSeek-V3's FP8 recipe, ``out_e (+)= a_e @ b_e^T`` reduced over expert e's tokens, both operands e4m3 with one
fp32 scale per 128 tokens of each row (``megatron_mok.fp8.fp8_wgrad_grouped`` is its oracle,
``quantize_tokens`` builds its operands from layout-order rows, as ``megatron_mok.fp8.token_major_operand`` does).
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
    _check_lazily(err, len(wq), timeout_ms, "fp8_grouped_gemm", "MoK fp8 GEMM")
    return out


def fp8_wgrad_gemm(
    a: torch.Tensor,
    sa: torch.Tensor,
    b: torch.Tensor,
    sb: torch.Tensor,
    counts: torch.Tensor | list[int],
    *,
    out: list[torch.Tensor] | None = None,
    accumulate: bool = False,
    timeout_ms: float = 10000.0,
) -> list[torch.Tensor]:
    """a e4m3 [M, Ktot], b e4m3 [N, Ktot] in the token-major layout (each expert's tokens padded to a multiple of 128,
    back to back from column 0: ``quantize_tokens``), sa fp32 [Ktot / 128, M], sb fp32 [Ktot / 128, N]; counts[e]
    tokens of expert e (a device int32 tensor needs no host sync; the kernel reports blocks past Ktot). Returns per
    expert the fp32 [M, N] ``a_e @ b_e^T`` over its token columns, written into ``out`` (allocated when None), or
    added to it with ``accumulate`` (a gradient buffer such as Megatron's ``main_grad``). An expert without tokens
    gets zeros, or is left as it was when accumulating."""
    ops.load()
    L = counts.numel() if isinstance(counts, torch.Tensor) else len(counts)
    if out is None:
        if accumulate:
            raise ValueError("fp8_wgrad_gemm: accumulate=True needs the buffers to add into (out=)")
        M = a.shape[0] if a.dim() == 2 else 0
        N = b.shape[0] if b.dim() == 2 else 0
        out = [torch.empty((M, N), dtype=torch.float32, device=a.device) for _ in range(L)]
    if not isinstance(counts, torch.Tensor):
        counts = [int(c) for c in counts]
        cols = sum(-(-c // BLOCK) * BLOCK for c in counts)
        if min(counts, default=0) < 0 or (a.dim() == 2 and cols > a.shape[1]):
            raise ValueError(
                f"fp8_wgrad_gemm: {counts} tokens per expert, padded to {BLOCK} each, need {cols} token columns; "
                f"a has {a.shape[1] if a.dim() == 2 else 0}"
            )
        counts = torch.tensor(counts, dtype=torch.int32, device=a.device)
    err = errors.new_record(a.device)
    torch.ops.mok.fp8_wgrad_gemm(a, sa, b, sb, counts, list(out), err, bool(accumulate), float(timeout_ms))
    _check_lazily(err, L, timeout_ms, "fp8_wgrad_gemm", "MoK fp8 wgrad GEMM")
    return list(out)


def token_major_capacity(rows: int, experts: int) -> int:
    """Token columns that hold ``rows`` layout-order rows of ``experts`` experts, each padded to 128 tokens."""
    return -(-(rows + 127 * experts) // BLOCK) * BLOCK


def quantize_tokens(rows: torch.Tensor, counts: torch.Tensor | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Layout-order bf16 rows [T, F] (experts back to back from row 0, counts[e] rows each) -> ``fp8_wgrad_gemm``'s
    operand: e4m3 [F, Kcap] token-contiguous, each expert's tokens padded with zeros to a multiple of 128 from column
    0, and fp32 scales [Kcap / 128, F] (``csrc/mok/quant/fp8_token_quant.cuh``; ``megatron_mok.fp8.
    token_major_operand`` computes the same numbers). Kcap is ``token_major_capacity(T, len(counts))``; columns past
    the experts' are left unwritten. Counts on the device (int32) need no host sync; ones that do not fit the rows
    are reported as the kernels' errors are, a host list is checked before the launch."""
    ops.load()
    T = rows.shape[0] if rows.dim() == 2 else 0
    if not isinstance(counts, torch.Tensor):
        counts = [int(c) for c in counts]
        if min(counts, default=0) < 0 or sum(counts) > T:
            raise ValueError(f"quantize_tokens: {T} rows cannot hold expert segments of {counts} rows")
        counts = torch.tensor(counts, dtype=torch.int32, device=rows.device)
    err = errors.new_record(rows.device)
    out = torch.ops.mok.fp8_quantize_tokens(rows, counts, token_major_capacity(T, counts.numel()), err)
    _check_lazily(err, counts.numel(), 0.0, "quantize_tokens", "MoK fp8 token quantiser")
    return out


def _check_lazily(err: torch.Tensor, experts: int, timeout_ms: float, op: str, kernel: str) -> None:
    """A unit's error record (an internal pipeline stall, or token counts that do not fit) read lazily, like the
    megakernels'."""
    message = lambda e: errors.format_error(e, 1, experts, timeout_ms, kernel=kernel, phases=errors.UNIT_PHASES)  # noqa: E731
    check = errors.capture_check("lazy", op)  # no event query while a CUDA graph captures
    errors.after_launch(err, None, check, message)  # launched on the current stream
