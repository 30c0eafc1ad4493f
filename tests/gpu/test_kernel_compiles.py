"""CPU-only CI check: the MoK kernels compile for sm_90a with the library's flags (needs nvcc + nvidia-cutlass headers;
runs nothing), every instance is built, no WGMMA is serialised and the lean FP8 forward does not spill."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.nvcc


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{"forward" | "backward": (cubin bytes, ptxas report)} of the two kernel translation units, compiled once."""
    from megatron_mok.kernel import build

    if build.find_nvcc() is None or build.cutlass_include() is None:
        pytest.skip("needs nvcc and the CUTLASS headers (pip install --no-deps nvidia-cutlass==4.2.0.0)")
    out = tmp_path_factory.mktemp("cubins")

    def one(which):
        cubin = build.compile_only(out / f"{which}.cubin", source=f"host/{which}.cu")
        return which, (cubin.read_bytes(), cubin.with_suffix(".log").read_text())

    def forward_object(_):  # the object the library links, the post-pass applied as the build applies it
        obj = build.compile_only(out / "forward_cu.o", source="host/forward.cu", object_file=True)
        return "forward_object", (obj.read_bytes(), obj.with_suffix(".log").read_text())

    with ThreadPoolExecutor(3) as pool:
        got = dict(pool.map(one, ("forward", "backward")))
        got.update(pool.map(forward_object, [None]))
        return got


def test_kernels_compile_for_sm90a(compiled):
    fwd, bwd = compiled["forward"][0], compiled["backward"][0]
    assert b"mok_forward_kernel" in fwd and b"mok_fp8_gemm_kernel" in fwd  # the megakernel and the FP8 GEMM unit
    assert b"mok_fp8_wgrad_kernel" in fwd  # the FP8 weight-gradient GEMM unit
    assert b"mok_backward_kernel" in bwd and b"mok_wgrad_kernel" in bwd


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_no_wgmma_is_serialised(compiled, which):
    """ptxas serialises every wgmma of a kernel (warnings C7514 / C7515) when a non-wgmma instruction
    writes accumulator registers inside a pipeline stage -- the FP8 forward lost 10 % that way to one
    branch (expert_ffn.cuh: skip_kloop). The shipped kernels must compile without it."""
    log = compiled[which][1]
    assert "ptxas info" in log, "the build log holds no ptxas report (-Xptxas -v)"
    bad = [ln for ln in log.splitlines() if "instructions are serialized" in ln]
    assert not bad, "\n".join(bad)


def _spill_stores(log: str, kernel: str) -> int:
    """Spill-store bytes ptxas reported for entry function ``kernel`` (-Xptxas -v)."""
    import re

    m = re.search(re.escape(kernel) + r"'? for 'sm_90a'\s*\n.*?(\d+) bytes spill stores", log, re.S)
    assert m, f"no ptxas report for {kernel}"
    return int(m.group(1))


def test_lean_forward_instances(compiled):
    """The forward kernel is built per feature set (csrc/mok/common.cuh: FwdFeature): a lean instance per dtype,
    which default launches run, and one with the SwiGLU variant. A feature compiled into the instance a launch
    runs costs it even when unused (an FP8 instance with three features compiled in and none used ran ~5 %
    slower: its code in the hot loops, 26160 instead of 18552 instructions, 352 instead of 84 bytes of spill
    stores). Both instances must exist, and the lean FP8 one must stay lean: a feature's code that leaks into it
    shows as spills first."""
    log = compiled["forward"][1]
    for fp8 in (0, 1):
        for feat in (0, 1):
            assert f"mok_forward_kernelILb{fp8}ELi{feat}E" in log, f"forward instance <{fp8}, {feat}> not built"
    s_lean = _spill_stores(log, "_ZN3mok18mok_forward_kernelILb1ELi0EEEvNS_6ParamsE")
    assert s_lean <= 128, f"lean FP8 instance spills {s_lean} bytes"


def test_fp8_wgrad_unit_does_not_spill(compiled):
    """The FP8 wgrad unit holds 64 accumulators, a 64-register product and 34 scales per consumer thread: a spill
    in its K loop would put local-memory traffic between every block's MMAs and its promotion."""
    log = compiled["forward"][1]
    assert _spill_stores(log, "_ZN3mok3fp820mok_fp8_wgrad_kernelENS0_13F8WgradParamsE") == 0
    # a register-count change ptxas cannot apply leaves the consumers at the launch's 168 registers
    assert not [ln for ln in log.splitlines() if "setmaxnreg" in ln and "warning" in ln.lower()]


@pytest.mark.parametrize("which", ["forward", "forward_object"])
def test_fp8_promotion_yield_hints(compiled, which):
    """The build's SASS post-pass (megatron_mok/kernel/sass.py) finds the promotion's FMUL runs in both FP8 forward
    instances, in the cubin and in the object the library links, and interleaves their yield hints: a renamed kernel,
    a reshaped promotion or a compressed object that it no longer reads would cost the FP8 forward ~3 %."""
    from megatron_mok.kernel import sass

    cubin, log = compiled[which]
    assert "sass post-pass: yield hints interleaved in" in log, "the build log holds no post-pass line"
    runs = sass.promotion_runs(cubin)
    assert {r.function for r in runs} == {sass.FP8_FORWARD_KERNEL + f"Li{f}EEEvNS_6ParamsE" for f in (0, 1)}
    for r in runs:
        highs = [
            int.from_bytes(cubin[r.offset + 16 * k + 8 : r.offset + 16 * k + 16], "little") for k in range(r.length)
        ]
        assert all(h & sass.REUSE_FLAGS == 0 for h in highs[1::2]), f"reuse flags left on a flipped FMUL of {r}"
        flipped = sum((a ^ b) & sass.YIELD_HINT != 0 for a, b in zip(highs[0::2], highs[1::2]))
        assert flipped >= r.length // 2 - 2, f"the yield hints of {r} are not interleaved ({flipped} pairs differ)"
