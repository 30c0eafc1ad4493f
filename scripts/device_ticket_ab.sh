#!/usr/bin/env bash
# One device call (sixteenth session): ticket lookahead (MOK_TICKET_AHEAD) and the spin before a held release
# is flushed (MOK_FLUSH_SPIN_NS) -- their tests, single-launch timelines
# with / without and their between-tile gaps (scripts/timeline_gaps.py), and an interleaved A/B in bench_fp8.py.
# On an H200 the A/B run also carries --backward (the issue's figures). Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/device_env.sh
export PYTHONPATH="$MOK_SITE$PWD"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $gpu"
timeout 240 python3 -m pytest -m gpu tests/gpu/test_forward_kernel.py -k "pipeline_knobs or knobs or lead" -q -x \
  -p no:cacheprovider > "$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"
timeout 120 python3 -m pytest -m gpu tests/gpu/test_fp8_forward.py -k "consumer_lead" -q -x -p no:cacheprovider \
  > "$OUT/tests-fp8.log" 2>&1
tail -3 "$OUT/tests-fp8.log"
tl() {  # label, env assignments, timeline.py args
  env $2 timeout 120 python3 scripts/timeline.py --out "$OUT/tl-$1" "${@:3}" > "$OUT/tl-$1.log" 2>&1
  grep -E "span" "$OUT/tl-$1.log" | sed "s/^/$1: /"
  python3 scripts/timeline_gaps.py "$OUT/tl-$1.json" 2>&1 | grep -v "^==" | sed "s/^/$1: /"
}
DS="--config deepseek-v3 --ep-of-config 8"
tl dsv3-base MOK_TICKET_AHEAD=0 $DS
tl dsv3-ahead MOK_TICKET_AHEAD=1 $DS
tl dsv3-spin2k MOK_FLUSH_SPIN_NS=2000 $DS
tl dsv3-spin4k MOK_FLUSH_SPIN_NS=4000 $DS
tl dsv3-both "MOK_TICKET_AHEAD=1 MOK_FLUSH_SPIN_NS=2000" $DS
tl dsv3-base2 MOK_TICKET_AHEAD=0 $DS
tl dsv3fp8-base MOK_TICKET_AHEAD=0 --config deepseek-v3-fp8 --dtype fp8 --ep-of-config 8
tl dsv3fp8-spin2k MOK_FLUSH_SPIN_NS=2000 --config deepseek-v3-fp8 --dtype fp8 --ep-of-config 8
BW=""
case "$gpu" in *H200*) BW="--backward" ;; esac
timeout 400 python3 scripts/bench_fp8.py $BW --comm-sms 0 --minibatch 4096 --ring-slots 4 --rounds 7 --no-graphs \
  --ab-env MOK_TICKET_AHEAD=1 --ab-env MOK_FLUSH_SPIN_NS=2000 --ab-env-kinds bf16,fp8 > "$OUT/bench-ab.log" 2>&1
grep -E "SUMMARY|A/B|with MOK|dense bf16 torch|MoK (bf16|fp8)|SM clock" "$OUT/bench-ab.log" | cut -c1-330
rm -f "$OUT"/*.json "$OUT"/*.png
