#!/usr/bin/env bash
# One call on the GPU machine: where the multi-process server's time goes under load. For each scenario (batching, then
# batching off) and each protocol of PROTOCOLS (default npy) it starts the server (8 HTTP processes), drives it with
# bench/serving/service_load.py (CLIENTS clients, default 64, raw client; LOAD_ARGS: the layer and input, default the
# demo layer's), and meanwhile records py-spy profiles (native frames, every thread, idle included) of the engine and of
# one HTTP process, after WARMUP_S seconds (default 4; cuda-shm load processes start ~10 s later). Needs the wheels of
# ../shared/device/fetch-wheels in .whl and a py-spy wheel in $PYSPY_WHEEL_DIR (default _ab), both carried. Collapsed
# stacks go to $OUT; a summary per thread is printed last.
# Example, KServe CUDA shared memory with 4 MiB inputs:
#   SCENARIOS=batching PROTOCOLS="cuda-shm shm" CLIENTS=16 WARMUP_S=16 \
#     LOAD_ARGS="--layer dcgan_up1 --batch 8 --height 32 --width 32" bash bench/device/profile_service.sh
set -uo pipefail
source bench/device/env.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy "${PYSPY_WHEEL_DIR:-_ab}"/py_spy-*.whl || exit 1
PYSPY=/tmp/pyspy/bin/py-spy
python3 -c "import logging; logging.basicConfig(level=logging.INFO); import kernels.build as b; b.load()" \
  > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
DURATION=${DURATION:-8}
for scenario in ${SCENARIOS:-batching no-batching}; do
for protocol in ${PROTOCOLS:-npy}; do
  port=$((18000 + RANDOM % 1000))
  extra=""
  [ "$scenario" = no-batching ] && extra="DECONV_MAX_BATCH_SIZE=1"
  scenario_tag=$scenario; [ "$protocol" = npy ] || scenario_tag=$scenario-$protocol
  env DECONV_HTTP_PROCESSES=8 DECONV_LOG_LEVEL=warning DECONV_MAX_QUEUE_SIZE=256 DECONV_SYSTEM_SHM_MAX_REGIONS=256 \
    DECONV_CUDA_SHM_MAX_REGIONS=256 $extra \
    python3 -m service --host 127.0.0.1 --port $port > "$OUT/server-$scenario_tag.log" 2>&1 &
  server=$!
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$port/health/ready" > /dev/null && break
    sleep 0.2
  done
  sleep 1  # every HTTP process connected
  # its own process group, so that stopping it stops its load-generator processes too
  # shellcheck disable=SC2086  # LOAD_ARGS: several arguments
  setsid timeout 120 python3 -m bench.serving.service_load --url "http://127.0.0.1:$port" --client raw --procs 4 \
    --clients "${CLIENTS:-64}" --protocol "$protocol" ${LOAD_ARGS:-} --requests "${REQUESTS:-200000}" \
    --out "$OUT/load-$scenario_tag.json" > "$OUT/load-$scenario_tag.log" 2>&1 &
  load=$!
  sleep "${WARMUP_S:-4}"  # warm-up and steady state
  engine=$(pgrep -f "service.engine.process" | head -1)
  # the busiest HTTP process (connections are spread by the kernel, not evenly)
  front=$(ps -o pid=,pcpu= -p "$(pgrep -d, -f service.http.frontend)" | sort -k2 -rn | awk 'NR == 1 {print $1}')
  $PYSPY record -p "$engine" --native --threads --idle -r 250 -d "$DURATION" --format raw \
    -o "$OUT/engine-$scenario_tag.txt" > "$OUT/pyspy-engine-$scenario_tag.log" 2>&1 &
  p1=$!
  $PYSPY record -p "$front" --native --threads --idle -r 250 -d "$DURATION" --format raw \
    -o "$OUT/front-$scenario_tag.txt" > "$OUT/pyspy-front-$scenario_tag.log" 2>&1 &
  p2=$!
  wait $p1 $p2
  kill -- -$load 2> /dev/null; wait $load 2> /dev/null
  kill -TERM $server; wait $server
  echo "== $scenario_tag: engine $engine, HTTP process $front"
  tail -3 "$OUT/pyspy-engine-$scenario_tag.log"
done
done
rm -f "$OUT/build.log"
python3 -m bench.serving.stacks "$OUT"/engine-*.txt "$OUT"/front-*.txt
