#!/usr/bin/env bash
# One call on the GPU machine comparing this tree's server with another version's under the same load. Four
# servers start once (each version with batching and with DECONV_MAX_BATCH_SIZE=1; 8 HTTP processes each); then
# every round drives each of them in turn with bench/serving/service_load.py (this tree's load generator, raw client, 4
# processes, 64 clients), the versions' order flipped every round, so that the machine's drift falls on both.
# MB_LAYER (e.g. dcgan_up1, which LAYERS must include) adds a multi-megabyte case to every round, batching on
# only: MB_SHAPE samples,height,width a request (default 8,32,32), MB_CLIENTS (16), MB_REQUESTS (2000).
# Env: OLD_DIR (required: the other version's tree, e.g. `git archive COMMIT | tar -x -C _ab/old`, carried; its
# servers run from there, since `python -m service` imports the package of its working directory; when its
# kernels/ equals this tree's, it uses this tree's, so that both load one build), ROUNDS (default 5), REQUESTS_ON
# and REQUESTS_OFF (per round, default 60000 and 20000: a few seconds each), LAYERS (default demo: the servers'
# repository holds only these bundled layers, which keeps four start-ups short; "all" for the bundled one), NEW_ENV
# (settings for this tree's servers only, e.g. "DECONV_WORKERS_PER_DEVICE=2", with OLD_DIR a copy of this tree: the
# A/B of a setting).
# Needs the wheels of ../shared/device/fetch-wheels in .whl (carried). Per-run JSON and logs stay in /tmp/version_ab;
# $OUT gets the servers' logs, every run's results in one JSON, and the table, which comes last: requests/s per round
# and median, p99, mean batch, batching's ratio to batching off per version.
set -uo pipefail
source bench/device/env.sh
root=$PWD
old=$(cd "${OLD_DIR:?set OLD_DIR to the tree of the other version}" && pwd) || exit 2
if diff -rq "$old/kernels" "$root/kernels" > /dev/null; then
  rm -rf "$old/kernels" && ln -s "$root/kernels" "$old/kernels"
fi
# Both builds at once (each is one compiler process, mostly on one core); one when the kernels are the same.
(cd "$root" && python3 -c "import kernels.build as b; b.load()") > "$OUT/build.log" 2>&1 & new_build=$!
(cd "$old" && python3 -c "import kernels.build as b; b.load()") > "$OUT/build-old.log" 2>&1 & old_build=$!
wait $new_build || { tail -20 "$OUT/build.log"; exit 1; }
wait $old_build || { tail -20 "$OUT/build-old.log"; exit 1; }
echo "builds: $SECONDS s"
repo=$root/layers
if [ "${LAYERS:-demo}" != all ]; then
  repo=/tmp/version_ab_layers; rm -rf "$repo"; mkdir -p "$repo"
  for name in ${LAYERS:-demo}; do cp "$root/layers/$name.json" "$root/layers/$name.safetensors" "$repo/"; done
fi
work=/tmp/version_ab; rm -rf "$work"; mkdir -p "$work"
declare -A port=([new-on]=18101 [new-off]=18102 [old-on]=18103 [old-off]=18104)
pids=()
for key in new-on new-off old-on old-off; do
  dir=$root; [ "${key%-*}" = old ] && dir=$old
  extra=""; [ "${key#*-}" = off ] && extra="DECONV_MAX_BATCH_SIZE=1"
  [ "${key%-*}" = new ] && extra="$extra ${NEW_ENV:-}"
  (cd "$dir" && exec env DECONV_HTTP_PROCESSES=8 DECONV_LOG_LEVEL=warning DECONV_MAX_QUEUE_SIZE=256 $extra \
    DECONV_LAYER_REPOSITORY="$repo" python3 -m service --host 127.0.0.1 --port "${port[$key]}") \
    > "$OUT/server-$key.log" 2>&1 &
  pids+=($!)
done
for key in "${!port[@]}"; do
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:${port[$key]}/health/ready" > /dev/null && break; sleep 0.2; done
done
sleep 3  # every HTTP process connected
echo "servers ready: $SECONDS s"
declare -A requests=([on]=${REQUESTS_ON:-60000} [off]=${REQUESTS_OFF:-20000})
for r in $(seq "${ROUNDS:-5}"); do
  # the table must come out within the call's limit: no round starts after STOP_AFTER_S (default 480) seconds
  [ "$SECONDS" -gt "${STOP_AFTER_S:-480}" ] && { echo "no round $r: ${SECONDS} s gone"; break; }
  order="new old"; [ $((r % 2)) = 0 ] && order="old new"
  for s in on off; do
    for v in $order; do
      timeout 120 python3 -m bench.serving.service_load --url "http://127.0.0.1:${port[$v-$s]}" --repository "$repo" \
        --client raw --procs 4 --clients 64 --requests "${requests[$s]}" --out "$work/$v-$s-$r.json" \
        > "$work/$v-$s-$r.log" 2>&1 || tail -3 "$work/$v-$s-$r.log"
    done
  done
  if [ -n "${MB_LAYER:-}" ]; then  # the multi-megabyte case, batching on: MB_SHAPE is batch,height,width
    IFS=, read -r mb_n mb_h mb_w <<< "${MB_SHAPE:-8,32,32}"
    for v in $order; do
      timeout 120 python3 -m bench.serving.service_load --url "http://127.0.0.1:${port[$v-on]}" --repository "$repo" \
        --layer "$MB_LAYER" --batch "$mb_n" --height "$mb_h" --width "$mb_w" --client raw --procs 4 \
        --clients "${MB_CLIENTS:-16}" --requests "${MB_REQUESTS:-2000}" --warmup 50 --out "$work/$v-mb-$r.json" \
        > "$work/$v-mb-$r.log" 2>&1 || tail -3 "$work/$v-mb-$r.log"
    done
  fi
  echo "round $r: $SECONDS s"
done
kill -TERM "${pids[@]}"; wait "${pids[@]}"
python3 - "$work" "$OUT" <<'PY' | tee "$OUT/version_ab.txt"
import glob, json, statistics, sys
work, out = sys.argv[1:]
runs = {}
for path in glob.glob(f"{work}/*.json"):
    v, s, r = path.rsplit("/", 1)[1][:-5].split("-")
    runs.setdefault((v, s), {})[int(r)] = json.load(open(path))["results"][0]
json.dump({f"{v}-{s}-{r}": x for (v, s), rs in sorted(runs.items()) for r, x in sorted(rs.items())},
          open(f"{out}/version_ab.json", "w"), indent=1)
for v in ("new", "old"):
    mb = runs.get((v, "mb"), {})
    if mb:
        rs = [mb[r] for r in sorted(mb)]
        print(f"{v} multi-MB: req/s {[round(x['requests_per_s']) for x in rs]} median "
              f"{statistics.median(x['requests_per_s'] for x in rs):.0f}; p50 ms {[round(x['p50_ms'], 1) for x in rs]}; "
              f"p99 ms {[round(x['p99_ms'], 1) for x in rs]}")
for v in ("new", "old"):
    med = {}
    for s in ("on", "off"):
        rs = runs.get((v, s), {})
        rps = [rs[r]["requests_per_s"] for r in sorted(rs)]
        med[s] = statistics.median(rps) if rps else float("nan")
        print(f"{v} {s}: req/s {[round(x) for x in rps]} median {med[s]:.0f}; p99 ms "
              f"{[round(rs[r]['p99_ms'], 1) for r in sorted(rs)]}; mean batch "
              f"{[round(rs[r].get('mean_batch_size') or 0, 1) for r in sorted(rs)]}")
    on, off = runs.get((v, "on"), {}), runs.get((v, "off"), {})
    per = [on[r]["requests_per_s"] / off[r]["requests_per_s"] for r in sorted(on) if r in off]
    print(f"{v}: ratio of medians {med['on'] / med['off']:.2f}x, per round {[round(x, 2) for x in per]}")
PY
