#!/usr/bin/env bash
# One call on the GPU machine: build the kernels, run the GPU tests, run the KernelBench table.
# Usage (from the repo root): bash bench/device_check.sh [pytest -k expression] [kernelbench args...]
# Logs go to $OUT (or ./out) so that they come back even when a step fails.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export DECONV_KERNEL_CACHE=${DECONV_KERNEL_CACHE:-/tmp/deconv-kernel-cache}
K=${1:-}; shift || true
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/build.log"
import logging, time; logging.basicConfig(level=logging.INFO)
t = time.time(); import kernels.build as b; b.load(); print(f"first load {time.time() - t:.1f} s")
PY
python3 -m pytest -q -m cuda tests/kernels ${K:+-k "$K"} -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -40
if [ "${SKIP_BENCH:-0}" != 1 ]; then python3 bench/kernelbench.py "$@" 2>&1 | tee "$OUT/bench.log" | tail -30; fi
cp docs/benchmarks/kernelbench-*.json "$OUT/" 2>/dev/null || true
