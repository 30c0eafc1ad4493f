#!/usr/bin/env bash
# Single-launch timelines of several launcher-knob variants in one device call (scripts/timeline.py), for the
# side-by-side method of scripts/NOTES-kernel.md: fc1 / fc2 tile and epilogue times, MMA time per K block,
# schedule window and final-sum tail per variant, with the GPU's SM clock and power sampled during each.
#   bash scripts/run_timelines.sh
# Env: MOK_TL_SPECS  variants, ';'-separated, each "label|config|dtype|ENV=VAL ENV=VAL|timeline.py args" (the env
#                    and args parts may be empty or left out); default: the eleventh session's set below (2-CTA
#                    clusters with 8 comm SMs).
#      MOK_TL_OLD_TREE directories holding other source trees, space-separated (e.g. `git archive 828de2d | tar -x
#                    -C old_tree`): each tree's library is built apart (MOK_CACHE_DIR of its own); first the
#                    MOK_TL_OLD_SPECS variants (default: the plain fp8 and bf16 launches) run MOK_TL_OLD_REPS times
#                    (default 2) in this tree and every old one, alternating (two launches of one build agree to
#                    ~0.1 %), labelled new-<label>-<i> / <tree dir name>-<label>-<i>.
#      MOK_TL_PREBUILD 0 skips building every variant in parallel first (default 1).
#      OUT           log directory (default ./gpu_logs).
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/device_env.sh
. scripts/device_env.sh
DEFAULT_SPECS="fp8-order1|kimi-k2-fp8|fp8|MOK_FP8_ORDERED=1 MOK_FP8_ISSUE_ORDER=1;\
fp8-order2|kimi-k2-fp8|fp8|MOK_FP8_ORDERED=1 MOK_FP8_ISSUE_ORDER=2;\
fp8-cluster2|kimi-k2-fp8|fp8|MOK_CLUSTER=2|--comm-sms 8;\
bf16|kimi-k2|bf16|;\
bf16-cluster2|kimi-k2|bf16|MOK_CLUSTER=2|--comm-sms 8;\
bf16-chunks4|kimi-k2|bf16|MOK_MACROBATCHES=4;\
abl0-order1|kimi-k2-fp8|fp8|MOK_ABLATION=1 MOK_DEBUG=0 MOK_FP8_ORDERED=1 MOK_FP8_ISSUE_ORDER=1;\
abl32-order1|kimi-k2-fp8|fp8|MOK_ABLATION=1 MOK_DEBUG=32 MOK_FP8_ORDERED=1 MOK_FP8_ISSUE_ORDER=1;\
abl0-order2|kimi-k2-fp8|fp8|MOK_ABLATION=1 MOK_DEBUG=0 MOK_FP8_ORDERED=1 MOK_FP8_ISSUE_ORDER=2;\
abl32-order2|kimi-k2-fp8|fp8|MOK_ABLATION=1 MOK_DEBUG=32 MOK_FP8_ORDERED=1 MOK_FP8_ISSUE_ORDER=2"
SPECS="${MOK_TL_SPECS:-$DEFAULT_SPECS}"

# one timeline launch: tree dir, label, config, dtype, env assignments; SM clock / power sampled meanwhile
run_one() {
  local tree="$1" label="$2" config="$3" dtype="$4" envs="$5" cache="$6" args="${7:-}"
  local smi="$OUT/tl-$label.smi.csv"
  nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 50 >"$smi" 2>/dev/null &
  local smi_pid=$!
  # shellcheck disable=SC2086  # the env assignments are meant to split into words
  (cd "$tree" && env $envs MOK_CACHE_DIR="$cache" PYTHONPATH="$MOK_SITE$PWD" timeout 150 \
    python3 scripts/timeline.py --config "$config" --dtype "$dtype" --out "$OUT/tl-$label" $args) >"$OUT/tl-$label.log" 2>&1
  local rc=$?
  kill "$smi_pid" 2>/dev/null
  wait "$smi_pid" 2>/dev/null
  local clk
  clk=$(awk -F, '$1 > 1000 {c += $1; p += $2; n++} END {if (n) printf "%.0f MHz %.0f W (%d samples > 1 GHz)", c / n, p / n, n}' "$smi")
  echo "== $label (rc $rc; $envs${args:+; $args}): ${clk:-no clock samples}"
  grep -E "span|fc1 tiles|fc2 tiles|per K block|schedule  |combine  " "$OUT/tl-$label.log" | sed 's/^/   /'
}

# build every (tree, env) variant at once before the launches (each build is one mostly single-threaded nvcc;
# one after the other they would take most of a device call)
prebuild() {
  local combos=() c tree envs cache spec label config dtype
  IFS=';' read -ra OLDP <<<"${MOK_TL_OLD_SPECS:-fp8|kimi-k2-fp8|fp8|;bf16|kimi-k2|bf16|}"
  IFS=';' read -ra NEWP <<<"$SPECS"
  for spec in "${NEWP[@]}" ${MOK_TL_OLD_TREE:+"${OLDP[@]}"}; do
    IFS='|' read -r label config dtype envs _ <<<"$spec"
    [ -n "$label" ] && combos+=("$PWD|$MOK_CACHE_DIR|$envs")
  done
  for tree in ${MOK_TL_OLD_TREE:-}; do
    for spec in "${OLDP[@]}"; do
      IFS='|' read -r label config dtype envs _ <<<"$spec"
      [ -n "$label" ] && combos+=("$tree|$MOK_CACHE_DIR-$(basename "$tree")|$envs")
    done
  done
  local t0=$SECONDS
  for c in $(printf '%s\n' "${combos[@]}" | sort -u | tr ' ' '#'); do
    IFS='|' read -r tree cache envs <<<"${c//#/ }"
    # shellcheck disable=SC2086
    (cd "$tree" && env $envs MOK_CACHE_DIR="$cache" PYTHONPATH="$MOK_SITE$PWD" timeout 300 python3 -c \
      "from megatron_mok.kernel import build; build.build_library()" >"$OUT/prebuild-$(basename "$tree")-${envs// /_}.log" 2>&1) &
  done
  wait
  echo "== prebuilt ${#combos[@]} variants (duplicates once) in $((SECONDS - t0)) s"
}

{
  [ "${MOK_TL_PREBUILD:-1}" != "0" ] && prebuild
  if [ -n "${MOK_TL_OLD_TREE:-}" ]; then
    IFS=';' read -ra OLD <<<"${MOK_TL_OLD_SPECS:-fp8|kimi-k2-fp8|fp8|;bf16|kimi-k2|bf16|}"
    for i in $(seq 1 "${MOK_TL_OLD_REPS:-2}"); do
      for spec in "${OLD[@]}"; do
        IFS='|' read -r label config dtype envs args <<<"$spec"
        [ -n "$label" ] || continue
        run_one "$PWD" "new-$label-$i" "$config" "$dtype" "$envs" "$MOK_CACHE_DIR" "$args"
        for tree in $MOK_TL_OLD_TREE; do
          run_one "$tree" "$(basename "$tree")-$label-$i" "$config" "$dtype" "$envs" "$MOK_CACHE_DIR-$(basename "$tree")" "$args"
        done
      done
    done
  fi
  IFS=';' read -ra LIST <<<"$SPECS"
  for spec in "${LIST[@]}"; do
    IFS='|' read -r label config dtype envs args <<<"$spec"
    [ -n "$label" ] || continue
    run_one "$PWD" "$label" "$config" "$dtype" "$envs" "$MOK_CACHE_DIR" "$args"
  done
} 2>&1 | tee "$OUT/timelines-summary.log"
