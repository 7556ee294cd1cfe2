#!/usr/bin/env bash
# One call on the GPU machine for KServe CUDA shared memory: the carried wheels installed (.whl, from
# ../shared/device/fetch-wheels: the server's, and tritonclient with what tritonclient.http and
# tritonclient.utils.cuda_shared_memory import: gevent, geventhttpclient, greenlet, zope.event, zope.interface,
# python-rapidjson, brotli, certifi, urllib3, cuda-bindings, cuda-pathfinder), the kernels built, then the GPU tests
# of tests/service/test_cuda_shm.py against the real server (one process, and two HTTP processes).
# Usage (from the repo root, carry [".whl"]): bash bench/device/cuda_shm.sh [pytest -k expression]
# Logs in $OUT: env.txt (GPU, driver, versions, what imports), build.log, pytest.log, pytest-tmp/ (servers' logs).
set -uo pipefail
source bench/device/env.sh
K=${1:-}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 - <<'PY'
import importlib.metadata as md
import torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count())
for name in ("tritonclient", "cuda-bindings", "cuda-pathfinder", "gevent", "geventhttpclient", "python-rapidjson"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
try:
    import tritonclient.http  # noqa: F401
    import tritonclient.utils.cuda_shared_memory  # noqa: F401
    print("tritonclient.http and tritonclient.utils.cuda_shared_memory import")
except Exception as exc:  # the tritonclient test skips with this reason
    print("tritonclient's CUDA shared memory does not import:", type(exc).__name__, exc)
torch.zeros(1, device="cuda")
from deconv_client import cuda_ipc
print("CUDA runtime for IPC:", cuda_ipc.cuda().runtime_path)
PY
} 2>&1 | tee "$OUT/env.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/build.log" | tail -3
import logging, time
logging.basicConfig(level=logging.INFO)
t = time.time()
import kernels.build as b
b.load()
print(f"kernels loaded in {time.time() - t:.1f} s")
PY
python3 -m pytest -v -rs -m cuda tests/service/test_cuda_shm.py ${K:+-k "$K"} -p no:cacheprovider \
  --basetemp "$OUT/pytest-tmp" 2>&1 | tee "$OUT/pytest.log" | tail -40
status=${PIPESTATUS[0]}
echo "pytest exit status: $status"
exit "$status"
