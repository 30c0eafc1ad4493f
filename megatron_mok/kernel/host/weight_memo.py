"""Expert-weight checks remembered across launches.

Every launch checks each local expert weight (type, dtype, shape, device, contiguity, alignment) and
hands the library its device pointer. That is several Python attribute reads per tensor: with 32 local
experts and FP8 (e4m3 weights, their scales and the bf16 masters that give the shapes) a quarter of a
millisecond per call on the H200's host, a few percent of a DeepSeek-V3 slice's layer time whenever the
GPU waits for the launch (``benchmarks/host_overhead.py``). A layer passes the same tensors call after call
(an optimizer updates them in place), so a passed check is remembered for that exact list of tensor
objects at those exact addresses. A later call with the same objects (weak references, so an object that
died and whose id was reused is a miss) at the same data pointers and versions (read again on every call:
in-place ops such as ``t_()`` bump the version) skips the checks and gets the pointers. Not seen on a hit:
``t.data = a view of the same storage with another shape``, which no Megatron path does.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import torch

_MAX_ENTRIES = 1024  # a few per MoE layer (forward / backward, bf16 / fp8): far more than a model has
_data_ptr = torch.Tensor.data_ptr


class _Entry:
    __slots__ = ("refs", "ptrs", "versions")

    def __init__(self, refs: list[weakref.ref], ptrs: tuple[int, ...], versions: tuple[int, ...]) -> None:
        self.refs = refs
        self.ptrs = ptrs
        self.versions = versions


_memo: OrderedDict[tuple, _Entry] = OrderedDict()
_lock = threading.Lock()


def flatten(lists, R: int, L: int) -> list | None:
    """The R x L entries of ``lists`` (R lists of L) in rank-major order, or None if it is not shaped so."""
    if not isinstance(lists, (list, tuple)) or len(lists) != R:
        return None
    flat: list = []
    for per_rank in lists:
        if not isinstance(per_rank, (list, tuple)) or len(per_rank) != L:
            return None
        flat.extend(per_rank)
    return flat


def checked_pointers(flat: Sequence, spec: Hashable, check: Callable[[Sequence], bool]) -> tuple[int, ...] | None:
    """The data pointers of the tensors ``flat`` if they pass ``check`` (a predicate over the whole list that
    depends only on the tensors' metadata and on ``spec``, e.g. dtype, shape and device); None if not.
    The check runs once per list of objects at the same addresses; later calls only confirm those."""
    key = (spec, tuple(map(id, flat)))
    entry = _memo.get(key)
    if entry is not None and all(r() is t for r, t in zip(entry.refs, flat)):
        ptrs = tuple(map(_data_ptr, flat))
        if ptrs == entry.ptrs and tuple(t._version for t in flat) == entry.versions:
            with _lock:
                if key in _memo:
                    _memo.move_to_end(key)
            return ptrs
    if not check(flat):
        return None
    ptrs = tuple(map(_data_ptr, flat))
    entry = _Entry([weakref.ref(t) for t in flat], ptrs, tuple(t._version for t in flat))
    with _lock:
        _memo[key] = entry
        _memo.move_to_end(key)
        while len(_memo) > _MAX_ENTRIES:
            _memo.popitem(last=False)
    return ptrs


def clear() -> None:
    """Forget every remembered check (tests)."""
    with _lock:
        _memo.clear()


def size() -> int:
    """Entries remembered now (tests)."""
    return len(_memo)


def dense_weight_pointers(lists, R: int, L: int, dtype, shape: tuple[int, int], device) -> tuple[int, ...] | None:
    """The common case in one cheap pass: lists holds R lists of L contiguous, 16-byte aligned ``dtype``
    tensors of ``shape`` on ``device``; their data pointers (rank-major), or None for "check in detail"
    (which names the problem or accepts a strided weight). The per-call host time of a launch was mostly
    these checks, run for every expert: a passed pass is remembered for the same tensors at the same
    addresses (weight_memo.py)."""
    flat = flatten(lists, R, L)
    if flat is None:
        return None

    def dense(ts) -> bool:
        return all(
            isinstance(t, torch.Tensor)
            and t.dtype == dtype
            and t.shape == shape
            and t.device == device
            and t.is_contiguous()
            and t.data_ptr() % 16 == 0
            for t in ts
        )

    return checked_pointers(flat, (dtype, tuple(shape), device), dense)


def dense_weights_ok(lists, R: int, L: int, dtype, shape: tuple[int, int], device) -> bool:
    """``dense_weight_pointers`` as a yes / no."""
    return dense_weight_pointers(lists, R, L, dtype, shape, device) is not None
