#!/usr/bin/env bash
# One GPU call for design measurements: cold build, bench/kernels/probes.py (PROBES, default "tf32 staging host"), then
# the kernels' GPU tests (TESTS; "none" skips) in the time left. The built extension is packed into $OUT/kcache.tar.gz
# (one file: the lent machine returns few) when KEEP_BUILD=1, so that a later call can unpack and carry it
# (DECONV_KERNEL_CACHE) instead of building again. Logs and JSON go to $OUT; the test summary comes last.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DECONV_KERNEL_CACHE=${DECONV_KERNEL_CACHE:-/tmp/deconv-kernel-cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import kernels.build as b; b.load()" > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build: $SECONDS s"
if [ "${KEEP_BUILD:-0}" = 1 ]; then
  tar -czf "$OUT/kcache.tar.gz" --exclude='*.o' -C "$DECONV_KERNEL_CACHE" . && du -sh "$OUT/kcache.tar.gz"
fi
for probe in ${PROBES:-tf32 staging host}; do
  timeout 200 python3 -m bench.kernels.probes "$probe" --out "$OUT/probe-$probe.json" > "$OUT/probe-$probe.log" 2>&1 \
    || { echo "probe $probe failed:"; tail -5 "$OUT/probe-$probe.log"; }
  echo "probe $probe: $SECONDS s"
done
TESTS=${TESTS:-tests/kernels}
if [ "$TESTS" != none ]; then
  timeout $((570 - SECONDS)) python3 -m pytest -q -m cuda $TESTS -p no:cacheprovider > "$OUT/pytest.log" 2>&1
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20; tail -1 "$OUT/pytest.log"
fi
