#!/usr/bin/env bash
# One call on the GPU machine for the service load benchmark: single-process and multi-process servers, batching
# on/off and the naive endpoint, with the raw client. Needs the wheels of ../shared/device/fetch-wheels in .whl
# (carried). Env: REQUESTS (default 20000), HTTP_PROCS (space-separated, default "1 4 8"), LOAD_PROCS (default 4),
# SKIP_TESTS=1 to skip the service GPU tests. Logs and JSON go to $OUT.
set -uo pipefail
source bench/device/env.sh
python3 -c "import logging; logging.basicConfig(level=logging.INFO); import kernels.build as b; b.load()" \
  > "$OUT/build.log" 2>&1
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 300 python3 -m pytest -q -m cuda tests/service -p no:cacheprovider > "$OUT/pytest-service.log" 2>&1
  tail -2 "$OUT/pytest-service.log"
fi
for n in ${HTTP_PROCS:-1 4 8}; do
  scen=batching,no-batching; [ "$n" = 1 ] && scen=batching,no-batching,naive
  echo "== DECONV_HTTP_PROCESSES=$n"
  timeout 240 python3 -m bench.serving.service_load --client raw --clients 64 --procs "${LOAD_PROCS:-4}" \
    --requests "${REQUESTS:-20000}" --http-processes "$n" --scenarios "$scen" \
    --out "$OUT/service_load-http$n.json" > "$OUT/service_load-http$n.log" 2>&1
  tail -5 "$OUT/service_load-http$n.log"
done
