#!/usr/bin/env bash
# One call on the GPU machine: Nsight Compute (full set) on our kernels and cuDNN's for a list of cases, each a line
# "name|kernel regex|bench/kernels/profile_one.py arguments" in $CASES (default below: the gemm kernel against cuDNN's
# best algorithm on zoo layers where cuDNN leads). Full reports in $OUT/ncu.tar.gz; a summary per case last.
# NCU_SET: ncu's section set (default full); CASE_S: seconds a case may take; STOP_AT: no case starts after this
# many seconds of the call.
set -uo pipefail
source bench/device/env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import kernels.build as b; b.load()" > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
CASES=${CASES:-"unet-up1-bf16|gemm_kernel|--zoo unet-up1 --mode bf16 --layout cl
unet-up1-bf16-cudnn|.|--zoo unet-up1 --mode bf16 --layout cl --cudnn
dcgan64-up1-bf16|gemm_kernel|--zoo dcgan64-up1 --mode bf16 --layout cl
dcgan64-up1-bf16-cudnn|.|--zoo dcgan64-up1 --mode bf16 --layout cl --cudnn
kb57-bf16|gemm_kernel|--id 57 --mode bf16 --layout cl
kb57-bf16-cudnn|.|--id 57 --mode bf16 --layout cl --cudnn
pose-up3-tf32|gemm_kernel|--zoo pose-up3 --mode tf32 --layout cl
dcgan64-up2-tf32|gemm_kernel|--zoo dcgan64-up2 --mode tf32 --layout cl"}
mkdir -p "$OUT/ncu"
summary=$OUT/summary.txt; : > "$summary"
while IFS='|' read -r name re pargs; do
  [ -z "$name" ] && continue
  # shellcheck disable=SC2086
  if [ "$SECONDS" -gt "${STOP_AT:-560}" ]; then echo "== $name: skipped, $SECONDS s spent" >> "$summary"; continue; fi
  timeout "${CASE_S:-150}" ncu --set "${NCU_SET:-full}" --profile-from-start off -k "regex:$re" -c 4 python3 -m bench.kernels.profile_one $pargs \
    > "$OUT/ncu/$name.txt" 2>&1
  {
    echo "== $name ($pargs)"
    grep -E "^  [a-zA-Z_].*\(|^    Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Registers Per Thread|Achieved Occupancy|Issue Slots Busy|Warp Cycles Per Issued|Executed Ipc Active|Grid Size|Block Size|Dynamic Shared|SM Frequency|No Eligible|One or More Eligible|Active Warps Per Scheduler|Eligible Warps Per" \
      "$OUT/ncu/$name.txt" | sed 's/  */ /g' | head -60
    grep -E "^    (OPT|INF|WRN) " "$OUT/ncu/$name.txt" | cut -c1-300 | head -12
  } >> "$summary"
done <<< "$CASES"
tar -czf "$OUT/ncu.tar.gz" -C "$OUT" ncu && rm -rf "$OUT/ncu"
if [ -n "${TESTS:-}" ]; then
  # shellcheck disable=SC2086
  timeout $((590 - SECONDS)) python3 -m pytest -q -m cuda $TESTS -p no:cacheprovider > "$OUT/pytest.log" 2>&1
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20; tail -1 "$OUT/pytest.log"
fi
cat "$summary" | cut -c1-220
