#!/usr/bin/env bash
# GPU checks and microbenchmarks, in one call on a GPU machine without network access:
#   bash benchmarks/device_check.sh OUT_DIR
# Installs flexoff without dependencies (the machine has torch, transformers, accelerate, triton;
# carry PuLP as a wheel in .whl/), runs the GPU tests, the kernel, CPU-attention and overlap
# benchmarks, measures the hardware profile, and a short OPT-30B run. Logs go to OUT_DIR.
# QUICK=1 skips CPU attention, profile and overlap; TUNE=1 sweeps kernel tiles.
set -u
OUT=${1:?usage: device_check.sh OUT_DIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLEXOFF_CACHE=/tmp/flexoff-cache
step() { echo "=== $1 ($(date +%T))"; }
step install
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/install.log" 2>&1 || tail -5 "$OUT/install.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.get_num_threads())"
export FLEXOFF_COMMIT=$(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
step "gpu tests"
python3 -m pytest -q -x -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
step kernels
python3 benchmarks/kernels.py --out "$OUT" ${TUNE:+--tune} 2>&1 | tail -40
if [ -z "${QUICK:-}" ]; then
  step "cpu attention"
  python3 benchmarks/cpu_attention.py --out "$OUT" 2>&1 | tail -12
  step profile
  flexoff profile --output "$OUT/hw-profile.json" 2>&1 | tail -25
  step overlap
  python3 benchmarks/overlap.py --model dummy:opt-6.7b --prompt-len 512 --gpu-batch-size 16 --out "$OUT" 2>&1 | tail -5
fi
step "opt-30b short"
python3 benchmarks/throughput.py --model dummy:opt-30b --prompt-len 512 --gen-len 4 --gpu-mem 16GiB \
  --policy auto --policy "32x2:0,100,0,100,100,0:a" --hardware benchmarks/data/h200-measured.json \
  --out "$OUT" 2>&1 | tail -8
step done
