"""Pure-PyTorch reference of the MoK algorithm: the oracle for the CUDA megakernel.

Forward, per rank q (owner of local experts ``q*L .. q*L+L-1``):

1. **schedule**   -- all ranks' top-k routing is exchanged (small metadata); q computes its
                     :class:`~megatron_mok.layout.ExpertLayout` itself.
2. **pull dispatch** -- minibatch by minibatch, q reads the token rows it needs from the source
                     ranks into a fixed ring buffer of ``ring_slots`` slots.
3. **expert FFN** -- per expert segment of the minibatch: fc1 -> SwiGLU -> fc2.
4. **push combine** -- each result row goes straight to its home rank, into ``combine_buf[t, k]``;
                     the slot is then free for the next minibatch.
5. **weighted sum** -- at home: ``out[t] = sum_k w[t, k] * combine_buf[t, k]``.

Backward mirrors it: the router-weight gradient comes from ``combine_buf`` at home (no
communication); the owner *pulls* output-gradient rows (reverse combine), runs fc2^T,
SwiGLU backward and fc1^T plus both weight gradients, and *pushes* the input-row gradients home
(reverse dispatch), where they are summed over top-k.

Numerics follow the kernel: fp32 accumulation, the SwiGLU output and the expert output rounded
to the activation dtype, the top-k sum in fp32 in k order. In fp32 everything is exact fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from torch.utils import _pytree as pytree

from .activation import PLAIN, Glu, swiglu, swiglu_backward
from .layout import (
    FORWARD_TILE_ROWS,
    ExpertLayout,
    compute_layout,
    minibatches,
    num_minibatches,
    positions_by_rank,
    validate_routing,
)
from .plan import MokPlan, RingSpec
from .transport import Transport


class SlotState(Enum):
    FREE = 0
    FILLED = 1  # dispatch done, FFN may start
    COMPUTED = 2  # FFN done, combine may start


class RingBuffer:
    """Fixed token slots (one minibatch each) with the FREE -> FILLED -> COMPUTED -> FREE cycle.

    The reference runs the cycle in order; the state checks catch a schedule that would
    overwrite a slot whose combine has not finished -- the bug the kernel's flags guard against.
    """

    def __init__(
        self, spec: RingSpec, hidden: int, dtype: torch.dtype, device: torch.device, tile_rows: int = 1
    ) -> None:
        self.spec = spec
        # tile-aligned minibatches (layout.minibatches) hold up to minibatch_tokens + tile_rows - 1 rows
        rows = spec.minibatch_tokens + tile_rows - 1
        self.rows = torch.empty(spec.ring_slots, rows, hidden, dtype=dtype, device=device)
        self.state = [SlotState.FREE] * spec.ring_slots
        self.filled_count = 0  # how many minibatches went through (ring cycles = this / slots)

    def _move(self, slot: int, frm: SlotState, to: SlotState) -> None:
        if self.state[slot] is not frm:
            raise RuntimeError(f"ring slot {slot} is {self.state[slot].name}, expected {frm.name}")
        self.state[slot] = to

    def fill(self, slot: int, n: int) -> torch.Tensor:
        self._move(slot, SlotState.FREE, SlotState.FILLED)
        self.filled_count += 1
        return self.rows[slot, :n]

    def computed(self, slot: int) -> None:
        self._move(slot, SlotState.FILLED, SlotState.COMPUTED)

    def release(self, slot: int) -> None:
        self._move(slot, SlotState.COMPUTED, SlotState.FREE)


def _validate(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w1: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
    plan: MokPlan,
) -> None:
    if x.dim() != 2:
        raise ValueError(f"MoK input must be [tokens, hidden], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"MoK input dtype must be float32, bfloat16 or float16 (float64 for checks), got {x.dtype}")
    validate_routing(topk_idx, plan.num_experts)
    if topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"topk_idx has {topk_idx.shape[0]} tokens but the input has {x.shape[0]}")
    if topk_w.shape != topk_idx.shape:
        raise ValueError(f"topk weights shape {tuple(topk_w.shape)} != topk_idx shape {tuple(topk_idx.shape)}")
    if not topk_w.is_floating_point():
        raise TypeError(f"topk weights must be floating point, got {topk_w.dtype}")
    if plan.num_experts % plan.transport.world_size:
        raise ValueError(f"num_experts={plan.num_experts} is not divisible by EP size {plan.transport.world_size}")
    L = plan.num_local_experts
    if len(w1) != L or len(w2) != L:
        raise ValueError(f"expected {L} local experts' weights, got fc1 {len(w1)} / fc2 {len(w2)}")
    H = x.shape[1]
    for e, (a, b) in enumerate(zip(w1, w2)):
        if a.dim() != 2 or a.shape[1] != H or a.shape[0] % 2:
            raise ValueError(f"fc1 weight of local expert {e} must be [2*ffn, hidden={H}], got {tuple(a.shape)}")
        if b.shape != (H, a.shape[0] // 2):
            raise ValueError(
                f"fc2 weight of local expert {e} must be [hidden={H}, ffn={a.shape[0] // 2}], got {tuple(b.shape)}"
            )


def pull_into(
    tp: Transport, source: torch.Tensor, src_rank: torch.Tensor, index: torch.Tensor, out: torch.Tensor
) -> list[torch.Tensor]:
    """``out[i] = source[index[i]]`` read from rank ``src_rank[i]``'s ``source`` (each rank passes its
    own). Returns the per-rank positions, for the reverse move."""
    pos = positions_by_rank(src_rank, tp.world_size)
    got = tp.pull(source, [index[p] for p in pos])
    for p, rows in zip(pos, got):
        if p.numel():
            out[p.to(out.device)] = rows.to(out.dtype)
    return pos


def push_into(
    tp: Transport, rows: torch.Tensor, src_rank: torch.Tensor, where: torch.Tensor, dest: torch.Tensor
) -> list[torch.Tensor]:
    """Row i goes to ``dest[where[i]]`` on rank ``src_rank[i]`` (its home); every rank receives into
    its own ``dest``. Returns the per-rank positions of the sent rows."""
    pos = positions_by_rank(src_rank, tp.world_size)
    got_pos, got_rows = tp.push([rows[p] for p in pos], [where[p] for p in pos])
    for p, r in zip(got_pos, got_rows):
        if p.numel():
            dest[p.to(dest.device)] = r.to(dest.dtype)
    return pos


def _pull_rows(plan: MokPlan, layout: ExpertLayout, source: torch.Tensor, lo: int, hi: int, out: torch.Tensor) -> None:
    """Pull layout rows [lo, hi) from the source ranks' ``source`` into ``out`` (layout order)."""
    pull_into(plan.transport, source, layout.src_rank[lo:hi], layout.src_token[lo:hi], out)


def _push_rows(
    plan: MokPlan, layout: ExpertLayout, rows: torch.Tensor, lo: int, hi: int, topk: int, dest: torch.Tensor
) -> None:
    """Push result rows of layout rows [lo, hi) to their home ranks' ``dest`` [T*K, H] at t*K+k."""
    where = layout.src_token[lo:hi] * topk + layout.src_k[lo:hi]
    push_into(plan.transport, rows, layout.src_rank[lo:hi], where, dest)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 when checking in double precision."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_weights(layout: ExpertLayout, all_w: Sequence[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """Router weight w[t, k] of each layout row in [lo, hi) (from the exchanged metadata)."""
    src, tok, k = layout.src_rank[lo:hi], layout.src_token[lo:hi], layout.src_k[lo:hi]
    out = torch.zeros(hi - lo, dtype=all_w[0].dtype if all_w else torch.float32, device=src.device)
    for r, w in enumerate(all_w):
        sel = src == r
        if bool(sel.any()):
            out[sel] = w.to(out.device)[tok[sel], k[sel]]
    return out


@dataclass
class ReferenceState:
    """What the reference forward leaves its backward: the layout, every rank's top-k weights, the combine rows,
    the dispatched rows (and fc1 output when saved), the minibatch rounds every rank runs, and the sizes."""

    layout: ExpertLayout
    all_w: list[torch.Tensor]
    combine_buf: torch.Tensor
    saved_x: torch.Tensor
    saved_h: torch.Tensor | None
    rounds: int
    shape: tuple[int, int, int]  # T, K, H
    dtype: torch.dtype


pytree.register_dataclass(ReferenceState)  # its tensors are saved for the backward (function.MokMoEFunction)


def mok_forward(
    plan: MokPlan,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w1: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, ReferenceState]:
    """One rank's MoK forward. Returns ``out`` [T, H] and the state backward needs."""
    _validate(x, topk_idx, topk_w, w1, w2, plan)
    acc = _acc_dtype(x.dtype)
    tp = plan.transport
    T, H = x.shape
    K = topk_idx.shape[1]
    dtype = x.dtype
    # 1. schedule
    all_idx = tp.all_gather(topk_idx.to(torch.long))
    all_w = tp.all_gather(topk_w.detach().to(acc))
    layout = compute_layout(all_idx, tp.rank, plan.num_local_experts)
    plan.layout = layout
    N = layout.num_rows
    mb, slots = plan.ring.minibatch_tokens, plan.ring.ring_slots
    rounds = tp.all_reduce_max(num_minibatches(N, mb))
    ring = RingBuffer(plan.ring, H, dtype, x.device, tile_rows=FORWARD_TILE_ROWS)
    combine_buf = torch.zeros(T * K, H, dtype=dtype, device=x.device)
    saved_x = torch.empty(N, H, dtype=dtype, device=x.device)
    saved_h = torch.empty(N, w1[0].shape[0] if w1 else 0, dtype=acc, device=x.device) if plan.save_fc1_output else None
    # the forward kernel's minibatches: boundaries on each expert's GEMM tile grid
    batches = list(minibatches(N, mb, slots, layout.expert_offsets.tolist(), FORWARD_TILE_ROWS))
    for i in range(rounds):
        if i < len(batches):
            _, slot, lo, hi = batches[i]
            # 2. pull dispatch into the slot
            rows = ring.fill(slot, hi - lo)
            _pull_rows(plan, layout, x.detach(), lo, hi, rows)
            # 3. expert FFN, segment by segment
            y = torch.empty(hi - lo, H, dtype=dtype, device=x.device)
            for e, a, b in layout.segments(lo, hi):
                xe = rows[a - lo : b - lo]
                h = xe.to(acc) @ w1[e].detach().to(acc).t()
                act = swiglu(h, plan.glu).to(dtype)
                y[a - lo : b - lo] = (act.to(acc) @ w2[e].detach().to(acc).t()).to(dtype)
                if saved_h is not None:
                    saved_h[a:b] = h
            saved_x[lo:hi] = rows
            ring.computed(slot)
            # 4. push combine, then the slot is free for the next minibatch
            _push_rows(plan, layout, y, lo, hi, K, combine_buf)
            ring.release(slot)
        else:  # this rank has no more rows but still serves others' pulls/pushes
            _pull_rows(plan, layout, x.detach(), 0, 0, x.new_empty(0, H))
            _push_rows(plan, layout, x.new_empty(0, H), 0, 0, K, combine_buf)
    plan.stats = {"rows": N, "minibatches": len(batches), "rounds": rounds, "ring_fills": ring.filled_count}
    # 5. weighted top-k sum at home
    combine_buf = combine_buf.view(T, K, H)
    out = torch.einsum("tk,tkh->th", topk_w.detach().to(acc), combine_buf.to(acc)).to(dtype) if K else x.new_zeros(T, H)
    return out, ReferenceState(layout, all_w, combine_buf, saved_x, saved_h, rounds, (T, K, H), dtype)


def mok_backward(
    plan: MokPlan, state: ReferenceState, grad_out: torch.Tensor, w1: Sequence[torch.Tensor], w2: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Gradients (input, top-k weights, fc1 weights, fc2 weights) for one rank."""
    layout: ExpertLayout = state.layout
    T, K, H = state.shape
    dtype = state.dtype
    acc = _acc_dtype(dtype)
    grad_out = grad_out.contiguous()
    # router-weight gradient: local, from the combine buffer that stayed at home
    grad_w = torch.einsum("th,tkh->tk", grad_out.to(acc), state.combine_buf.to(acc))
    grad_w1 = [torch.zeros(w.shape, dtype=acc, device=w.device) for w in w1]
    grad_w2 = [torch.zeros(w.shape, dtype=acc, device=w.device) for w in w2]
    grad_buf = torch.zeros(T * K, H, dtype=acc, device=grad_out.device)
    N = layout.num_rows
    mb, slots = plan.ring.minibatch_tokens, plan.ring.ring_slots
    # the forward's minibatches (the backward kernel keeps i * M boundaries; no result depends on the cut
    # beyond fp32 rounding), so a recomputed fc1 output sees the forward's row groups: the same bits
    batches = list(minibatches(N, mb, slots, layout.expert_offsets.tolist(), FORWARD_TILE_ROWS))
    ring = RingBuffer(plan.ring, H, grad_out.dtype, grad_out.device, tile_rows=FORWARD_TILE_ROWS)
    for i in range(state.rounds):
        if i >= len(batches):
            _pull_rows(plan, layout, grad_out, 0, 0, grad_out.new_empty(0, H))
            _push_rows(plan, layout, grad_buf.new_empty(0, H), 0, 0, K, grad_buf)
            continue
        _, slot, lo, hi = batches[i]
        # pull reverse-combine: output-gradient rows of the rows this rank computed
        gy_rows = ring.fill(slot, hi - lo)
        _pull_rows(plan, layout, grad_out, lo, hi, gy_rows)
        gy = gy_rows.to(acc) * _row_weights(layout, state.all_w, lo, hi).to(gy_rows.device).unsqueeze(1)
        dx = torch.empty(hi - lo, H, dtype=acc, device=grad_out.device)
        for e, a, b in layout.segments(lo, hi):
            xe = state.saved_x[a:b].to(acc)
            h = state.saved_h[a:b] if state.saved_h is not None else xe @ w1[e].detach().to(acc).t()
            if not plan.glu.plain:
                # the clamp's gradient mask is decided on the fc1 output in the activation dtype, as Megatron's
                # experts (their fc1 output is bf16) and the kernel (bf16 h, saved or rounded) decide it
                h = h.to(dtype).to(acc)
            act = swiglu(h, plan.glu).to(dtype).to(acc)
            g = gy[a - lo : b - lo]
            grad_w2[e] += g.t() @ act
            da = g @ w2[e].detach().to(acc)
            dh = swiglu_backward(h, da, plan.glu)
            grad_w1[e] += dh.t() @ xe
            dx[a - lo : b - lo] = dh @ w1[e].detach().to(acc)
        ring.computed(slot)
        # push reverse-dispatch: input-row gradients straight to the home rank
        _push_rows(plan, layout, dx, lo, hi, K, grad_buf)
        ring.release(slot)
    grad_x = grad_buf.view(T, K, H).sum(1).to(dtype)
    return (
        grad_x,
        grad_w,
        grad_w1,  # fp32: the autograd node casts, or accumulates into Megatron's fp32 main_grad
        grad_w2,
    )


def dense_moe_reference(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w1_all: Sequence[torch.Tensor],
    w2_all: Sequence[torch.Tensor],
    glu: Glu = PLAIN,
) -> torch.Tensor:
    """Token-by-token definition with all experts' weights at hand (no EP): the plain math."""
    acc = _acc_dtype(x.dtype)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=acc, device=x.device)
    for k in range(topk_idx.shape[1]):
        for e in topk_idx[:, k].unique().tolist():
            if e < 0:
                continue
            sel = topk_idx[:, k] == e
            h = x[sel].to(acc) @ w1_all[e].to(acc).t()
            y = (swiglu(h, glu).to(x.dtype).to(acc) @ w2_all[e].to(acc).t()).to(x.dtype)
            out[sel] += topk_w[sel, k].to(acc).unsqueeze(1) * y.to(acc)
    return out.to(x.dtype)


# ---- unfused building blocks (MoKTokenDispatcher with Megatron's own experts) -------------


class PullRows(torch.autograd.Function):
    """Differentiable pull of layout rows from the source ranks: backward pushes gradients home."""

    @staticmethod
    def forward(ctx, source: torch.Tensor, layout: ExpertLayout, transport: Transport, row_of_token):  # type: ignore[override]
        # ``row_of_token(src_token, src_k)`` -> row index into ``source`` on the source rank.
        tp = transport
        idx = row_of_token(layout.src_token, layout.src_k)
        out = source.new_empty((layout.num_rows, *source.shape[1:]))
        pos = pull_into(tp, source.detach(), layout.src_rank, idx, out)
        ctx.tp, ctx.pos, ctx.idx = tp, pos, idx
        ctx.source_shape = source.shape
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        got_pos, got_rows = ctx.tp.push([grad[p] for p in ctx.pos], [ctx.idx[p] for p in ctx.pos])
        g = grad.new_zeros(ctx.source_shape, dtype=torch.float32)
        for p, r in zip(got_pos, got_rows):  # rank order: deterministic sum over top-k duplicates
            if p.numel():
                g.index_add_(0, p.to(g.device), r.float())
        return g.to(grad.dtype), None, None, None


class PushRows(torch.autograd.Function):
    """Differentiable push of result rows to ``dest[t*K + k]`` on their home ranks."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, layout: ExpertLayout, transport: Transport, topk: int, num_tokens: int):  # type: ignore[override]
        where = layout.src_token * topk + layout.src_k
        dest = rows.new_zeros((num_tokens * topk, *rows.shape[1:]))
        push_into(transport, rows, layout.src_rank, where, dest)
        ctx.tp, ctx.src_rank, ctx.where, ctx.rows_shape = transport, layout.src_rank, where, rows.shape
        return dest

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        g = grad.new_zeros(ctx.rows_shape)
        pull_into(ctx.tp, grad.contiguous(), ctx.src_rank, ctx.where, g)  # pull reverse-combine
        return g, None, None, None, None


class ReferenceBackend:
    """The pure-PyTorch MoK backend (CPU or GPU, any torch.distributed backend): the reference algorithm behind the
    ``function.MokBackend`` interface."""

    name = "reference"

    def __init__(self, reason: str | None = None) -> None:
        #: why the layer runs the reference rather than the kernel (None: asked for directly)
        self.reason = reason

    def forward(self, plan: MokPlan, x, topk_idx, topk_w, w1, w2) -> tuple[torch.Tensor, ReferenceState]:
        return mok_forward(plan, x, topk_idx, topk_w, w1, w2)

    def backward(self, plan: MokPlan, state: ReferenceState, grad_out, w1, w2, main_grads=None):
        """main_grads: unsupported here (the autograd node adds the returned gradients into main_grad itself)."""
        return mok_backward(plan, state, grad_out, w1, w2)

    @staticmethod
    def can_accumulate_main_grad(main_grads) -> bool:
        return False
