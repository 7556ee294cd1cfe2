#!/usr/bin/env bash
# One GPU call for the gemm kernel: cold build, its GPU tests (TESTS; "none" skips), bench/kernels/gemm_probe.py over
# the zoo (PROBE_ARGS), and with NCU=1 Nsight Compute on the gemm kernel and cuDNN's for one layer (NCU_ARGS, gemm_probe
# arguments). Logs go to $OUT; the probe's table comes last.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 DECONV_KERNEL_CACHE=/tmp/deconv-kernel-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/build.log" | tail -1
import logging, time; logging.basicConfig(level=logging.INFO)
t = time.time(); import kernels.build as b; b.load(); print(f"cold build + load {time.time() - t:.1f} s")
PY
TESTS=${TESTS:-tests/kernels/test_cuda_gemm.py}
if [ "$TESTS" != none ]; then
  timeout 240 python3 -m pytest -q -m cuda $TESTS -p no:cacheprovider > "$OUT/pytest.log" 2>&1
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20; tail -1 "$OUT/pytest.log"
fi
if [ "${NCU:-0}" = 1 ]; then
  metrics="--metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__average_warp_latency_issue_stalled_barrier,lts__t_bytes.sum,dram__bytes.sum"
  for re in gemm_kernel "sm90|xmma|cutlass|dgrad"; do
    timeout 120 ncu --section SpeedOfLight --section WarpStateStats --section Occupancy $metrics -k "regex:$re" -c 1 \
      python3 -m bench.kernels.gemm_probe ${NCU_ARGS} --splits 1 --reps 1 > "$OUT/ncu-${re%%|*}.txt" 2>&1
    echo "== ncu $re"
    grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|hmma_cycles|Stall|Warp Cycles Per Issued|Registers Per|Achieved Occ" "$OUT/ncu-${re%%|*}.txt" | sed 's/  */ /g' | head -24
  done
fi
timeout $((570 - SECONDS)) python3 -m bench.kernels.gemm_probe ${PROBE_ARGS:-} --out "$OUT/probe.jsonl" > "$OUT/probe.log" 2>&1
grep -v '^{' "$OUT/probe.log" | tail -60
