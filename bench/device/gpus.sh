#!/usr/bin/env bash
# One call on a machine with two GPUs (kind nvidia-h100-x2): one GPU against two under the same load (issue 30,
# point 5). bench/device/sizes.sh runs twice, with DECONV_DEVICES=0 and then DECONV_DEVICES=all (a GPU worker per
# device, the batcher spreading batches over them), the same sizes and cases (SIZES, default "64KiB 4MiB 16MiB";
# CASES, default "on-npy on-kserve on-shm on-cuda-shm"; cuda-shm clients' tensors on the GPUs the server computes
# on, in turn), 8 HTTP processes each. The two tables come last; every file of both runs
# is packed into $OUT/gpus.tar.gz (the lent machine returns few files). Needs the wheels of
# ../shared/device/fetch-wheels in .whl (carried).
set -uo pipefail
source bench/device/env.sh
# The kernels built first, so that both runs start with them cached (a cold build takes ~2 minutes of a run).
timeout 300 python3 -c "import kernels.build as b; b.load()" > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
echo "build: $SECONDS s"
for devs in 0 all; do
  OUT=$OUT/gpus-$devs DEVICES=$devs SIZES=${SIZES:-"64KiB 4MiB 16MiB"} CASES=${CASES:-"on-npy on-kserve on-shm on-cuda-shm"} \
    STOP_AFTER_S=${STOP_AFTER_S:-200} bash bench/device/sizes.sh > "$OUT/gpus-$devs.log" 2>&1 \
    || { echo "DECONV_DEVICES=$devs failed:"; tail -20 "$OUT/gpus-$devs.log"; }
  echo "DECONV_DEVICES=$devs: $SECONDS s"
done
tar -czf "$OUT/gpus.tar.gz" -C "$OUT" gpus-0 gpus-all gpus-0.log gpus-all.log && rm -rf "$OUT/gpus-0" "$OUT/gpus-all"
for devs in 0 all; do echo "== DECONV_DEVICES=$devs"; grep -A40 "^device:" "$OUT/gpus-$devs.log"; done
