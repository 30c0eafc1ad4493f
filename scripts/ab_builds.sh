#!/usr/bin/env bash
# Sustained A/B of build-time switches (MOK_FP8_SRC_QUANT, MOK_FP8_KLOOP, ...): each is a library of its own, so
# bench_fp8.py's --ab-env cannot switch it inside one process. This runs bench_fp8.py in alternating processes,
# one per build and repetition (A B A B ...: the power-capped clock drifts over a run), and prints every
# process's interleaved medians (fp8 and bf16 ms, per call and device) and the median of each build's processes.
#   bash scripts/ab_builds.sh
# Env: MOK_AB_BUILDS  builds, ';'-separated "label|ENV=VAL ENV=VAL" (default: the default build against
#                     the FP8 forward before the eighteenth session: MOK_FP8_SRC_QUANT=0 MOK_FP8_SCALE_KMAJOR=0)
#      MOK_AB_REPS    processes per build (default 3)
#      MOK_AB_ARGS    bench_fp8.py arguments (default: the Kimi-K2 slice at its shipped configs, 3 rounds)
#      OUT            log directory (default ./gpu_logs)
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/device_env.sh
. scripts/device_env.sh
BUILDS="${MOK_AB_BUILDS:-base|;row-major|MOK_FP8_SRC_QUANT=0 MOK_FP8_SCALE_KMAJOR=0}"
REPS="${MOK_AB_REPS:-3}"
ARGS="${MOK_AB_ARGS:---shapes kimi --configs --comm-sms 0 --minibatch 4096 --ring-slots 4 --rounds 3 --no-graphs}"
IFS=';' read -ra LIST <<<"$BUILDS"

{
  # every build at once first (each is one mostly single-threaded nvcc)
  t0=$SECONDS
  for spec in "${LIST[@]}"; do
    IFS='|' read -r label envs <<<"$spec"
    [ -n "$label" ] || continue
    # shellcheck disable=SC2086  # the env assignments are meant to split into words
    env $envs PYTHONPATH="$MOK_SITE$PWD" timeout 300 python3 -c \
      "from megatron_mok.kernel import build; build.build_library()" >"$OUT/ab-build-$label.log" 2>&1 &
  done
  wait
  echo "== built ${#LIST[@]} libraries in $((SECONDS - t0)) s"
  for i in $(seq 1 "$REPS"); do
    for spec in "${LIST[@]}"; do
      IFS='|' read -r label envs <<<"$spec"
      [ -n "$label" ] || continue
      # shellcheck disable=SC2086
      env $envs PYTHONPATH="$MOK_SITE$PWD" timeout 300 python3 scripts/bench_fp8.py $ARGS >"$OUT/ab-$label-$i.log" 2>&1
      echo "== $label run $i (rc $?; ${envs:-default build})"
      grep -E "^SUMMARY .* interleaved" "$OUT/ab-$label-$i.log" | sed 's/^/   /'
    done
  done
  PYTHONPATH="$MOK_SITE$PWD" python3 scripts/ab_builds_summary.py "$OUT" "${LIST[@]}"
} 2>&1 | tee "$OUT/ab-builds-summary.log"
