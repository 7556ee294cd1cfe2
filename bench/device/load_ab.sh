#!/usr/bin/env bash
# One call on the GPU machine comparing server settings under the same load, one after the other on one machine:
# each variant of LOAD_VARIANTS ("name=VAR=value,VAR=value ...", space-separated; default: the shared-memory
# engine link, the socket, shared memory again) runs bench/serving/service_load.py with those environment variables.
# Env: REQUESTS (default 40000), ROUNDS (default 3), HTTP_PROCS (default 8), LOAD_PROCS (default 4), SCENARIOS
# (default batching,no-batching; a variant that only changes batching can skip no-batching). Needs the
# wheels of ../shared/device/fetch-wheels in .whl (carried). Logs and JSON go to $OUT; a table of the medians last.
set -uo pipefail
source bench/device/env.sh
t0=$(date +%s)
python3 -c "import logging; logging.basicConfig(level=logging.INFO); import kernels.build as b; b.load()" \
  > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
variants=${LOAD_VARIANTS:-"shm=DECONV_IPC_SHM_BYTES=67108864 socket=DECONV_IPC_SHM_BYTES=0 shm2=DECONV_IPC_SHM_BYTES=67108864"}
for v in $variants; do
  name=${v%%=*}; settings=${v#*=}
  echo "== $name ($settings)"
  env ${settings//,/ } timeout 280 python3 -m bench.serving.service_load --client raw --clients 64 \
    --procs "${LOAD_PROCS:-4}" --requests "${REQUESTS:-40000}" --rounds "${ROUNDS:-3}" \
    --http-processes "${HTTP_PROCS:-8}" --scenarios "${SCENARIOS:-batching,no-batching}" \
    --out "$OUT/service_load-$name.json" > "$OUT/service_load-$name.log" 2>&1
  tail -6 "$OUT/service_load-$name.log"
done
