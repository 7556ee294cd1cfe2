"""A real uvicorn server in a subprocess: batching, 429, deadlines, disconnects, SIGTERM drain, tritonclient.

The server-level tests run twice: as one process, and as a multi-process server (two HTTP processes feeding one
engine process, ``DECONV_HTTP_PROCESSES=2``), which must behave the same from outside.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.numerics import rel_err

from .conftest import (
    NPY,
    REPO_ROOT,
    ServerProcess,
    load_npy,
    metric_value,
    npy_bytes,
    reference,
    run,
    write_layer,
)

SLOW_DELAY_MS = 2500


def _repo(root: Path, delay_ms: float = SLOW_DELAY_MS) -> dict[str, Any]:
    conv = dict(in_channels=4, out_channels=6, kernel_size=4, stride=2, padding=1)
    return {
        "slow": write_layer(root, "slow", **conv, limits={"max_queue_delay_ms": delay_ms, "max_queue_size": 4,
                                                          "max_batch_size": 16}),
        "fast": write_layer(root, "fast", **conv, seed=1),
    }


PROCESSES = pytest.mark.parametrize("processes", ["1", "2"], ids=["single", "multi"])


@pytest.fixture(scope="module", params=["1", "2"], ids=["single", "multi"])
def server(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("layers")
    modules = _repo(root)
    proc = ServerProcess({"DECONV_LAYER_REPOSITORY": str(root), "DECONV_HTTP_PROCESSES": request.param},
                         root / "server.log")
    try:
        proc.wait_ready()
        yield proc, modules
    finally:
        assert proc.stop() == 0, proc.log()


def _x(n: int = 1) -> np.ndarray:
    return np.random.default_rng(n).standard_normal((n, 4, 6, 6)).astype(np.float32)


async def _post(client: httpx.AsyncClient, layer: str, x: np.ndarray, **headers: str) -> httpx.Response:
    return await client.post(f"/deconv?layer={layer}", content=npy_bytes(x), headers={"content-type": NPY, **headers})


async def _metrics(client: httpx.AsyncClient) -> str:
    return (await client.get("/metrics")).text


async def _wait_metric(client: httpx.AsyncClient, name: str, value: float, timeout: float = 60.0,
                       **labels: str) -> None:
    # (timeout: only how long a server that never gets there is waited for)
    deadline = time.monotonic() + timeout
    while metric_value(await _metrics(client), name, **labels) != value:
        assert time.monotonic() < deadline, f"{name}{labels} never reached {value}"
        await asyncio.sleep(0.02)


def test_concurrent_requests_share_one_batch(server):
    proc, modules = server

    async def main() -> None:
        async with httpx.AsyncClient(base_url=proc.url, timeout=20) as client:
            before = metric_value(await _metrics(client), "deconv_batch_size_count", layer="slow")
            xs = [_x(i + 1) for i in range(4)]  # 1 + 2 + 3 + 4 samples
            responses = await asyncio.gather(*(_post(client, "slow", x) for x in xs))
            for x, r in zip(xs, responses, strict=True):
                assert r.status_code == 200, r.text[:300]
                assert r.headers["x-deconv-batch-size"] == "10"
                assert rel_err(load_npy(r.content), reference(modules["slow"], torch.from_numpy(x))) < 1e-5
            text = await _metrics(client)
            assert metric_value(text, "deconv_batch_size_count", layer="slow") == before + 1
            assert metric_value(text, "deconv_batch_requests_sum", layer="slow") >= 4

    run(main())


@PROCESSES
def test_full_queue_answers_429_at_once(tmp_path, server_factory, processes):
    # A server of its own whose queued requests wait 10 minutes for their batch: a 429 that waited for room would
    # come after them, never within the client's timeout, so no bound on the time of the 429 is needed.
    _repo(tmp_path, delay_ms=600_000)
    proc = server_factory({"DECONV_LAYER_REPOSITORY": str(tmp_path), "DECONV_HTTP_PROCESSES": processes})

    async def main() -> None:
        async with httpx.AsyncClient(base_url=proc.url, timeout=60) as client:
            queued = [asyncio.ensure_future(_post(client, "slow", _x())) for _ in range(4)]
            await _wait_metric(client, "deconv_queue_depth", 4, layer="slow")
            r = await _post(client, "slow", _x())
            assert r.status_code == 429
            assert r.json()["error"]["type"] == "overloaded"
            assert int(r.headers["retry-after"]) >= 1
            assert not any(q.done() for q in queued)  # the four are still queued
            proc.terminate()  # the drain runs them now
            assert [q.status_code for q in await asyncio.gather(*queued)] == [200] * 4

    run(main())


def test_deadline_passes_before_execution(server):
    proc, _ = server

    async def main() -> None:
        async with httpx.AsyncClient(base_url=proc.url, timeout=20) as client:
            before = await _metrics(client)
            r = await _post(client, "slow", _x(), **{"x-deadline-ms": "200"})
            assert r.status_code == 504
            assert r.json()["error"]["type"] == "deadline_exceeded"
            # Dropped from the queue, not answered after its batch ran: the metrics say so (no bound on the time).
            after = await _metrics(client)
            for name, labels, change in (("deconv_requests_dropped_total", {"reason": "deadline"}, 1),
                                         ("deconv_batch_size_count", {}, 0)):
                assert (metric_value(after, name, layer="slow", **labels)
                        - metric_value(before, name, layer="slow", **labels)) == change, name

    run(main())


def test_disconnected_client_is_dropped_before_execution(server):
    proc, _ = server

    async def main() -> None:
        async with httpx.AsyncClient(base_url=proc.url, timeout=20) as client:
            text = await _metrics(client)
            dropped = metric_value(text, "deconv_requests_dropped_total", layer="slow", reason="disconnected")
            batches = metric_value(text, "deconv_batch_size_count", layer="slow")
            async with httpx.AsyncClient(base_url=proc.url, timeout=0.3) as impatient:
                with pytest.raises(httpx.ReadTimeout):
                    await _post(impatient, "slow", _x())
            await _wait_metric(client, "deconv_requests_dropped_total", dropped + 1, layer="slow",
                               reason="disconnected")
            text = await _metrics(client)
            assert metric_value(text, "deconv_queue_depth", layer="slow") == 0
            # A request of the same shape waits its own batching delay: had the dropped one stayed queued, it would
            # ride in that batch, or have run in one of its own by the time this one's answer comes.
            r = await _post(client, "slow", _x())
            assert r.status_code == 200, r.text[:300]
            assert r.headers["x-deconv-batch-size"] == "1"
            assert metric_value(await _metrics(client), "deconv_batch_size_count", layer="slow") == batches + 1

    run(main())


def test_tritonclient_binary_and_json(server):
    import tritonclient.http as triton

    proc, modules = server
    client = triton.InferenceServerClient(proc.url.removeprefix("http://"), network_timeout=20.0)
    try:
        assert client.is_server_live()
        assert client.is_server_ready()
        assert client.is_model_ready("fast")
        meta = client.get_model_metadata("fast")
        assert meta["inputs"][0]["name"] == "input"
        x = _x(3)
        ref = reference(modules["fast"], torch.from_numpy(x))
        for binary in (True, False):
            inp = triton.InferInput("input", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=binary)
            out = triton.InferRequestedOutput("output", binary_data=binary)
            result = client.infer("fast", [inp], outputs=[out], request_id="r1")
            y = result.as_numpy("output")
            assert y.shape == (3, 6, 12, 12)
            assert y.dtype == np.float32
            assert rel_err(y, ref) < 1e-5
            assert result.get_response()["id"] == "r1"
        with pytest.raises(triton.InferenceServerException, match="no layer named"):
            client.infer("missing", [inp])
    finally:
        client.close()


@PROCESSES
def test_sigterm_drains_requests_in_flight(tmp_path, server_factory, processes):
    modules = _repo(tmp_path, delay_ms=600_000)
    proc = server_factory({"DECONV_LAYER_REPOSITORY": str(tmp_path), "DECONV_HTTP_PROCESSES": processes})

    async def main() -> None:
        async with httpx.AsyncClient(base_url=proc.url, timeout=90) as client:
            xs = [_x(i + 1) for i in range(3)]
            pending = [asyncio.ensure_future(_post(client, "slow", x)) for x in xs]
            await _wait_metric(client, "deconv_queue_depth", 3, layer="slow")
            proc.terminate()
            # Answered by the drain, not after the 10-minute delay: the bound only limits how long a broken drain
            # is waited for.
            responses = await asyncio.wait_for(asyncio.gather(*pending), 60)
            for x, r in zip(xs, responses, strict=True):
                assert r.status_code == 200, r.text[:300]
                assert rel_err(load_npy(r.content), reference(modules["slow"], torch.from_numpy(x))) < 1e-5

    run(main())
    assert proc.proc.wait(20) == 0, proc.log()  # a complete drain after SIGTERM exits 0
    log = proc.log()
    assert "draining: not ready any more; executing 3 queued request(s) now" in log
    assert "stopped" in log
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{proc.url}/health/live", timeout=2)


@PROCESSES
def test_invalid_repository_stops_the_server_before_it_starts(tmp_path, processes):
    write_layer(tmp_path, "bad")
    cfg = json.loads((tmp_path / "bad.json").read_text())
    cfg["stride"] = [0, 1]
    (tmp_path / "bad.json").write_text(json.dumps(cfg))
    env = {"DECONV_LAYER_REPOSITORY": str(tmp_path), "DECONV_DEVICES": "cpu", "DECONV_PORT": "0",
           "DECONV_HTTP_PROCESSES": processes}
    done = subprocess.run([sys.executable, "-m", "service"], cwd=REPO_ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 3  # uvicorn's start-up failure
    assert "bad.json: field 'stride': must be positive" in done.stderr


def test_serves_the_bundled_layers_with_default_settings(server_factory):
    proc = server_factory({"DECONV_DEVICES": "auto"})
    x = np.random.default_rng(0).standard_normal((1, 16, 16, 16)).astype(np.float32)
    r = httpx.post(f"{proc.url}/deconv?layer=demo", content=npy_bytes(x), headers={"content-type": NPY}, timeout=20)
    assert r.status_code == 200, r.text[:300]
    assert load_npy(r.content).shape == (1, 8, 32, 32)
    if not torch.cuda.is_available():
        assert "no CUDA device visible: serving on CPU with the PyTorch reference" in proc.log()


def test_access_log_setting_and_the_heap_frozen_once_ready(server, server_factory):
    proc, _ = server  # default settings, log level info: access log on
    assert "start-up objects frozen" in proc.log()  # python -m service froze the start-up heap (gc.freeze)
    quiet = server_factory({"DECONV_ACCESS_LOG": "false"})
    for p in (proc, quiet):
        assert httpx.get(f"{p.url}/health/live", timeout=5).status_code == 200
    deadline = time.monotonic() + 60  # only how long a log line that never comes is waited for
    while '"GET /health/live HTTP/1.1" 200' not in proc.log():
        assert time.monotonic() < deadline, proc.log()
        time.sleep(0.05)
    assert '"GET /health/live HTTP/1.1" 200' not in quiet.log()
