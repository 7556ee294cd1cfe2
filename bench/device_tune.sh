#!/usr/bin/env bash
# One call on the GPU machine for measured kernel choice (kernels.tuning): cold build, the GPU tests of the kernels
# and the service, then bench/kernelbench.py (default choice and measured choice against cuDNN, with and without
# cudnn.benchmark). Needs the wheels of ../shared/device/fetch-wheels in .whl (carried) for the service tests.
# Env: TESTS (pytest paths, default the kernels' and the service's GPU tests; "none" skips them), BENCH_ARGS
# (kernelbench arguments). Logs and JSON go to $OUT; the table comes last.
set -uo pipefail
source bench/device_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/build.log" | tail -1
import logging, time; logging.basicConfig(level=logging.INFO)
t = time.time(); import kernels.build as b; b.load(); print(f"cold build + load {time.time() - t:.1f} s")
PY
TESTS=${TESTS:-tests/kernels tests/service}
if [ "$TESTS" != none ]; then
  timeout 300 python3 -m pytest -q -m cuda $TESTS -p no:cacheprovider -x > "$OUT/pytest.log" 2>&1
  tail -3 "$OUT/pytest.log"
fi
timeout 420 python3 bench/kernelbench.py ${BENCH_ARGS:---reps 20} --out "$OUT/kernelbench.json" > "$OUT/bench.log" 2>&1
grep -v '^{' "$OUT/bench.log" | tail -75
