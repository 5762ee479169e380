#!/usr/bin/env bash
# The device measurements behind benchmarks/RESULTS.md, in two calls that each fit a 10-minute lease:
#   PHASE=A bash benchmarks/device_measure.sh OUT   # OPT-30B 512+32, 16 GiB GPU: policies, ablations, frontier
#   PHASE=B bash benchmarks/device_measure.sh OUT   # eval run on OPT-30B; the Accelerate baseline
#   PHASE=C bash benchmarks/device_measure.sh OUT   # a shortened A and B in one lease
# Predictions use benchmarks/data/h200-measured.json (flexoff profile on the device, with CPU attention
# measured at OPT-30B's decode shape by benchmarks/cpu_attention.py).
set -u
OUT=${1:?usage: PHASE=A|B device_measure.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLEXOFF_CACHE=/tmp/flexoff-cache
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/install.log" 2>&1 || tail -5 "$OUT/install.log"
export FLEXOFF_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
HW=benchmarks/data/h200-measured.json
CPU=(--policy "24x2:0,100,0,100,100,0:a" --policy "32x1:0,100,0,100,100,0:a" --policy "16x2:0,100,0,100,100,0:a")
if [ "${PHASE:-A}" = D ]; then  # the last minutes of a lease: auto on OPT-30B, then the eval run
  timeout 95 python3 benchmarks/throughput.py --model dummy:opt-30b --prompt-len 512 --gen-len 32 \
    --gpu-mem 16GiB --cpu-mem 100GiB --hardware $HW --policy auto --time-budget 45 --out "$OUT" 2>&1 | tail -5
  echo "=== eval ($(date +%T))"
  timeout 125 flexoff eval run --run-entries "synthetic_reasoning:mode=pattern_match" --model dummy:opt-30b \
    --policy auto --gpu-mem 48GiB --cpu-mem 100GiB --hardware $HW --max-eval-instances 200 --suite device \
    --output-path "$OUT/eval" -q 2>&1 | tail -4
  flexoff eval summarize --suite device --output-path "$OUT/eval" 2>&1 | tail -3
  cp "$OUT"/eval/runs/device/*/stats.json "$OUT/eval_stats.json" 2>/dev/null
  cp "$OUT"/eval/runs/device/summary.md "$OUT/eval_summary.md" 2>/dev/null
elif [ "${PHASE:-A}" = C ]; then  # everything in one lease, in priority order, each part time-limited
  timeout 300 python3 benchmarks/throughput.py --model dummy:opt-30b --prompt-len 512 --gen-len 32 \
    --gpu-mem 16GiB --cpu-mem 100GiB --hardware $HW --policy auto "${CPU[@]:0:4}" --ablations \
    --frontier 8x1 --time-budget 215 --out "$OUT" 2>&1 | grep -v "^\s*$" | tail -40
  echo "=== eval ($(date +%T))"
  timeout 130 flexoff eval run --run-entries "synthetic_reasoning:mode=pattern_match" --model dummy:opt-30b \
    --policy auto --gpu-mem 48GiB --cpu-mem 100GiB --hardware $HW --max-eval-instances 200 --suite device \
    --output-path "$OUT/eval" -q 2>&1 | tail -4
  flexoff eval summarize --suite device --output-path "$OUT/eval" 2>&1 | tail -3
  echo "=== baseline ($(date +%T))"
  timeout 125 python3 benchmarks/throughput.py --model dummy:opt-30b --prompt-len 512 --gen-len 32 --gpu-mem 16GiB \
    --cpu-mem 100GiB --no-flexoff --baseline 8 --out "$OUT" 2>&1 | tail -4
elif [ "${PHASE:-A}" = A ]; then
  timeout 570 python3 benchmarks/throughput.py --model dummy:opt-30b --prompt-len 512 --gen-len 32 \
    --gpu-mem 16GiB --cpu-mem 100GiB --hardware $HW --policy auto "${CPU[@]}" --ablations --frontier 8x1,1x1 \
    --time-budget 440 --out "$OUT" 2>&1 | grep -v "^\s*$"
else
  echo "=== eval ($(date +%T))"
  timeout 290 flexoff eval run --run-entries "synthetic_reasoning:mode=pattern_match" --model dummy:opt-30b \
    --policy auto --gpu-mem 48GiB --cpu-mem 100GiB --hardware $HW --max-eval-instances 200 --suite device \
    --output-path "$OUT/eval" -q 2>&1 | tail -6
  flexoff eval summarize --suite device --output-path "$OUT/eval" 2>&1 | tail -4
  echo "=== baseline ($(date +%T))"
  timeout 270 python3 benchmarks/throughput.py --model dummy:opt-30b --prompt-len 512 --gen-len 32 --gpu-mem 16GiB \
    --cpu-mem 100GiB --no-flexoff --baseline 8 --out "$OUT" 2>&1 | tail -6
fi
echo "=== done ($(date +%T))"
