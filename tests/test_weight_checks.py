"""CPU: the launch-time expert-weight checks (host side of every forward / backward launch).

``dense_weights_ok`` is the cheap pass that runs on every launch; anything it does not accept must go to
the detailed checks, which name the bad weight (or accept a strided one). The GPU files test the kernels
with strided weight views (tests/gpu/test_forward_kernel.py::test_strided_weight_views)."""

from __future__ import annotations

import pytest
import torch

from megatron_mok.kernel.forward import _check_expert_weights
from megatron_mok.kernel.host.weight_memo import dense_weights_ok
from megatron_mok.kernel.quant import Fp8ExpertWeights

CPU = torch.device("cpu")
R, L, H, F = 2, 3, 128, 64


def _weights():
    w1 = [[torch.zeros((2 * F, H), dtype=torch.bfloat16) for _ in range(L)] for _ in range(R)]
    w2 = [[torch.zeros((H, F), dtype=torch.bfloat16) for _ in range(L)] for _ in range(R)]
    return w1, w2


def test_cheap_pass_accepts_dense_weights():
    w1, w2 = _weights()
    assert dense_weights_ok(w1, R, L, torch.bfloat16, (2 * F, H), CPU)
    assert dense_weights_ok(w2, R, L, torch.bfloat16, (H, F), CPU)
    _check_expert_weights(w1, w2, R, L, H, F, CPU)  # and the detailed checks agree


@pytest.mark.parametrize(
    "defect,message",
    [
        ("dtype", r"w1\[1\]\[2\] must be torch.bfloat16, got torch.float32"),
        ("shape", r"w1\[1\]\[2\] must be \[2F, H\] = \[128, 128\], got \(128, 64\)"),
        ("not a tensor", r"w1\[1\]\[2\] must be a torch.Tensor, got list"),
        ("misaligned", r"w1\[1\]\[2\] needs unit inner stride.*16-byte aligned start"),
        ("column stride", r"w1\[1\]\[2\] needs unit inner stride"),
        ("too few experts", r"w1\[1\] and w2\[1\] must each hold 3 expert weights"),
    ],
)
def test_cheap_pass_defers_every_defect_to_the_named_check(defect, message):
    w1, w2 = _weights()
    bad = {
        "dtype": torch.zeros((2 * F, H), dtype=torch.float32),
        "shape": torch.zeros((2 * F, F), dtype=torch.bfloat16),
        "not a tensor": [],
        "misaligned": torch.zeros((2 * F * H + 1,), dtype=torch.bfloat16)[1:].view(2 * F, H),
        "column stride": torch.zeros((H, 2 * F), dtype=torch.bfloat16).t(),
    }
    if defect == "too few experts":
        w1[1] = w1[1][:2]
    else:
        w1[1][2] = bad[defect]
    assert not dense_weights_ok(w1, R, L, torch.bfloat16, (2 * F, H), CPU)
    with pytest.raises(ValueError, match=message):
        _check_expert_weights(w1, w2, R, L, H, F, CPU)


def test_strided_rows_go_to_the_detailed_check_which_accepts_them():
    w1, w2 = _weights()
    w1[0][1] = torch.zeros((2 * F, H + 64), dtype=torch.bfloat16)[:, :H]  # row stride H + 64: a multiple of 8
    assert not dense_weights_ok(w1, R, L, torch.bfloat16, (2 * F, H), CPU)
    _check_expert_weights(w1, w2, R, L, H, F, CPU)  # accepted


def test_wrong_rank_count_fails_the_cheap_pass():
    w1, _ = _weights()
    assert not dense_weights_ok(w1[:1], R, L, torch.bfloat16, (2 * F, H), CPU)
    assert not dense_weights_ok(w1, R, L, torch.bfloat16, (2 * F, H), torch.device("meta"))


def _fp8(defect: str | None = None) -> Fp8ExpertWeights:
    def q(shape):
        return [[torch.zeros(shape, dtype=torch.float8_e4m3fn) for _ in range(L)] for _ in range(R)]

    def s(shape):
        return [[torch.ones(shape, dtype=torch.float32) for _ in range(L)] for _ in range(R)]

    w = Fp8ExpertWeights(q((2 * F, H)), s((2 * F // 128, H // 128)), q((H, F)), s((H // 128, F // 128)))
    if defect == "scale dtype":
        w.w2s[1][0] = torch.ones((H // 128, F // 128), dtype=torch.bfloat16)
    elif defect == "weight shape":
        w.w1q[0][2] = torch.zeros((2 * F, 2 * H), dtype=torch.float8_e4m3fn)
    return w


def test_fp8_weights_validate_through_the_cheap_pass_and_name_defects():
    F8 = 128  # block scales need multiples of 128
    global F
    saved, F = F, F8
    try:
        _fp8().validate(R, L, H, F, CPU)
        with pytest.raises(ValueError, match=r"w2s\[1\]\[0\] must be torch.float32"):
            _fp8("scale dtype").validate(R, L, H, F, CPU)
        with pytest.raises(ValueError, match=r"w1q\[0\]\[2\] must be torch.float8_e4m3fn \[256, 128\]"):
            _fp8("weight shape").validate(R, L, H, F, CPU)
    finally:
        F = saved


def test_per_rank_launch_checks_go_through_the_cheap_pass_and_name_defects():
    """mok_forward_rank's weight checks (peer_ep._expert_weight_pointers): dense weights give their
    pointers without the per-expert loop (remembered, weight_memo.py), strided ones None (their row
    strides are read at the launch), and every defect the named message of the detailed loop."""
    from megatron_mok.kernel.comm import _expert_weight_pointers
    from megatron_mok.kernel.host import weight_memo

    w1, w2 = _weights()
    got = _expert_weight_pointers(w1[0], w2[0], H, CPU)
    assert got == (tuple(t.data_ptr() for t in w1[0]), tuple(t.data_ptr() for t in w2[0]))
    n = weight_memo.size()
    assert _expert_weight_pointers(w1[0], w2[0], H, CPU) == got and weight_memo.size() == n  # a hit

    strided = list(w1[0])
    strided[1] = torch.zeros((2 * F, H + 64), dtype=torch.bfloat16)[:, :H]
    assert _expert_weight_pointers(strided, w2[0], H, CPU) is None  # accepted, strides read later

    cases = [
        ("dtype", torch.zeros((2 * F, H), dtype=torch.float32), r"w1\[2\] must be torch.bfloat16"),
        ("shape", torch.zeros((2 * F, F), dtype=torch.bfloat16), r"expert 2: w1 \(128, 64\)"),
        (
            "misaligned",
            torch.zeros((2 * F * H + 1,), dtype=torch.bfloat16)[1:].view(2 * F, H),
            r"w1\[2\] needs unit inner stride",
        ),
        ("odd row stride", torch.zeros((2 * F, H + 4), dtype=torch.bfloat16)[:, :H], r"w1\[2\] needs unit inner"),
    ]
    for name, bad, message in cases:
        ws = list(w1[0])
        ws[2] = bad
        with pytest.raises(ValueError, match=message):
            _expert_weight_pointers(ws, w2[0], H, CPU)
            pytest.fail(f"{name}: accepted")
    with pytest.raises(ValueError, match=r"must hold this rank's experts \(got 3 and 2\)"):
        _expert_weight_pointers(w1[0], w2[0][:2], H, CPU)
    with pytest.raises(ValueError, match=r"w2\[0\] must be a torch.Tensor"):
        _expert_weight_pointers(w1[0], [None, *w2[0][1:]], H, CPU)
    # FP8 launches (sizes only): the masters are not checked per expert, their structure still is
    assert _expert_weight_pointers([cases[0][1], *w1[0][1:]], w2[0], H, CPU, sizes_only=True) is None
    with pytest.raises(ValueError, match=r"must hold this rank's experts \(got 3 and 2\)"):
        _expert_weight_pointers(w1[0], w2[0][:2], H, CPU, sizes_only=True)
    # hidden size not a multiple of 8: no cheap pass, the detailed loop names the row stride
    h2 = 100
    w1h = [torch.zeros((2 * F, h2), dtype=torch.bfloat16) for _ in range(L)]
    w2h = [torch.zeros((h2, F), dtype=torch.bfloat16) for _ in range(L)]
    with pytest.raises(ValueError, match=r"w1\[0\] needs unit inner stride, a row stride multiple of 8"):
        _expert_weight_pointers(w1h, w2h, h2, CPU)
