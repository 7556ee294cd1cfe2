#!/usr/bin/env bash
# One call on the GPU machine for measured kernel choice (kernels.tuning): cold build, the GPU tests of the kernels
# and the service, then bench/kernels/kernelbench.py (default choice and measured choice against cuDNN, with and without
# cudnn.benchmark). Needs the wheels of ../shared/device/fetch-wheels in .whl (carried) for the service tests.
# Env: TESTS (pytest paths, default the kernels' and the service's GPU tests; "none" skips them), BENCH_ARGS
# (kernelbench arguments), COMPILE=0 (skip the torch.compile table). Logs and JSON go to $OUT; the table comes last.
set -uo pipefail
source bench/device/env.sh
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
timeout 300 python3 -m bench.kernels.kernelbench ${BENCH_ARGS:---reps 20} --out "$OUT/kernelbench.json" > "$OUT/bench.log" 2>&1
# torch.compile of the PyTorch layer, TF32, in the time the call has left (COMPILE=0 skips it).
left=$((550 - SECONDS))
if [ "${COMPILE:-1}" = 1 ] && [ "$left" -gt 60 ]; then
  timeout "$left" python3 -m bench.kernels.kernelbench --modes tf32 --compile --layers-hw 0 --reps 20 --no-tune \
    --out "$OUT/kernelbench-compile.json" > "$OUT/compile.log" 2>&1
  grep -h '"torch_compile_ms"' "$OUT/compile.log" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(f\"compile {r['id']}: ours {r['ours_ms']:.3f} compiled {r['torch_compile_ms']:.3f} cuDNN {r['cudnn_ms']:.3f}\")"
fi
grep -v '^{' "$OUT/bench.log" | tail -75
