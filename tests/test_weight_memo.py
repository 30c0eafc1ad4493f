"""CPU: expert-weight checks remembered across launches (megatron_mok/kernel/host/weight_memo.py).

A launch's weight check runs once per list of tensor objects at the same addresses; every other case
(a tensor replaced, re-pointed with ``.data =``, dead and its id reused, a failed check) checks again."""

from __future__ import annotations

import ctypes
import gc
import weakref

import pytest
import torch

from megatron_mok.kernel.forward import set_expert_weights
from megatron_mok.kernel.host import weight_memo
from megatron_mok.kernel.host.cargs import LaunchArrays
from megatron_mok.kernel.host.weight_memo import dense_weight_pointers
from megatron_mok.kernel.quant import Fp8ExpertWeights

CPU = torch.device("cpu")
R, L, H, F = 2, 3, 256, 128


def _w1():
    return [[torch.randn((2 * F, H)).bfloat16() for _ in range(L)] for _ in range(R)]


class Counting:
    """A dense check that counts its runs."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, ts) -> bool:
        self.runs += 1
        return all(isinstance(t, torch.Tensor) and t.shape == (2 * F, H) for t in ts)


@pytest.fixture(autouse=True)
def _fresh_memo():
    weight_memo.clear()
    yield
    weight_memo.clear()


def test_a_passed_check_runs_once_and_the_pointers_stay_exact():
    w1 = _w1()
    flat = weight_memo.flatten(w1, R, L)
    chk = Counting()
    want = tuple(t.data_ptr() for t in flat)
    assert weight_memo.checked_pointers(flat, "spec", chk) == want
    for _ in range(5):
        assert weight_memo.checked_pointers(weight_memo.flatten(w1, R, L), "spec", chk) == want
    assert chk.runs == 1
    assert weight_memo.checked_pointers(flat, "another spec", chk) == want  # a spec of its own
    assert chk.runs == 2


def test_a_replaced_or_repointed_tensor_is_checked_again():
    w1 = _w1()
    chk = Counting()
    weight_memo.checked_pointers(weight_memo.flatten(w1, R, L), "spec", chk)
    w1[1][2] = torch.randn((2 * F, H)).bfloat16()  # another object
    got = weight_memo.checked_pointers(weight_memo.flatten(w1, R, L), "spec", chk)
    assert chk.runs == 2 and got[-1] == w1[1][2].data_ptr()
    w1[0][0].data = torch.randn((2 * F, H)).bfloat16()  # same object, new storage
    got = weight_memo.checked_pointers(weight_memo.flatten(w1, R, L), "spec", chk)
    assert chk.runs == 3 and got[0] == w1[0][0].data_ptr()
    w1[0][1].data = torch.randn((2 * F, F)).bfloat16()  # same object, new storage of another shape
    assert weight_memo.checked_pointers(weight_memo.flatten(w1, R, L), "spec", chk) is None
    assert chk.runs == 4


def test_a_dead_object_never_hits_even_if_its_id_comes_back():
    w1 = _w1()
    flat = weight_memo.flatten(w1, R, L)
    chk = Counting()
    weight_memo.checked_pointers(flat, "spec", chk)
    # as if flat[0] had died and a new object had taken its id: the remembered reference is dead
    entry = next(iter(weight_memo._memo.values()))
    ghost = torch.zeros(1)
    entry.refs[0] = weakref.ref(ghost)
    del ghost
    gc.collect()
    weight_memo.checked_pointers(flat, "spec", chk)
    assert chk.runs == 2


def test_failed_checks_are_not_remembered_and_the_memo_is_bounded(monkeypatch):
    w1 = _w1()
    w1[0][0] = torch.randn((2 * F, F)).bfloat16()
    chk = Counting()
    for _ in range(3):
        assert weight_memo.checked_pointers(weight_memo.flatten(w1, R, L), "spec", chk) is None
    assert chk.runs == 3 and weight_memo.size() == 0
    monkeypatch.setattr(weight_memo, "_MAX_ENTRIES", 4)
    lists = [_w1() for _ in range(6)]
    for w in lists:
        weight_memo.checked_pointers(weight_memo.flatten(w, R, L), "spec", Counting())
    assert weight_memo.size() == 4


def test_flatten_rejects_what_is_not_r_lists_of_l():
    w1 = _w1()
    assert weight_memo.flatten(w1[:1], R, L) is None
    assert weight_memo.flatten([w1[0], w1[1][:2]], R, L) is None
    assert weight_memo.flatten([w1[0], "abc"], R, L) is None
    assert len(weight_memo.flatten(w1, R, L)) == R * L


def test_launch_pointer_tables_of_a_subset_of_ranks():
    """set_expert_weights: rank-major pointers of the launch's ranks, dense row strides."""

    class Args:
        pass

    w1 = _w1()
    w2 = [[torch.randn((H, F)).bfloat16() for _ in range(L)] for _ in range(R)]
    for ranks in ([0, 1], [1]):
        a, arrs = Args(), LaunchArrays()
        for _ in range(2):  # the second call reads the remembered pointers
            set_expert_weights(a, arrs, w1, w2, None, ranks, L, H, F, CPU)
            n = len(ranks) * L
            assert _u64(a.w1, n) == [w1[q][e].data_ptr() for q in ranks for e in range(L)]
            assert _u64(a.w2, n) == [w2[q][e].data_ptr() for q in ranks for e in range(L)]
            assert _i64(a.w1_ld, n) == [H] * n and _i64(a.w2_ld, n) == [F] * n
    # pointers the caller already took (mok_forward_emulated's checks) are used as they are
    a, arrs = Args(), LaunchArrays()
    dense = (
        dense_weight_pointers(w1, R, L, torch.bfloat16, (2 * F, H), CPU),
        dense_weight_pointers(w2, R, L, torch.bfloat16, (H, F), CPU),
    )
    set_expert_weights(a, arrs, w1, w2, None, [1], L, H, F, CPU, dense)
    assert _u64(a.w2, L) == [t.data_ptr() for t in w2[1]] and _i64(a.w1_ld, L) == [H] * L
    # a strided weight goes the detailed way, with its own row stride
    w1[1][0] = torch.randn((2 * F, H + 64)).bfloat16()[:, :H]
    a, arrs = Args(), LaunchArrays()
    set_expert_weights(a, arrs, w1, w2, None, [1], L, H, F, CPU)
    assert _i64(a.w1_ld, L) == [H + 64, H, H] and _u64(a.w1, L)[0] == w1[1][0].data_ptr()


def test_fp8_pointer_tables():
    class Args:
        pass

    def q(shape):
        return [[torch.zeros(shape, dtype=torch.float8_e4m3fn) for _ in range(L)] for _ in range(R)]

    def s(shape):
        return [[torch.ones(shape, dtype=torch.float32) for _ in range(L)] for _ in range(R)]

    w = Fp8ExpertWeights(q((2 * F, H)), s((2 * F // 128, H // 128)), q((H, F)), s((H // 128, F // 128)))
    for _ in range(2):
        a, arrs = Args(), LaunchArrays()
        set_expert_weights(a, arrs, [None] * R, [None] * R, w, [1], L, H, F, CPU)
        assert a.fp8 == 1
        assert _u64(a.w1, L) == [t.data_ptr() for t in w.w1q[1]]
        assert _u64(a.w2s, L) == [t.data_ptr() for t in w.w2s[1]]
        assert _i64(a.w1_ld, L) == [H] * L and _i64(a.w2_ld, L) == [F] * L


def _u64(addr: int, n: int) -> list[int]:
    return list((ctypes.c_ulonglong * n).from_address(addr))


def _i64(addr: int, n: int) -> list[int]:
    return list((ctypes.c_longlong * n).from_address(addr))


def test_an_in_place_metadata_change_is_checked_again():
    """t_() keeps the object and its address but bumps its version: the memo must not say "dense"."""
    w1 = [[torch.randn((2 * F, 2 * F)).bfloat16() for _ in range(L)] for _ in range(R)]  # square: t_() fits
    shape = (2 * F, 2 * F)
    assert dense_weight_pointers(w1, R, L, torch.bfloat16, shape, CPU) is not None
    w1[1][1].t_()  # same shape, column-major now
    assert dense_weight_pointers(w1, R, L, torch.bfloat16, shape, CPU) is None
