"""A local Ray cluster with the service on Ray Serve, driven over HTTP on 127.0.0.1; run by test_ray_serve.py.

``python -m tests.deploy._ray_scenario OUT_DIR`` starts Ray on this machine only (CPU, loopback), deploys two
applications from ``service.ray_serve.app_builder`` and writes what it saw into OUT_DIR (``result.json``, the
inputs and the raw responses); the test makes the assertions. Ray is shut down whatever happens. It runs in its
own process so that the test can bound it in time and Ray's global state never touches the test process.

* ``deconv`` at ``/``: two CPU replicas behind the gateway; a burst of /deconv requests on the bundled ``demo``
  layer, an unknown layer, KServe metadata.
* ``busy`` at ``/busy``: one replica that holds one request at a time (``max_ongoing_requests=1``), one queue
  slot (``max_queued_requests=1``) and a batcher that waits 1.5 s for company: a burst of six requests must
  meet Ray's backpressure, which the gateway answers with our 429.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

NPY = "application/x-npy"
log = logging.getLogger("deconv.tests.ray")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _post(client: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return client.post(path, params={"layer": "demo"}, content=body, headers={"content-type": NPY})


def _record(response: httpx.Response) -> dict[str, Any]:
    return {"status": response.status_code, "headers": dict(response.headers),
            "text": response.text if "json" in response.headers.get("content-type", "") else ""}


def run(out: Path) -> dict[str, Any]:
    """Everything against a fresh local Ray; returns (and writes) the observations."""
    # Loopback only: Ray picks the node address through this switch; no usage report, no auth token on disk
    # (a throwaway single-machine cluster that lives for this run).
    os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    os.environ.pop("RAY_ADDRESS", None)
    import ray
    from ray import serve

    from service.ray_serve import app_builder

    timings: dict[str, float] = {}
    t0 = time.monotonic()
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    port = _free_port()
    result: dict[str, Any] = {"port": port}
    try:
        ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, _node_ip_address="127.0.0.1",
                 object_store_memory=128 * 2**20, _temp_dir=temp_dir, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        timings["ray_start_s"] = time.monotonic() - t0

        serve.run(app_builder({"num_gpus": 0, "num_cpus": 0.5, "min_replicas": 2, "max_replicas": 2,
                               "gateway_num_cpus": 0.5}), name="deconv", route_prefix="/")
        timings["deploy_s"] = time.monotonic() - t0
        rng = np.random.default_rng(2024)
        inputs = [rng.standard_normal((1 + i % 3, 16, 5 + i % 4, 7 + i % 2)).astype(np.float32) for i in range(16)]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0, trust_env=False) as client:
            result["ready"] = _record(client.get("/health/ready"))
            with ThreadPoolExecutor(4) as pool:
                responses = list(pool.map(lambda x: _post(client, "/deconv", _npy(x)), inputs))
            result["outputs"] = []
            for i, (x, r) in enumerate(zip(inputs, responses, strict=True)):
                np.save(out / f"input_{i}.npy", x, allow_pickle=False)
                (out / f"output_{i}.bin").write_bytes(r.content)
                result["outputs"].append({"status": r.status_code, "headers": dict(r.headers)})
            result["unknown_layer"] = _record(client.post(
                "/deconv", params={"layer": "nope"}, content=_npy(inputs[0]), headers={"content-type": NPY}))
            result["v2_metadata"] = _record(client.get("/v2/models/demo"))
        timings["requests_s"] = time.monotonic() - t0

        serve.run(app_builder({"num_gpus": 0, "num_cpus": 0.5, "min_replicas": 1, "max_replicas": 1,
                               "max_ongoing_requests": 1, "max_queued_requests": 1, "retry_after_s": 2,
                               "gateway_num_cpus": 0.5,
                               "settings": {"max_queue_delay_ms": 1500, "self_test": False}}),
                  name="busy", route_prefix="/busy")
        timings["deploy_busy_s"] = time.monotonic() - t0
        body = _npy(inputs[0])
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0, trust_env=False) as client:
            result["busy_ready"] = _record(client.get("/busy/health/ready"))
            with ThreadPoolExecutor(6) as pool:
                busy = list(pool.map(lambda _: _post(client, "/busy/deconv", body), range(6)))
            result["busy"] = [_record(r) for r in busy]
        timings["busy_s"] = time.monotonic() - t0
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
    timings["total_s"] = time.monotonic() - t0
    result["timings"] = timings
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    run(Path(sys.argv[1]))
