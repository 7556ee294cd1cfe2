#!/usr/bin/env bash
# One call on the GPU machine: serving large tensors (issue 30, point 4). Three servers start once: batching on and
# batching off (DECONV_HTTP_PROCESSES=8 each), and the naive endpoint (bench/serving/naive_server.py); then, for each
# request size, bench/serving/service_load.py (raw client, 4 load processes) drives
#   on-npy, on-kserve, on-shm  batching on: POST /deconv with .npy; KServe v2 binary tensor extension; KServe system
#                              shared memory (a region per client, registered once, only JSON on the socket);
#   on-cuda-shm                batching on, KServe CUDA shared memory: each client's input and output are CUDA
#                              tensors on one of the server's GPUs (in turn) whose allocations it registered once;
#                              only JSON on the socket, no tensor byte in host memory (skipped with DEVICES=cpu);
#   off-npy                    batching off, .npy: the layer's max_batch_size is the samples of one request, so that
#                              every kernel call holds exactly one request (the off server's repository holds a copy
#                              of the layer for each size, named <layer>_b<batch>, with that limit);
#   naive                      .npy, one nn.ConvTranspose2d call per request.
# Sizes (input bytes, fp32; the output is twice that): 16KiB = demo [1,16,16,16] (64 clients), 64KiB = demo
# [4,16,16,16] (64), 1MiB = dcgan_up1 [2,128,32,32] (32 clients), 4MiB = [8,128,32,32] (16), 16MiB = [32,128,32,32]
# (8); and gpu-16MiB, a layer whose GPU work outweighs the data path's: pix2pix-u5 of bench/kernels/layer_zoo.py in
# exact fp32 (ConvTranspose2d(1024, 256, 4, 2, 1), exported by bench/serving/zoo_layer.py: 16 MiB of weights, not in
# git), [16,1024,16,16] = 16 MiB in and 16 MiB out, 34 GFLOP a request (32 clients).
# Each run stops after MAX_SECONDS (default 3) of measurement or its request count, whichever comes first, after a
# warm-up of at most as long; every step has a timeout, and no run starts after STOP_AFTER_S (default 330) seconds,
# so that the table comes out within a call of ~400 s (the kernel build takes ~100 s of it).
# Figures a run: requests/s, payload GB/s (input + output tensor bytes a request), p50/p99, mean batch, the server's
# CPU ms per request in its HTTP processes and its engine process (the naive server's: its one process), and each
# GPU's utilisation (nvidia-smi's share of time a kernel ran, sampled every 200 ms; mean of the run's second half,
# the measured part).
# Env: SIZES (default "64KiB 1MiB 4MiB 16MiB"), CASES (default "on-npy on-kserve on-shm on-cuda-shm off-npy naive"),
# REQUESTS (a cap for every run instead of each size's), CLIENTS (for every size instead of its own), MAX_SECONDS,
# HTTP_PROCS (8), LOAD_PROCS (4), SERVER_ENV (extra NAME=VALUE settings for the servers, such as
# "DECONV_IPC_SHM_PINNED=false DECONV_IPC_SHM_BYTES=268435456"),
# DEVICES (DECONV_DEVICES, default auto; cpu: no kernel build, the naive server on the CPU), PYTHON (python3),
# DEVICE_ENV (1: source bench/device/env.sh, which installs the wheels of .whl; 0: the current environment),
# STOP_AFTER_S, RUN_TIMEOUT (seconds a run, default 60).
# A dry run on a CPU machine, from the repository with its venv:
#   DEVICE_ENV=0 PYTHON=.venv/bin/python DEVICES=cpu HTTP_PROCS=2 LOAD_PROCS=2 SIZES="64KiB 1MiB" REQUESTS=40 \
#     MAX_SECONDS=2 OUT=/tmp/sizes bash bench/device/sizes.sh
# Needs the wheels of ../shared/device/fetch-wheels in .whl (carried) on the GPU machine. $OUT gets all results in
# one JSON (sizes.json), the table (sizes.txt), which comes last, and the servers' and runs' logs (logs.tar.gz).
set -uo pipefail
if [ "${DEVICE_ENV:-1}" = 1 ]; then
  source bench/device/env.sh
else
  OUT=${OUT:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
fi
logs=$OUT/logs; mkdir -p "$logs"  # packed into one file at the end: the lent machine returns few files
PY=${PYTHON:-python3}
DEVICES=${DEVICES:-auto}
HTTP_PROCS=${HTTP_PROCS:-8}
df -h /dev/shm | tail -1 | awk '{print "/dev/shm: " $2 " size, " $4 " free"}'
if [ "$DEVICES" != cpu ]; then
  timeout -k 10 300 "$PY" -c "import kernels.build as b; b.load()" > "$OUT/build.log" 2>&1 \
    || { tail -20 "$OUT/build.log"; exit 1; }
  echo "build: $SECONDS s"
fi

# size -> layer batch height width clients requests
declare -A CASE=([16KiB]="demo 1 16 16 64 60000" [64KiB]="demo 4 16 16 64 40000" [1MiB]="dcgan_up1 2 32 32 32 10000"
                 [4MiB]="dcgan_up1 8 32 32 16 4000" [16MiB]="dcgan_up1 32 32 32 8 1000"
                 [gpu-16MiB]="pix2pix_u5 16 16 16 32 4000")
# layers not bundled: exported from bench/kernels/layer_zoo.py (bench/serving/zoo_layer.py arguments)
declare -A ZOO=([pix2pix_u5]="pix2pix-u5 --precision fp32")
SIZES=${SIZES:-64KiB 1MiB 4MiB 16MiB}
work=/tmp/device_sizes; rm -rf "$work"; mkdir -p "$work/on" "$work/off" "$work/runs"
layers=""
for size in $SIZES; do
  [ -n "${CASE[$size]:-}" ] || { echo "unknown size $size (${!CASE[*]})"; exit 2; }
  read -r layer batch _ <<< "${CASE[$size]}"
  if [ -n "${ZOO[$layer]:-}" ]; then
    [ -f "$work/on/$layer.json" ] || "$PY" -m bench.serving.zoo_layer ${ZOO[$layer]} "$work/on" > /dev/null || exit 1
    src=$work/on
  else
    cp -f "layers/$layer.json" "layers/$layer.safetensors" "$work/on/"; src=layers
  fi
  case ",$layers," in *",$layer,"*) ;; *) layers=${layers:+$layers,}$layer ;; esac
  # batching off: a copy of the layer whose kernel calls hold one request of this size
  "$PY" - "$layer" "$batch" "$work/off" "$src" <<'PY' || exit 1
import json, shutil, sys
layer, batch, off, src = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
cfg = json.load(open(f"{src}/{layer}.json"))
cfg.update(name=f"{layer}_b{batch}", max_batch_size=batch)
json.dump(cfg, open(f"{off}/{cfg['name']}.json", "w"), indent=1)
shutil.copy(f"{src}/{layer}.safetensors", f"{off}/{cfg['name']}.safetensors")
PY
done

declare -A port=([on]=18401 [off]=18402 [naive]=18403) pid=()
common=(DECONV_HTTP_PROCESSES="$HTTP_PROCS" DECONV_DEVICES="$DEVICES" DECONV_LOG_LEVEL=warning
        DECONV_MAX_QUEUE_SIZE=256 DECONV_SYSTEM_SHM_MAX_REGIONS=256 DECONV_CUDA_SHM_MAX_REGIONS=256)
read -r -a extra <<< "${SERVER_ENV:-}"
common+=("${extra[@]}")
[ -n "${SERVER_ENV:-}" ] && echo "server settings: ${SERVER_ENV}"
env "${common[@]}" DECONV_LAYER_REPOSITORY="$work/on" "$PY" -m service --host 127.0.0.1 --port "${port[on]}" \
  > "$logs/server-on.log" 2>&1 &
pid[on]=$!
env "${common[@]}" DECONV_LAYER_REPOSITORY="$work/off" "$PY" -m service --host 127.0.0.1 --port "${port[off]}" \
  > "$logs/server-off.log" 2>&1 &
pid[off]=$!
naive_device=auto; [ "$DEVICES" = cpu ] && naive_device=cpu
"$PY" -m bench.serving.naive_server --port "${port[naive]}" --layer "$layers" --repository "$work/on" \
  --device "$naive_device" > "$logs/server-naive.log" 2>&1 &
pid[naive]=$!
stop_servers() {
  kill -TERM "${pid[@]}" 2> /dev/null
  for p in "${pid[@]}"; do timeout 30 tail --pid="$p" -f /dev/null; kill -KILL "$p" 2> /dev/null; done
}
trap stop_servers EXIT
for key in on off naive; do  # ready, and (the service) every HTTP process serving
  for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:${port[$key]}/health/ready" > /dev/null; then
      [ "$key" = naive ] && break
      n=$(curl -s "http://127.0.0.1:${port[$key]}/metrics" | awk '/^deconv_http_processes /{print int($2)}')
      [ "${n:-0}" -ge "$HTTP_PROCS" ] && break
    fi
    kill -0 "${pid[$key]}" 2> /dev/null || { echo "server $key exited"; tail -20 "$logs/server-$key.log"; exit 1; }
    sleep 0.2
  done
done
echo "servers ready: $SECONDS s"

CASES=${CASES:-on-npy on-kserve on-shm on-cuda-shm off-npy naive}
cuda_devices=$DEVICES; [ "$DEVICES" = auto ] && cuda_devices=all  # cuda-shm clients: the server's GPUs, in turn
[ "$DEVICES" = cpu ] && CASES=$(echo "$CASES" | tr ' ' '\n' | grep -vx on-cuda-shm | tr '\n' ' ')
gpu_util=(); [ "$DEVICES" = cpu ] || gpu_util=(--gpu-util)
for size in $SIZES; do
  read -r layer batch height width clients requests <<< "${CASE[$size]}"
  clients=${CLIENTS:-$clients}
  for c in $CASES; do
    [ "$SECONDS" -gt "${STOP_AFTER_S:-330}" ] && { echo "no $size $c: $SECONDS s gone"; continue; }
    server=${c%%-*}; proto=${c#*-}; [ "$c" = naive ] && proto=npy
    name=$layer; repo=$work/on
    [ "$server" = off ] && { name=${layer}_b$batch; repo=$work/off; }
    timeout -k 10 "${RUN_TIMEOUT:-60}" "$PY" -m bench.serving.service_load --url "http://127.0.0.1:${port[$server]}" \
      --server-pid "${pid[$server]}" --devices "$DEVICES" --repository "$repo" --layer "$name" --batch "$batch" \
      --height "$height" --width "$width" --client raw --protocol "$proto" --procs "${LOAD_PROCS:-4}" \
      --clients "$clients" --requests "${REQUESTS:-$requests}" --warmup "$((2 * clients))" \
      --cuda-devices "$cuda_devices" "${gpu_util[@]}" \
      --max-seconds "${MAX_SECONDS:-3}" --timeout 30 --out "$work/runs/$size-$c.json" \
      > "$logs/run-$size-$c.log" 2>&1 || { echo "$size $c failed:"; tail -3 "$logs/run-$size-$c.log"; }
  done
  echo "$size: $SECONDS s"
done
stop_servers; trap - EXIT
leftover=$(ls /dev/shm | grep -c '^deconv-client-')
[ "$leftover" = 0 ] || echo "left in /dev/shm: $leftover deconv-client-* objects"

tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$logs"
"$PY" - "$work/runs" "$OUT" "$SIZES" "$CASES" <<'PY' | tee "$OUT/sizes.txt"
import json, os, sys
runs, out, sizes, cases = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split()
results, device = {}, None
for size in sizes:
    for case in cases:
        path = f"{runs}/{size}-{case}.json"
        if os.path.exists(path):
            report = json.load(open(path))
            device = device or report["device"]
            results[f"{size} {case}"] = {"config": report["config"], **report["results"][0]}
json.dump({"benchmark": "device_sizes", "device": device, "host_cpus": os.cpu_count(), "results": results},
          open(f"{out}/sizes.json", "w"), indent=1)
print(f"device: {device}")
print(f"{'size':<9} {'case':<11} {'req/s':>9} {'GB/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'batch':>6} "
      f"{'http ms/req':>11} {'engine ms/req':>13} {'gpu %':>9} {'ok':>7} {'errors':>6} {'rel err':>8}")
for key, r in results.items():
    size, case = key.split()
    cpu = r.get("server_cpu_ms_per_request") or {}
    http = cpu.get("http", cpu.get("naive", cpu.get("main")))
    f = lambda v, spec: format(v, spec) if v is not None else format("-", spec.split(".")[0])
    gpus = "/".join(f"{u:.0f}" for u in (r.get("gpu_util_pct") or {}).values()) or "-"
    print(f"{size:<9} {case:<11} {r['requests_per_s']:>9.1f} {f(r.get('payload_gb_per_s'), '>7.3f')} "
          f"{f(r['p50_ms'], '>8.2f')} {f(r['p99_ms'], '>8.2f')} {f(r['mean_batch_size'], '>6.1f')} "
          f"{f(http, '>11.3f')} {f(cpu.get('engine'), '>13.3f')} {gpus:>9} {r['ok']:>7} {r['requests'] - r['ok']:>6} "
          f"{f(r['max_rel_err_vs_fp64'], '>8.1e')}")
missing = [f"{s} {c}" for s in sizes for c in cases if f"{s} {c}" not in results]
if missing:
    print(f"not measured: {', '.join(missing)}")
PY
