#!/usr/bin/env bash
# One GPU call for the zoo benchmark: cold build, the gemm kernel's GPU tests (TESTS; "none" skips), then
# bench/kernels/zoo.py (ZOO_ARGS) within the call's time. The JSON and its log go to $OUT; the summary table comes last.
# ZOO_ARGS=--cutlass times CUTLASS's dgrad kernels too: their headers from an installed nvidia-cutlass, or from an
# nvidia_cutlass wheel carried in .whl/ (bench/kernels/cutlass/build.py); their build adds ~30 s.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DECONV_KERNEL_CACHE=/tmp/deconv-kernel-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import kernels.build as b; b.load()" > "$OUT/build.log" 2>&1 || tail -20 "$OUT/build.log"
TESTS=${TESTS:-tests/kernels/test_cuda_gemm.py}
if [ "$TESTS" != none ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m cuda $TESTS -p no:cacheprovider > "$OUT/pytest.log" 2>&1
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20; tail -1 "$OUT/pytest.log"
fi
left=$((585 - SECONDS))
timeout "$left" python3 -m bench.kernels.zoo --budget-s $((left - 90)) --out "$OUT" ${ZOO_ARGS:-} 2> "$OUT/zoo.err" | tail -45
