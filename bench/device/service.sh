#!/usr/bin/env bash
# One call on the GPU machine for the service: GPU tests of kernels and service, the load benchmark, and the
# KernelBench + bundled-layers table. Needs the wheels of ../shared/device/fetch-wheels in .whl (carried).
set -uo pipefail
source bench/device/env.sh
python3 -c "import logging; logging.basicConfig(level=logging.INFO); import kernels.build as b; b.load()" 2>&1 \
  | tee "$OUT/build.log"
python3 -m pytest -q -m cuda tests/kernels tests/service -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -15
python3 -m bench.serving.service_load --clients 64 --requests ${REQUESTS:-4000} --out "$OUT/service_load.json" 2>&1 \
  | tee "$OUT/service_load.log" | tail -15
[ "${SKIP_KERNELBENCH:-0}" = 1 ] || python3 -m bench.kernels.kernelbench --reps ${REPS:-20} --out "$OUT/kernelbench.json" 2>&1 \
  | tee "$OUT/bench.log" | tail -50
