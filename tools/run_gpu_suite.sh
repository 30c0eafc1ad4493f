#!/usr/bin/env bash
# The command sequence for a Hopper GPU machine: install carried wheels (.whl/), build the MoK
# library, run the GPU tests, record the kernel timeline, run the benchmark. Logs go to $OUT (or ./gpu_logs).
#   bash tools/run_gpu_suite.sh [extra args for bench_forward.py]
# Env: MOK_SUITE_TESTS=0 skips tests, MOK_SUITE_TIMELINE=0 the kimi-k2 timelines (forward, backward),
#      MOK_SUITE_BENCH=0 the benchmark, MOK_SUITE_FP8=0 the fp8-vs-bf16 benchmark (benchmarks/bench_fp8.py),
#      MOK_PYTEST_PATHS (tests/gpu), MOK_PYTEST_ARGS overrides "-x -q", MOK_SUITE_FP8_ARGS the fp8 benchmark's
#      arguments (e.g. an interleaved A/B of a launcher knob: "--comm-sms 0 --minibatch 4096 --ring-slots 4
#      --rounds 13 --no-graphs --ab-tuning tile_raster=16 --ab-tuning-kinds fp8").
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=tools/device_env.sh
. tools/device_env.sh
export PYTHONPATH="$MOK_SITE$PWD"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>&1 | tee "$OUT/gpu.txt"
echo "== build"
python3 - <<'PY' 2>&1 | tee "$OUT/build.log"
import time
t = time.time()
from megatron_mok.kernel import build
p = build.build_extension()
print("built", p, f"{time.time() - t:.1f}s")
print("\n".join(l for l in build.build_log().splitlines() if "registers" in l or "spill" in l or "ptxas" in l))
import megatron_mok.kernel as k
print("is_available:", k.is_available(), k.unavailable_reason())
PY
rc=0
if [ "${MOK_SUITE_TESTS:-1}" != "0" ]; then
  echo "== tests"
  # shellcheck disable=SC2086  # word splitting of the path / argument strings is intended
  timeout ${MOK_TEST_TIMEOUT:-300} python3 -m pytest -m gpu ${MOK_PYTEST_PATHS:-tests/gpu} ${MOK_PYTEST_ARGS:--x -q} -p no:cacheprovider 2>&1 | tee "$OUT/tests.log"
  rc=${PIPESTATUS[0]}
fi
if [ "${MOK_SUITE_TIMELINE:-1}" != "0" ]; then
  echo "== timeline"
  timeout 120 python3 tools/timeline.py --config kimi-k2 --out "$OUT/timeline" 2>&1 | tee "$OUT/timeline.log"
  timeout 120 python3 tools/timeline.py --config kimi-k2 --pass backward --out "$OUT/timeline-backward" 2>&1 \
    | tee "$OUT/timeline-backward.log"
  timeout 120 python3 tools/timeline.py --config kimi-k2-fp8 --dtype fp8 --out "$OUT/timeline-fp8" 2>&1 \
    | tee "$OUT/timeline-fp8.log"
  timeout 120 python3 tools/timeline.py --config deepseek-v3 --ep-of-config 8 --out "$OUT/timeline-dsv3" 2>&1 \
    | tee "$OUT/timeline-dsv3.log"
fi
if [ "${MOK_SUITE_BENCH:-1}" != "0" ]; then
  echo "== bench"
  timeout ${MOK_BENCH_TIMEOUT:-240} python3 benchmarks/bench_forward.py --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
fi
if [ "${MOK_SUITE_FP8:-1}" != "0" ]; then
  echo "== fp8 bench"
  # each forward at its slice's shipped config (--configs), an A/B against 8 comm SMs in the interleaved rounds
  FP8_ARGS="${MOK_SUITE_FP8_ARGS:---backward --configs --comm-sms 0 --minibatch 4096 --ring-slots 4 --rounds 9 --ab-comm 8}"
  # shellcheck disable=SC2086  # word splitting of the argument string is intended
  timeout ${MOK_BENCH_TIMEOUT:-300} python3 benchmarks/bench_fp8.py $FP8_ARGS --json "$OUT/bench-fp8.json" 2>&1 | tee "$OUT/bench-fp8.log"
fi
exit $rc
