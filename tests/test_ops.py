"""CPU: the ``mok`` operators exist without the CUDA build (schemas and fake implementations in
megatron_mok/kernel/ops.py), their fake implementations give the shapes and dtypes the CUDA ones return, and the
limits the Python side checks against are the C++ ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megatron_mok.kernel import ops

T, H, F, K, L = 300, 256, 128, 2, 4
META = torch.device("meta")


def _t(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device=META)


def test_every_operator_has_a_schema_and_a_fake():
    names = ["forward", "backward", "wgrad", "fp8_quantize_weight", "fp8_grouped_gemm", "mxfp8_quantize_rows",
             "sm100_mxfp8_grouped_gemm", "topk_from_routing_map"]  # fmt: skip
    for n in names:
        op = getattr(torch.ops.mok, n).default
        assert op._schema.name == f"mok::{n}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta"), f"mok::{n} has no fake"


def test_forward_fake_shapes():
    w1 = [_t(2 * F, H) for _ in range(L)]
    w2 = [_t(H, F) for _ in range(L)]
    out, tpe = torch.ops.mok.forward(
        _t(T, H), _t(T, K, dtype=torch.int32), _t(T, K, dtype=torch.float32), w1, w2, [], [], _t(T, K, H),
        _t(16, dtype=torch.int32), [], [], None, None, None, None, None, 0, 0, 2, 2, 128, 0, 1000.0, 0,
        float("inf"), 0.0, -1, 0, -1, -1,
    )  # fmt: skip
    assert (out.shape, out.dtype, out.device) == ((T, H), torch.bfloat16, META)
    assert (tpe.shape, tpe.dtype) == ((L,), torch.int32)


def test_backward_fake_shapes():
    w1 = [_t(2 * F, H) for _ in range(L)]
    w2 = [_t(H, F) for _ in range(L)]
    cap = T * K
    gx, gw, tpe = torch.ops.mok.backward(
        _t(T, H), _t(T, H), _t(T, K, dtype=torch.int32), _t(T, K, dtype=torch.float32), _t(T, K, H), w1, w2,
        [_t(F, H) for _ in range(L)], _t(T, K, H), _t(cap, H), _t(cap, H), _t(cap, 2 * F), _t(cap, F),
        _t(16, dtype=torch.int32), [], [], None, [], [], None, None, 0, 0, 2, 2, 128, 0, 1000.0, 0,
        float("inf"), 0.0, True, False, False, -1, -1,
    )  # fmt: skip
    assert (gx.shape, gx.dtype) == ((T, H), torch.bfloat16)
    assert (gw.shape, gw.dtype) == ((T, K), torch.float32)
    assert (tpe.shape, tpe.dtype) == ((L,), torch.int32)


@pytest.mark.parametrize("layout, sf_shape", [(0, (T, H // 32)), (1, (-(-T // 128) * -(-(H // 32) // 4) * 512,))])
def test_unit_fake_shapes(layout, sf_shape):
    q, s = torch.ops.mok.fp8_quantize_weight(_t(2 * F, H))
    assert (q.shape, q.dtype, s.shape, s.dtype) == (
        (2 * F, H),
        torch.float8_e4m3fn,
        (2 * F // 128, H // 128),
        torch.float32,
    )
    q, sf = torch.ops.mok.mxfp8_quantize_rows(_t(T, H), layout)
    assert (q.shape, q.dtype, tuple(sf.shape), sf.dtype) == ((T, H), torch.float8_e4m3fn, sf_shape, torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_conversion_fake_shapes(dtype):
    idx, w = torch.ops.mok.topk_from_routing_map(_t(T, 16, dtype=torch.bool), _t(T, 16, dtype=dtype), 8)
    assert (idx.shape, idx.dtype, w.shape, w.dtype) == ((T, 8), torch.int32, (T, 8), dtype)


def test_python_limits_are_the_kernel_limits():
    header = (Path(__file__).resolve().parent.parent / "csrc" / "mok" / "mok_limits.h").read_text()
    limits = {m[0]: int(m[1]) for m in re.findall(r"#define (MOK_MAX_\w+) (\d+)", header)}
    assert limits["MOK_MAX_RANKS"] == ops.MOK_MAX_RANKS
    assert limits["MOK_MAX_LOCAL_EXPERTS"] == ops.MOK_MAX_LOCAL_EXPERTS
    assert limits["MOK_MAX_SLOTS"] == ops.MOK_MAX_SLOTS


def test_no_ctypes_in_the_package():
    pkg = Path(__file__).resolve().parent.parent / "megatron_mok"
    users = [str(p.relative_to(pkg)) for p in pkg.rglob("*.py") if "ctypes" in p.read_text()]
    assert not users, f"modules that still reach a library through ctypes: {users}"
