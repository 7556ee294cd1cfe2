#!/usr/bin/env bash
# One call on the GPU machine: build the kernels, then every GPU test (kernels, then the service's), then
# optionally the KernelBench table. Each step has a time limit, and the servers a service test leaves behind (when
# its limit kills it) are stopped before the next step, so that one hung step costs only its own time.
# Usage (from the repo root): bash bench/device/check.sh [pytest -k expression] [kernelbench args...]
# Env: KERNEL_TESTS_S (default 240), SERVICE_TESTS_S (240), SKIP_SERVICE=1 (kernels only), SKIP_BENCH=1 (no
# KernelBench table). The service tests need the wheels of ../shared/device/fetch-wheels in .whl (carried; with
# tritonclient[http,grpc] among them for the tritonclient tests), installed by bench/device/env.sh; without .whl
# they are skipped. Logs go to $OUT (or ./out) so that they come back even when a step fails; a summary is last.
set -uo pipefail
if [ -d .whl ]; then
  source bench/device/env.sh
else
  OUT=${OUT:-out}; mkdir -p "$OUT"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  export DECONV_KERNEL_CACHE=${DECONV_KERNEL_CACHE:-/tmp/deconv-kernel-cache}
  SKIP_SERVICE=1
fi
K=${1:-}; shift || true
stop_servers() { pkill -f "python3 -m service" 2> /dev/null; sleep 1; pkill -9 -f "python3 -m service" 2> /dev/null; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/build.log"
import logging, time; logging.basicConfig(level=logging.INFO)
t = time.time(); import kernels.build as b; b.load(); print(f"first load {time.time() - t:.1f} s")
PY
summary=()
run_tests() {  # name, limit, paths...
  local name=$1 limit=$2; shift 2
  timeout -k 10 "$limit" python3 -m pytest -q -m cuda -p no:cacheprovider -p no:logging --tb=short "$@" \
    ${K:+-k "$K"} > "$OUT/$name.log" 2>&1
  local rc=$?
  stop_servers
  summary+=("$name: rc=$rc $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$OUT/$name.log" | tail -1)")
}
run_tests kernels "${KERNEL_TESTS_S:-240}" tests/kernels
[ "${SKIP_SERVICE:-0}" = 1 ] || run_tests service "${SERVICE_TESTS_S:-240}" tests/service
if [ "${SKIP_BENCH:-0}" != 1 ]; then python3 -m bench.kernels.kernelbench "$@" 2>&1 | tee "$OUT/bench.log" | tail -30; fi
cp docs/benchmarks/kernelbench-*.json "$OUT/" 2>/dev/null || true
printf '%s\n' "${summary[@]}"
