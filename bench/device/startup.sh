#!/usr/bin/env bash
# One call on the GPU machine: kernel build cold and warm (cache hit) in fresh processes, then the server's start
# on the bundled layers with measured kernel choice: seconds until /health/ready, its warm-up and tuning log lines,
# and one request. Logs under $OUT.
set -uo pipefail
source bench/device/env.sh
for kind in cold warm; do
  python3 -c "import time; t = time.time(); import kernels.build as b; b.load(); print(f'$kind build/load {time.time() - t:.1f} s')"
done
python3 -m service --port 8123 > "$OUT/server.log" 2>&1 &
server=$!
python3 - <<'PY'
import time, urllib.request
import numpy as np, io
t0 = time.time()
while time.time() - t0 < 400:
    try:
        if urllib.request.urlopen("http://127.0.0.1:8123/health/ready", timeout=2).status == 200:
            break
    except Exception:
        time.sleep(0.25)
print(f"ready {time.time() - t0:.1f} s after start")
buf = io.BytesIO(); np.save(buf, np.random.randn(1, 16, 16, 16).astype("float32"))
req = urllib.request.Request("http://127.0.0.1:8123/deconv?layer=demo", data=buf.getvalue(),
                             headers={"Content-Type": "application/x-npy"})
y = np.load(io.BytesIO(urllib.request.urlopen(req, timeout=10).read()))
print("demo answer", y.shape, y.dtype)
PY
kill -TERM $server; wait $server
grep -cE "tuned " "$OUT/server.log" | sed 's/^/problems tuned: /'
grep -E "warm-up|self-test .* in|serving on|drain|stopped" "$OUT/server.log" | cut -c1-220 | tail -20
grep -E "tuned " "$OUT/server.log" | sed 's/.*tuned //' | cut -c1-200 | sort -t' ' -k1 | awk 'NR % 6 == 1' | head -14
