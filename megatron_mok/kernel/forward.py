"""ctypes binding of the MoK forward megakernel and the emulated-EP entry point.

Emulated EP: R virtual ranks share ONE GPU and ONE kernel launch; the grid is split into R
partitions, each with its own comm/compute SMs, and each rank reaches the others' buffers only
through a per-rank pointer table (what peer pointers of torch symmetric memory would be with real EP).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ..activation import Glu
from .host.cargs import ForwardTuning, LaunchArrays, bind_glu, bind_tuning
from .host.errors import MokKernelError, format_error, raise_recorded_error
from .host.library import _Args, load_library
from .host.weight_memo import dense_weight_pointers

MOK_MAX_RANKS = 72
MOK_MAX_LOCAL_EXPERTS = 512
MOK_MAX_SLOTS = 64

_PHASES = {
    1: "grid barrier (schedule)",
    2: "dispatch-ready (compute waits for the pull dispatch of the slot)",
    3: "slot-free (dispatch waits for combine to release the slot)",
    4: "fc1-done (fc2 waits for fc1 of its row block)",
    5: "compute-done (final combine waits for all ranks' expert pushes)",
    6: "internal smem pipeline",
    7: "schedule",
    8: "peer start signal (a peer rank has not launched this call)",
    9: "peer compute-done signal (a peer rank has not finished its experts)",
    10: "peer token count",
    12: "chunk-done (a token chunk's final sum waits for the pushes of its minibatches, kernel.macrobatches)",
    13: "peer source-quantised signal (a peer rank has not written its tokens' e4m3 copy for the FP8 forward)",
}


@dataclass
class KeptRows:
    """The expert input and SwiGLU output rows a bf16 forward launch keeps for the backward.

    x [parts, rows, H] and act [parts, rows, F] bf16 (parts: the launch's owner ranks, R emulated or 1 per
    rank) stand in for the forward's ring: minibatch i of owner p lands at rows [i*M, (i+1)*M) of part p,
    i.e. in layout order, so the backward reads xl / act there instead of pulling x again and recomputing
    act from h (the rows Megatron's grouped GEMM keeps for its wgrad too). ``rows`` is a multiple of the
    forward's minibatch and the owner capacity: a routing that sends an owner more rows is a kernel error.
    """

    x: torch.Tensor
    act: torch.Tensor
    minibatch: int
    #: set by the forward launch that lays the rows out (the backward refuses rows never written)
    filled: bool = False

    @staticmethod
    def allocate(parts: int, owner_rows: int, H: int, F: int, minibatch: int, device) -> KeptRows:
        rows = max(1, -(-owner_rows // minibatch)) * minibatch
        bf = dict(dtype=torch.bfloat16, device=device)
        return KeptRows(torch.empty((parts, rows, H), **bf), torch.empty((parts, rows, F), **bf), minibatch)

    @property
    def rows(self) -> int:
        return int(self.x.shape[1])

    def check_storage(self, device, fail) -> None:
        """Both buffers contiguous bf16 [parts, rows, n] tensors on ``device`` (forward and backward)."""
        for name, t in (("x", self.x), ("act", self.act)):
            if t.dtype != torch.bfloat16 or t.device != device or not t.is_contiguous() or t.dim() != 3:
                fail(f"kept {name} must be a contiguous bf16 tensor on {device}")

    def check(self, parts: int, H: int, F: int, minibatch: int, device, fail) -> None:
        if minibatch != self.minibatch:
            fail(f"kept rows were allocated for minibatch {self.minibatch}, this launch uses {minibatch}")
        self.check_storage(device, fail)
        P, rows = parts, self.rows
        for name, t, n in (("x", self.x, H), ("act", self.act, F)):
            if tuple(t.shape) != (P, rows, n):
                fail(f"kept {name} must be [{P}, {rows}, {n}], got {tuple(t.shape)}")
        if rows % minibatch:
            fail(f"kept rows ({rows}) must be a multiple of the minibatch ({minibatch})")

    def bind(self, args, parts: int, H: int, F: int, minibatch: int, device, fail, fp8) -> None:
        """Checks and puts these buffers into a forward launch's args (before its workspace is sized:
        they replace the ring)."""
        if fp8 is not None:
            fail("keep: the kept rows are bf16; the fp8 kernel keeps none (its backward pulls x again)")
        self.check(parts, H, F, minibatch, device, fail)
        args.keep_x, args.keep_act, args.keep_rows = self.x.data_ptr(), self.act.data_ptr(), self.rows


_ws_cache: dict[int, torch.Tensor] = {}
_err_cache: dict[int, torch.Tensor] = {}
_sm_count: dict[int, int] = {}  # per device: its SM count (asked once, not on every launch)


def _fail(msg: str) -> None:
    raise ValueError(f"mok_forward_emulated: {msg}")


def rejection(lib, args) -> str:
    """The library's reason for refusing a launch struct (mok_workspace_bytes returned -1)."""
    ebuf = ctypes.create_string_buffer(1024)
    lib.mok_forward_check(ctypes.byref(args), ebuf, 1024)
    return ebuf.value.decode(errors="replace") or "rejected by the library"


def capturing(device=None) -> bool:
    """Whether the current CUDA stream (of ``device``, default the current device) is capturing a CUDA
    graph (False without CUDA)."""
    if not torch.cuda.is_available():
        return False
    if device is not None and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()
    return torch.cuda.is_current_stream_capturing()


def capture_check(check, who: str):
    """The error check a launch can run. While the current stream captures a CUDA graph the host can
    neither synchronise (check=True) nor poll the lazy reader's events: ``"lazy"`` becomes no check (a
    captured launch still writes its error record on every replay; read it with ``check_last_error()``
    after one), True is an error naming the fix."""
    if check and capturing():
        if check == "lazy":
            return False
        raise ValueError(
            f"{who}: check=True synchronises the host, which CUDA graph capture forbids: capture with "
            "check='lazy' or check=False and call megatron_mok.kernel.check_last_error() after a replay"
        )
    return check


def auto_ctas_per_rank(n_sms: int, parts: int) -> int:
    """CTAs per rank partition when the caller leaves it to the launcher (csrc/mok/host/forward.cu: forward_launch): all
    SMs split evenly."""
    return n_sms // parts


def launch_workspace(cache: dict[int, torch.Tensor], dev: int, nbytes: int, device) -> torch.Tensor:
    """The device workspace of one launch (at least ``nbytes``).

    Eager launches share one cached buffer per device, grown when a launch needs more (stream-ordered: the
    caching allocator frees the old one after the launches queued on it). A launch being captured into a
    CUDA graph gets a buffer of its own from the graph's private pool instead: the graph's kernel node keeps
    its address for every replay, so the buffer must neither be freed when a later eager launch grows the
    cache nor be rewritten by eager launches (or another graph's replays) queued between two replays."""
    if capturing(device):
        return torch.empty((max(nbytes, 1) + 4096,), dtype=torch.uint8, device=device)
    ws = cache.get(dev)
    if ws is None or ws.numel() < nbytes:
        cache.pop(dev, None)
        ws = torch.empty((max(nbytes, 1) + 4096,), dtype=torch.uint8, device=device)
        cache[dev] = ws
    return ws


def refuse_capture(who: str, why: str) -> None:
    """A clear error for a launch that a CUDA graph cannot replay correctly."""
    if capturing():
        raise ValueError(f"{who} cannot be captured in a CUDA graph: {why}")


def _check_tensor(t, name, dtype, ndim, device):
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        _fail(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        _fail(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.device != device:
        _fail(f"{name} is on {t.device}, expected {device}")


def _check_expert_weights(w1, w2, R: int, L: int, H: int, F: int, device) -> None:
    """bf16 expert weights w1[q][e] [2F, H] / w2[q][e] [H, F]: the detailed checks (first failure named)."""
    for q in range(R):
        if (
            not isinstance(w1[q], (list, tuple))
            or len(w1[q]) != L
            or not isinstance(w2[q], (list, tuple))
            or len(w2[q]) != L
        ):
            _fail(f"w1[{q}] and w2[{q}] must each hold {L} expert weights")
        for e in range(L):
            a, b = w1[q][e], w2[q][e]
            _check_tensor(a, f"w1[{q}][{e}]", torch.bfloat16, 2, device)
            _check_tensor(b, f"w2[{q}][{e}]", torch.bfloat16, 2, device)
            if tuple(a.shape) != (2 * F, H):
                _fail(f"w1[{q}][{e}] must be [2F, H] = [{2 * F}, {H}], got {tuple(a.shape)}")
            if tuple(b.shape) != (H, F):
                _fail(f"w2[{q}][{e}] must be [H, F] = [{H}, {F}], got {tuple(b.shape)}")
            for n, t in ((f"w1[{q}][{e}]", a), (f"w2[{q}][{e}]", b)):
                if t.stride(1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16:
                    _fail(
                        f"{n} needs unit inner stride, a row stride that is a multiple of 8 elements and a "
                        f"16-byte aligned start (got strides {t.stride()})"
                    )


def _validate(
    x, topk_idx, topk_weight, w1, w2, comm_sms, ring_slots, minibatch_tokens, timeout_ms, debug_stall, fp8=None
):
    if not isinstance(x, (list, tuple)) or len(x) == 0:
        _fail("x must be a non-empty list of per-rank tensors")
    R = len(x)
    if R > MOK_MAX_RANKS:
        _fail(f"at most {MOK_MAX_RANKS} ranks, got {R}")
    for name, lst in (("topk_idx", topk_idx), ("topk_weight", topk_weight), ("w1", w1), ("w2", w2)):
        if not isinstance(lst, (list, tuple)) or len(lst) != R:
            _fail(f"{name} must be a list of {R} entries (one per rank)")
    device = x[0].device if isinstance(x[0], torch.Tensor) else None
    if device is None or device.type != "cuda":
        _fail("x[0] must be a CUDA tensor")
    if not isinstance(w1[0], (list, tuple)) or len(w1[0]) == 0:
        _fail("w1[q] must be a non-empty list of per-expert weights")
    L = len(w1[0])
    if L > MOK_MAX_LOCAL_EXPERTS:
        _fail(f"at most {MOK_MAX_LOCAL_EXPERTS} local experts, got {L}")
    _check_tensor(
        w2[0][0] if isinstance(w2[0], (list, tuple)) and w2[0] else None, "w2[0][0]", torch.bfloat16, 2, device
    )
    H, F = w2[0][0].shape
    if H % 64 or F % 64 or H == 0 or F == 0:
        _fail(f"hidden ({H}) and ffn ({F}) sizes must be positive multiples of 64")
    K = None
    for r in range(R):
        _check_tensor(x[r], f"x[{r}]", torch.bfloat16, 2, device)
        T = x[r].shape[0]
        if x[r].shape[1] != H:
            _fail(f"x[{r}] has hidden size {x[r].shape[1]}, experts have {H}")
        if not x[r].is_contiguous():
            _fail(f"x[{r}] must be contiguous")
        _check_tensor(topk_idx[r], f"topk_idx[{r}]", torch.int32, 2, device)
        _check_tensor(topk_weight[r], f"topk_weight[{r}]", torch.float32, 2, device)
        if K is None:
            K = topk_idx[r].shape[1]
        if tuple(topk_idx[r].shape) != (T, K) or tuple(topk_weight[r].shape) != (T, K):
            _fail(
                f"rank {r}: topk_idx {tuple(topk_idx[r].shape)} / topk_weight {tuple(topk_weight[r].shape)} "
                f"must both be ({T}, {K}) (K must be the same on every rank)"
            )
        if not topk_idx[r].is_contiguous() or not topk_weight[r].is_contiguous():
            _fail(f"topk_idx[{r}] and topk_weight[{r}] must be contiguous")
    if K < 1 or K > 64:
        _fail(f"top-k must be in [1, 64], got {K}")
    if fp8 is not None:
        # the FP8 kernel reads only the e4m3 copies (checked against H / F in set_expert_weights); the bf16
        # masters give the sizes. Checking all of them too cost ~0.5 us per tensor per call (DeepSeek-V3
        # slice: 64 tensors) for weights the launch never touches.
        for q in range(R):
            if not all(isinstance(w[q], (list, tuple)) and len(w[q]) == L for w in (w1, w2)):
                _fail(f"w1[{q}] and w2[{q}] must each hold {L} expert weights")
        dense = None
    else:
        dense = (
            dense_weight_pointers(w1, R, L, torch.bfloat16, (2 * F, H), device),
            dense_weight_pointers(w2, R, L, torch.bfloat16, (H, F), device),
        )
        if dense[0] is None or dense[1] is None:
            _check_expert_weights(w1, w2, R, L, H, F, device)
            dense = None
    if not isinstance(comm_sms, int) or comm_sms < 0:
        _fail(f"comm_sms must be an int >= 0 (0: pull on the compute SMs' spare warps), got {comm_sms!r}")
    if not isinstance(ring_slots, int) or not 1 <= ring_slots <= MOK_MAX_SLOTS:
        _fail(f"ring_slots must be an int in [1, {MOK_MAX_SLOTS}], got {ring_slots!r}")
    if not isinstance(minibatch_tokens, int) or minibatch_tokens < 1:
        _fail(f"minibatch_tokens must be an int >= 1, got {minibatch_tokens!r}")
    if not timeout_ms > 0:
        _fail(f"timeout_ms must be > 0, got {timeout_ms!r}")
    if debug_stall is not None:
        sr, ss = debug_stall
        if not (0 <= sr < R and 0 <= ss < ring_slots):
            _fail(f"debug_stall {debug_stall} out of range (R={R}, ring_slots={ring_slots})")
    return R, L, H, F, K, device, dense


def set_expert_weights(
    args, arrays: LaunchArrays, w1, w2, fp8, ranks, L: int, H: int, F: int, device, dense=None
) -> None:
    """Expert weight pointers of the owner ranks ``ranks`` (this launch's) into the launch struct: the
    bf16 weights w1[q] / w2[q], or with ``fp8`` (Fp8ExpertWeights holding exactly len(w1) ranks, like
    w1 / w2) the e4m3 copies and their scales. ``dense``: the caller's ``dense_weight_pointers`` of w1 and
    w2 when it already took them (its checks), so they are not looked up twice."""
    ranks = list(ranks)
    nranks = len(w1)

    def of_ranks(ptrs: tuple[int, ...]) -> list[int]:  # rank-major R x L -> this launch's ranks
        return [p for q in ranks for p in ptrs[q * L : (q + 1) * L]]

    if fp8 is None:
        args.fp8 = 0
        p1, p2 = dense or (
            dense_weight_pointers(w1, nranks, L, torch.bfloat16, (2 * F, H), device),
            dense_weight_pointers(w2, nranks, L, torch.bfloat16, (H, F), device),
        )
        if p1 is not None and p2 is not None:  # contiguous: row strides H and F
            args.w1, args.w2 = arrays.u64(of_ranks(p1)), arrays.u64(of_ranks(p2))
            args.w1_ld, args.w2_ld = arrays.i64([H] * (len(ranks) * L)), arrays.i64([F] * (len(ranks) * L))
            return
        args.w1 = arrays.u64([w1[q][e].data_ptr() for q in ranks for e in range(L)])
        args.w1_ld = arrays.i64([w1[q][e].stride(0) for q in ranks for e in range(L)])
        args.w2 = arrays.u64([w2[q][e].data_ptr() for q in ranks for e in range(L)])
        args.w2_ld = arrays.i64([w2[q][e].stride(0) for q in ranks for e in range(L)])
        return
    from .quant import Fp8ExpertWeights

    if not isinstance(fp8, Fp8ExpertWeights):
        _fail(f"fp8 must be an Fp8ExpertWeights (megatron_mok.kernel.quant), got {type(fp8).__name__}")
    ptrs = fp8.validate(nranks, L, H, F, device)
    args.fp8 = 1
    args.w1 = arrays.u64(of_ranks(ptrs["w1q"]))
    args.w1_ld = arrays.i64([H] * (len(ranks) * L))
    args.w2 = arrays.u64(of_ranks(ptrs["w2q"]))
    args.w2_ld = arrays.i64([F] * (len(ranks) * L))
    args.w1s = arrays.u64(of_ranks(ptrs["w1s"]))
    args.w2s = arrays.u64(of_ranks(ptrs["w2s"]))


def _error_message(err: list[int], R: int, L: int, timeout_ms: float) -> str:
    return format_error(err, R, L, timeout_ms, kernel="MoK kernel", phases=_PHASES)


def mok_forward_emulated(
    x,
    topk_idx,
    topk_weight,
    w1,
    w2,
    *,
    comm_sms: int,
    ring_slots: int,
    minibatch_tokens: int,
    timeout_ms: float = 10000.0,
    debug_stall: tuple[int, int] | None = None,
    ctas_per_rank: int = 0,
    check: bool | str = True,
    timeline=None,
    saved_h=None,
    fp8=None,
    keep: KeptRows | None = None,
    gpu_events=None,
    glu: Glu | None = None,
    tuning: ForwardTuning | None = None,
):
    """Fused MoE forward over R emulated EP ranks in one kernel launch. See package docstring.

    saved_h: optional list of R bf16 tensors [>= sum_r T_r * K, 2F]; owner q's fc1 output h = [gate | up]
    lands in saved_h[q] in layout order, for ``mok_backward_emulated(..., saved_h=...)`` (no fc1 recompute).
    fp8: optional ``Fp8ExpertWeights`` (quant.py) of w1 / w2: runs the FP8 kernel (e4m3 with 1 x 128
    activation and 128 x 128 weight block scales, activations quantised in the pull and the SwiGLU
    epilogue, fp32 accumulation, bf16 outputs); w1 / w2 then only give the shapes.
    keep: optional ``KeptRows`` (R parts, rows >= sum_r T_r * K): the launch keeps the expert input and
    SwiGLU output rows there, for ``mok_backward_emulated(..., kept=keep)`` (bf16 only).
    glu: the SwiGLU variant (clamp / offset, ``megatron_mok.activation.Glu``); None: plain SwiGLU.
    tuning: the config's ``ForwardTuning`` (ticket order, token chunks, fast SiLU); None: the defaults.
    gpu_events: optional ``(start, end)`` pair of ``torch.cuda.Event``: recorded on the launch stream just
    before and after the library enqueues its work (metadata upload, zeroing, kernel), so their elapsed
    time is the layer's device time without this call's host preparation (which a CUDA-event pair around
    the whole call includes whenever the GPU was idle when the call began).
    """
    R, L, H, F, K, device, dense = _validate(
        x, topk_idx, topk_weight, w1, w2, comm_sms, ring_slots, minibatch_tokens, timeout_ms, debug_stall, fp8
    )
    check = capture_check(check, "mok_forward_emulated")
    if timeline is not None:
        refuse_capture("a timeline launch", "its event buffer is read back after each launch")
    lib = load_library()
    dev = device.index if device.index is not None else torch.cuda.current_device()
    n_sms = _sm_count.get(dev)
    if n_sms is None:
        num_sms, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if lib.mok_device_info(dev, ctypes.byref(num_sms), ctypes.byref(major), ctypes.byref(minor)) != 0:
            raise MokKernelError("cannot query the CUDA device")
        n_sms = _sm_count[dev] = num_sms.value
    cpr = ctas_per_rank or auto_ctas_per_rank(n_sms, R)
    if comm_sms >= cpr:
        _fail(f"comm_sms={comm_sms} leaves no compute SM: {R} rank(s) on {n_sms} SMs give {cpr} SMs per rank")

    Ts = [int(t.shape[0]) for t in x]
    out = [torch.empty((T, H), dtype=torch.bfloat16, device=device) for T in Ts]
    comb = [torch.empty((T, K, H), dtype=torch.bfloat16, device=device) for T in Ts]
    tpe = [torch.empty((L,), dtype=torch.int32, device=device) for _ in range(R)]

    arrays = LaunchArrays()  # host arrays the struct points at, alive until the launch returned
    arr, arr_i64 = arrays.u64, arrays.i64

    args = _Args()
    args.rank = -1  # all R ranks in this launch (sizes the workspace for R partitions)
    args.R, args.L, args.H, args.F, args.K = R, L, H, F, K
    args.comm_sms, args.ring_slots, args.minibatch = comm_sms, ring_slots, minibatch_tokens
    args.ctas_per_rank = cpr
    args.stall_rank, args.stall_slot = debug_stall if debug_stall is not None else (-1, -1)
    args.device = dev
    args.timeout_ms = float(timeout_ms)
    args.T = arr_i64(Ts)
    args.x = arr([t.data_ptr() for t in x])
    args.idx = arr([t.data_ptr() for t in topk_idx])
    args.w = arr([t.data_ptr() for t in topk_weight])
    args.out = arr([t.data_ptr() for t in out])
    args.combine = arr([t.data_ptr() for t in comb])
    args.tpe = arr([t.data_ptr() for t in tpe])
    set_expert_weights(args, arrays, w1, w2, fp8, range(R), L, H, F, device, dense)
    bind_glu(args, glu)
    bind_tuning(args, tuning)

    if keep is not None:
        keep.bind(args, R, H, F, minibatch_tokens, device, _fail, fp8)
        if keep.rows < sum(Ts) * K:
            _fail(f"keep has {keep.rows} rows per owner, every routed row may land on one owner: need {sum(Ts) * K}")
    nbytes = lib.mok_workspace_bytes(ctypes.byref(args))
    if nbytes < 0:
        _fail(f"invalid launch: {rejection(lib, args)}")
    ws = launch_workspace(_ws_cache, dev, nbytes, device)
    err = _err_cache.get(dev)
    if err is None:
        err = torch.zeros((16,), dtype=torch.int32, device=device)
        _err_cache[dev] = err
    args.workspace = ws.data_ptr()
    args.workspace_bytes = ws.numel()
    args.err = err.data_ptr()
    if timeline is not None:  # megatron_mok.kernel.timeline.Timeline
        args.timeline, args.timeline_count, args.timeline_cap = timeline.prepare(R * cpr, device)
    if saved_h is not None:
        rows = sum(Ts) * K
        if not isinstance(saved_h, (list, tuple)) or len(saved_h) != R:
            _fail(f"saved_h must be a list of {R} tensors (one per owner rank) or None")
        for q, t in enumerate(saved_h):
            _check_tensor(t, f"saved_h[{q}]", torch.bfloat16, 2, device)
            if t.shape[0] < rows or t.shape[1] != 2 * F or not t.is_contiguous():
                _fail(f"saved_h[{q}] must be contiguous [>= {rows}, {2 * F}], got {tuple(t.shape)}")
        args.saved_h = arr([t.data_ptr() for t in saved_h])
        args.saved_h_rows = min(int(t.shape[0]) for t in saved_h)

    stream = torch.cuda.current_stream(device)
    ebuf = ctypes.create_string_buffer(1024)
    if gpu_events is not None:
        gpu_events[0].record(stream)
    rc = lib.mok_forward_emulated_launch(ctypes.byref(args), ctypes.c_void_p(stream.cuda_stream), ebuf, 1024)
    if gpu_events is not None:
        gpu_events[1].record(stream)
    if rc != 0:
        raise MokKernelError(f"MoK launch failed: {ebuf.value.decode(errors='replace')}")
    if keep is not None:
        keep.filled = True  # this launch lays the rows out (stream-ordered before any backward)
    if check == "lazy":
        _lazy_checker(dev).after_launch(err, stream, R=R, L=L, timeout_ms=timeout_ms)
    elif check:
        check_last_error(device, R=R, L=L, timeout_ms=timeout_ms)
    return out, comb, tpe


class _LazyErrorChecker:
    """Reads kernel error records without synchronising the host.

    After each launch the 16-int error record is copied (async, same stream, so before the next
    launch re-zeroes it) into a pinned host slot, with an event. ``poll`` raises for any finished
    launch that recorded an error; ``drain`` waits for all of them. The next MoK call polls, so a
    timeout surfaces at the latest one call later -- with the rank and slot it names.
    """

    SLOTS = 64

    def __init__(self) -> None:
        self.host = torch.zeros((self.SLOTS, 16), dtype=torch.int32).pin_memory()
        self.pending: list[tuple[int, torch.cuda.Event, tuple]] = []  # (slot, event, (fmt, (R, L, timeout)))
        self.next = 0

    def after_launch(self, err: torch.Tensor, stream, *, R: int, L: int, timeout_ms: float, fmt=None) -> None:
        """fmt(record, R, L, timeout_ms) -> text: the launching kernel's wording (default: the forward's)."""
        self.poll()
        if len(self.pending) >= self.SLOTS:  # never overwrite an unread record
            self.drain()
        slot = self.next
        self.next = (self.next + 1) % self.SLOTS
        with torch.cuda.stream(stream):
            self.host[slot].copy_(err, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        self.pending.append((slot, ev, (fmt or _error_message, (R, L, timeout_ms))))

    def poll(self, wait: bool = False) -> None:
        still = []
        error = None
        for slot, ev, (fmt, meta) in self.pending:
            if wait:
                ev.synchronize()
            if not ev.query():
                still.append((slot, ev, (fmt, meta)))
                continue
            vals = self.host[slot].tolist()
            if vals[0] != 0 and error is None:
                error = fmt(vals, *meta)
        self.pending = still
        if error is not None:
            raise MokKernelError(error)

    def drain(self) -> None:
        self.poll(wait=True)


_lazy: dict[int, _LazyErrorChecker] = {}


def _lazy_checker(dev: int) -> _LazyErrorChecker:
    if dev not in _lazy:
        _lazy[dev] = _LazyErrorChecker()
    return _lazy[dev]


def check_pending_errors(wait: bool = False) -> None:
    """Raise MokKernelError if a launch made with ``check="lazy"`` recorded an error
    (``wait=True`` waits for all such launches first)."""
    for checker in _lazy.values():
        checker.poll(wait=wait)


def check_last_error(device=None, *, R: int = 0, L: int = 0, timeout_ms: float = 0.0) -> None:
    """Synchronize the current stream and raise MokKernelError if the last launch recorded an error."""
    raise_recorded_error(_err_cache, device, lambda vals: _error_message(vals, R, L, timeout_ms))
