"""GPU: 1,000 forward + backward steps of a Megatron MoE layer with ``mok`` at a Kimi-K2 slice (tools/long_run.py),
bf16 and FP8, new tokens (so a new routing) and an SGD step every step: the memory allocated after the warm-up equals
the memory after the last step, no step takes more than twice the median device time, and the host's time per step
does not creep."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from load_script import load_script  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_a_thousand_steps_keep_memory_and_step_time_flat(kernel, dtype):
    long_run = load_script("long_run")
    (r,) = long_run.main(["--dtype", dtype, "--steps", "1000", "--warmup", "100"])
    assert r["backend"] == ["kernel"], r["backend"]
    assert r["memory_end_bytes"] == r["memory_after_warmup_bytes"], long_run.summary(r)
    assert r["device_max_over_median"] <= long_run.MAX_STEP_OVER_MEDIAN, long_run.summary(r)
    assert r["host_creep"] <= long_run.MAX_HOST_CREEP, long_run.summary(r)
