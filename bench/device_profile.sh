#!/usr/bin/env bash
# One call on the GPU machine: Nsight Compute on the bundled layers still slower than cuDNN (dcgan_up1 at batch 64,
# dcgan_up3 at batch 1), ours with each candidate tile against cuDNN's kernel. Reports under $OUT, summary last.
set -uo pipefail
source bench/device_env.sh
python3 -c "import kernels.build as b; b.load()" > "$OUT/build.log" 2>&1
sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats"
metrics="--metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed.sum,lts__t_bytes.sum,dram__bytes.sum"
run() {  # name, kernel regex, profile_one arguments
  local name=$1 re=$2; shift 2
  timeout 120 ncu $sections $metrics -k "regex:$re" -c 1 python3 bench/profile_one.py "$@" > "$OUT/ncu-$name.txt" 2>&1
  echo "== $name ($*)"
  grep -E "^  [a-z].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Registers Per Thread|Achieved Occupancy|Issue Slots Busy|Warp Cycles Per Issued|hmma_cycles_active|inst_executed.sum|lts__t_bytes.sum|dram__bytes.sum|Grid Size|Block Size|Dynamic Shared" "$OUT/ncu-$name.txt" | sed 's/  */ /g' | head -20
}
run up1-b64-tc5 "halo" --layer dcgan_up1 --batch 64 --config 5 --split 1
run up1-b64-tc9 "halo|ws" --layer dcgan_up1 --batch 64 --config 9
run up1-b64-cudnn "dgrad|conv|gemm|sm90" --layer dcgan_up1 --batch 64 --cudnn --runs 2
run up3-b1-tc8 "halo" --layer dcgan_up3 --batch 1 --config 8
run up3-b1-cudnn "dgrad|conv|gemm|sm90" --layer dcgan_up3 --batch 1 --cudnn --runs 2
