"""The Ray Serve deployment (service/ray_serve.py): configuration, error mapping, forwarding, and a real local
Ray cluster with two CPU replicas serving correct numbers (run in a subprocess bounded in time).

Skipped when Ray Serve is not installed (the optional extra ``deconv[ray]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file

pytest.importorskip("ray.serve", reason="Ray Serve is the optional extra deconv[ray]")

from ray.exceptions import ActorDiedError
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.requests import Request

from service.config import DEFAULT_LAYER_REPOSITORY, Settings
from service.ray_serve import (
    REPLICA_HEADER,
    DeconvServer,
    ForwardedRequest,
    ForwardedResponse,
    Gateway,
    RayServeConfig,
    app_builder,
    build_replica_app,
    call_asgi,
    gateway_options,
    ray_error_response,
    replica_settings,
    server_options,
    wait_until_ready,
)
from tests.numerics import rel_err

REPO_ROOT = Path(__file__).resolve().parents[2]
NPY = "application/x-npy"
SCENARIO_TIMEOUT_S = 150  # the scenario takes about 30 s on 2 cores


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _load_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def demo_reference(x: np.ndarray) -> np.ndarray:
    """The bundled ``demo`` layer in float64 with PyTorch's own conv_transpose2d (weights from its file)."""
    config = json.loads((DEFAULT_LAYER_REPOSITORY / "demo.json").read_text())
    weights = load_file(str(DEFAULT_LAYER_REPOSITORY / "demo.safetensors"))
    y = F.conv_transpose2d(
        torch.from_numpy(x).double(), weights["weight"].double(), weights["bias"].double(),
        stride=tuple(config["stride"]), padding=tuple(config["padding"]),
        output_padding=tuple(config["output_padding"]), groups=config["groups"], dilation=tuple(config["dilation"]))
    return y.numpy()


# --- configuration --------------------------------------------------------------------------------------------


def test_config_defaults_are_one_gpu_per_replica_with_autoscaling(monkeypatch):
    for name in list(os.environ):
        if name.startswith("DECONV_RAY_"):
            monkeypatch.delenv(name)
    config = RayServeConfig()
    options = server_options(config)
    assert options["ray_actor_options"] == {"num_gpus": 1.0, "num_cpus": 1.0}
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32.0,
                                             "upscale_delay_s": 10.0, "downscale_delay_s": 120.0}
    # The batcher needs company to batch: a replica must hold at least a default batch of requests.
    assert options["max_ongoing_requests"] >= Settings.model_fields["max_batch_size"].default
    assert options["backpressure_config"].status_code == 429
    assert config.service_settings() == {}  # GPU replicas: devices stay "auto" (Ray sets CUDA_VISIBLE_DEVICES)


def test_config_cpu_replicas_fixed_count_and_settings():
    config = RayServeConfig(num_gpus=0, min_replicas=2, max_replicas=2, settings={"max_batch_size": 8})
    options = server_options(config)
    assert options["ray_actor_options"]["num_gpus"] == 0
    assert options["num_replicas"] == 2
    assert "autoscaling_config" not in options
    assert config.service_settings() == {"max_batch_size": 8, "devices": "cpu"}
    assert RayServeConfig(num_gpus=0, settings={"devices": "auto"}).service_settings() == {"devices": "auto"}


def test_a_replica_serves_http_in_one_process_whatever_the_node_says(monkeypatch):
    monkeypatch.setenv("DECONV_HTTP_PROCESSES", "8")
    settings = replica_settings({"max_batch_size": 8, "http_processes": 4})
    assert (settings.http_processes, settings.max_batch_size) == (1, 8)
    monkeypatch.setenv("DECONV_HTTP_PROCESSES", "auto")
    assert replica_settings({"devices": "0"}).http_processes == 1  # auto would count the node's cores


def test_config_from_environment_and_arguments(monkeypatch):
    monkeypatch.setenv("DECONV_RAY_NUM_GPUS", "0.5")
    monkeypatch.setenv("DECONV_RAY_MAX_REPLICAS", "8")
    monkeypatch.setenv("DECONV_RAY_SETTINGS", '{"log_level": "debug"}')
    config = RayServeConfig(max_replicas="6")  # arguments win (serve run passes strings)
    assert (config.num_gpus, config.max_replicas, config.settings) == (0.5, 6, {"log_level": "debug"})


@pytest.mark.parametrize(("args", "fragment"), [
    ({"settings": {"max_batch_sise": 8}}, "unknown service settings"),
    ({"min_replicas": 3, "max_replicas": 2}, "exceeds max_replicas"),
    ({"initial_replicas": 9}, "outside"),
    ({"num_gpus": -1}, "greater than or equal"),
    ({"replicas": 2}, "Extra inputs"),
])
def test_config_rejects_mistakes(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        RayServeConfig(**args)


def test_options_are_accepted_by_ray_serve():
    config = RayServeConfig(num_gpus=0, min_replicas=1, max_replicas=3, max_ongoing_requests=16,
                            max_queued_requests=4, gateway_replicas=2)
    server = DeconvServer.options(**server_options(config))
    assert (server.max_ongoing_requests, server.max_queued_requests) == (16, 4)
    assert server.ray_actor_options["num_gpus"] == 0
    gateway = Gateway.options(**gateway_options(config))
    assert gateway.num_replicas == 2
    assert app_builder({"num_gpus": 0, "gateway": False}) is not None


# --- Ray's failures in our error shape ------------------------------------------------------------------------


def test_backpressure_is_429_overloaded_with_retry_after():
    response = ray_error_response(BackPressureError(num_queued_requests=4, max_queued_requests=4), "/deconv", 1.0)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    body = json.loads(response.body)
    assert body["error"]["type"] == "overloaded"
    assert "max_queued_requests=4" in body["error"]["message"]
    # Ray's own Retry-After (the deployment's backpressure_config) wins over the gateway's default.
    response = ray_error_response(BackPressureError(1, 1, status_code=429, retry_after_s=7.5), "/deconv", 1.0)
    assert response.headers["retry-after"] == "8"


def test_backpressure_under_v2_uses_kserve_shape():
    response = ray_error_response(BackPressureError(1, 1), "/v2/models/demo/infer", 2.0)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"
    body = json.loads(response.body)
    assert body["type"] == "overloaded"
    assert isinstance(body["error"], str)


@pytest.mark.parametrize("exc", [
    ActorDiedError(),
    DeploymentUnavailableError(DeploymentID(name="DeconvServer", app_name="deconv")),
])
def test_unavailable_replicas_are_503_not_ready(exc):
    response = ray_error_response(exc, "/deconv", 3.0)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "3"
    assert json.loads(response.body)["error"]["type"] == "not_ready"


def test_anything_else_is_500_without_details():
    response = ray_error_response(ValueError("secret detail"), "/deconv", 1.0)
    assert response.status_code == 500
    assert json.loads(response.body) == {"error": {"type": "internal", "message": "internal server error"}}


# --- forwarding, in process -----------------------------------------------------------------------------------


def test_replica_app_serves_a_forwarded_request_with_correct_numbers():
    async def scenario() -> tuple[ForwardedResponse, ForwardedResponse, np.ndarray]:
        app = build_replica_app(Settings(devices="cpu"), ready_timeout_s=60)
        async with app.router.lifespan_context(app):
            assert app.state.engine.readiness.ready  # the lifespan start returned only once ready
            x = np.random.default_rng(7).standard_normal((3, 16, 6, 5)).astype(np.float32)
            ok = await call_asgi(app, ForwardedRequest(
                "POST", "/deconv", b"layer=demo", [(b"content-type", NPY.encode())], _npy(x)))
            bad = await call_asgi(app, ForwardedRequest("GET", "/v1/layers/nope"))
        return ok, bad, x

    ok, bad, x = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert ok.status == 200
    assert dict(ok.headers)[b"content-type"] == NPY.encode()
    y = _load_npy(ok.body)
    assert y.shape == (3, 8, 12, 10)
    assert rel_err(y, demo_reference(x)) < 1e-5
    assert bad.status == 404
    assert json.loads(bad.body)["error"]["type"] == "unknown_layer"


@pytest.mark.parametrize(("states", "timeout_s", "fragment"), [
    (["starting", "failed"], 5.0, "self-test failed"),
    (["starting"], 0.2, "not ready after"),
])
def test_wait_until_ready_fails_with_the_reason(states, timeout_s, fragment):
    class Readiness:
        """The first look at the state sees the first of ``states``, each later one the next (the last one stays): the
        state changes while the service waits, however long it takes between looks."""

        reason = "self-test failed: demo"

        def __init__(self) -> None:
            self.states = list(states)

        @property
        def state(self) -> str:
            return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    app = SimpleNamespace(state=SimpleNamespace(engine=SimpleNamespace(readiness=Readiness())))
    with pytest.raises(RuntimeError, match=fragment):
        asyncio.run(asyncio.wait_for(wait_until_ready(app, timeout_s), 10))  # type: ignore[arg-type]


class _FakeHandle:
    """Stands in for a DeploymentHandle to DeconvServer: ``forward.remote(request)`` is awaitable."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.seen: list[ForwardedRequest] = []
        self.forward = SimpleNamespace(remote=self._remote)

    async def _remote(self, request: ForwardedRequest) -> ForwardedResponse:
        self.seen.append(request)
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def _call_gateway(handle: _FakeHandle, body: bytes, *, max_body_bytes: int = 1 << 20, path: str = "/deconv",
                  root_path: str = "") -> Any:
    gateway = Gateway.func_or_class(handle, {"max_body_bytes": max_body_bytes}, retry_after_s=4.0)
    scope = {"type": "http", "method": "POST", "path": root_path + path, "root_path": root_path,
             "query_string": b"layer=demo", "headers": [(b"content-type", NPY.encode())],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000), "scheme": "http"}
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return asyncio.run(asyncio.wait_for(gateway(Request(scope, receive)), 10))


def test_gateway_forwards_and_passes_the_answer_through():
    answer = ForwardedResponse(200, [(b"content-type", NPY.encode()), (b"x-deconv-batch-size", b"3")], b"abc", "r1")
    handle = _FakeHandle(answer)
    response = _call_gateway(handle, b"tensor bytes", path="/deconv", root_path="/busy")
    assert response.status_code == 200
    assert response.body == b"abc"
    assert response.headers["x-deconv-batch-size"] == "3"
    assert response.headers[REPLICA_HEADER] == "r1"
    (forwarded,) = handle.seen
    assert (forwarded.method, forwarded.path, forwarded.query_string, forwarded.body) == (
        "POST", "/deconv", b"layer=demo", b"tensor bytes")
    assert (b"content-type", NPY.encode()) in forwarded.headers


def test_gateway_maps_backpressure_to_429():
    response = _call_gateway(_FakeHandle(BackPressureError(2, 2)), b"x")
    assert response.status_code == 429
    assert response.headers["retry-after"] == "4"
    assert json.loads(response.body)["error"]["type"] == "overloaded"


def test_gateway_refuses_an_oversized_body_before_forwarding():
    handle = _FakeHandle(ForwardedResponse(200, [], b""))
    response = _call_gateway(handle, b"x" * 101, max_body_bytes=100)
    assert response.status_code == 413
    assert json.loads(response.body)["error"]["type"] == "payload_too_large"
    assert handle.seen == []


# --- a real local Ray cluster ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory) -> dict[str, Any]:
    """Run tests/deploy/_ray_scenario.py once, bounded in time; its observations and output directory."""
    out = tmp_path_factory.mktemp("ray")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "DECONV_"))}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "tests.deploy._ray_scenario", str(out)], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=SCENARIO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the scenario's own session: its Ray processes share its fate
        output, _ = proc.communicate()
        pytest.fail(f"the Ray scenario took longer than {SCENARIO_TIMEOUT_S} s:\n{output[-6000:]}")
    assert proc.returncode == 0, f"the Ray scenario failed (exit {proc.returncode}):\n{output[-6000:]}"
    result = json.loads((out / "result.json").read_text())
    result["out"] = out
    result["wall_s"] = time.monotonic() - started
    return result


@pytest.mark.slow
def test_ray_serve_two_cpu_replicas_serve_correct_numbers(ray_run):
    assert ray_run["ready"]["status"] == 200
    assert json.loads(ray_run["ready"]["text"]) == {"status": "ready"}
    outputs = ray_run["outputs"]
    assert len(outputs) == 16
    for i, meta in enumerate(outputs):
        assert meta["status"] == 200, meta
        assert meta["headers"]["content-type"] == NPY
        x = np.load(ray_run["out"] / f"input_{i}.npy", allow_pickle=False)
        y = _load_npy((ray_run["out"] / f"output_{i}.bin").read_bytes())
        expected = demo_reference(x)
        assert y.shape == expected.shape
        assert rel_err(y, expected) < 1e-5
    # Both replicas answered (Ray picks the less busy of two at random for each request).
    assert len({meta["headers"][REPLICA_HEADER] for meta in outputs}) == 2


@pytest.mark.slow
def test_ray_serve_passes_the_apps_own_answers_through(ray_run):
    unknown = ray_run["unknown_layer"]
    assert unknown["status"] == 404
    assert json.loads(unknown["text"])["error"]["type"] == "unknown_layer"
    assert ray_run["v2_metadata"]["status"] == 200
    assert json.loads(ray_run["v2_metadata"]["text"])["name"] == "demo"


@pytest.mark.slow
def test_ray_backpressure_becomes_our_429(ray_run):
    assert ray_run["busy_ready"]["status"] == 200  # served under the route prefix /busy
    statuses = [r["status"] for r in ray_run["busy"]]
    assert set(statuses) <= {200, 429}, statuses
    assert 200 in statuses
    assert 429 in statuses
    for r in ray_run["busy"]:
        if r["status"] == 429:
            assert r["headers"]["retry-after"] == "2"
            assert r["headers"]["content-type"] == "application/json"
            body = json.loads(r["text"])
            assert set(body) == {"error"}
            assert body["error"]["type"] == "overloaded"
            assert "backpressure" in body["error"]["message"]


@pytest.mark.slow
def test_ray_scenario_is_bounded(ray_run):
    assert ray_run["wall_s"] < SCENARIO_TIMEOUT_S
    assert ray_run["timings"]["total_s"] < 120


# --- the documented local commands, as docs/deploy.md writes them ----------------------------------------------

DOCUMENTED_TIMEOUT_S = 300  # Ray's start, Serve's start and two replicas' self-tests: about 60 s on 2 cores
RAY_START_ATTEMPTS = 3  # starts of the cluster when a port chosen for it was taken meanwhile
SERVE_START_TIMEOUT_S = 60  # one `serve start` (it waits for the cluster: a stopped one is checked again after it)


def _documented_commands() -> list[list[str]]:
    """The commands of docs/deploy.md's one-machine Ray Serve blocks, in order (comments dropped)."""
    doc = (REPO_ROOT / "docs" / "deploy.md").read_text()
    section = doc[doc.index("On one machine without GPUs"):doc.index("### Kubernetes with KubeRay")]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [shlex.split(line.split("#")[0]) for block in blocks for line in block.splitlines()
            if line.split("#")[0].strip()]


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _stop_group(proc: subprocess.Popen[Any], sig: int, timeout: float) -> None:
    """``sig`` to the process group ``proc`` leads (its own session), then SIGKILL to what is left of it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


@pytest.mark.slow
def test_the_documented_local_commands_serve_two_cpu_replicas_on_two_cores_beside_port_8000(tmp_path):
    """docs/deploy.md's commands for one machine, as written, on a Ray of 2 CPUs: Serve on its own port (not the
    README server's 8000), two CPU replicas that answer with correct numbers, and ``serve status`` reporting them.
    Only what isolates this run from other Ray clusters on the machine is added: Ray's ports and directory, the
    cluster's address, and the dashboard's address for ``serve status``."""
    commands = _documented_commands()
    assert [c[:2] for c in commands] == [["ray", "start"], ["serve", "start"], ["serve", "run"], ["serve", "status"],
                                         ["curl", "-s"]]
    ray_start, serve_start, serve_run, serve_status, curl = commands
    assert "--http-port" in serve_start
    assert serve_start[serve_start.index("--http-port") + 1] != "8000"
    assert "num_cpus=0.5" in serve_run
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    bindir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "DECONV_"))}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    logs = tmp_path / "ray.log"
    ray = run = None
    deadline = time.monotonic() + DOCUMENTED_TIMEOUT_S
    try:
        # Ray's own processes take ports of their own as they start, so a port found free for it here can be
        # taken by the time its part binds it ("Address already in use"): then the cluster stops, and it is
        # started again on other ports, a bounded number of times.
        for attempt in range(RAY_START_ATTEMPTS):
            gcs, dashboard, client, agent, http = _free_ports(5)
            env["RAY_ADDRESS"] = f"127.0.0.1:{gcs}"
            serve_start[serve_start.index("--http-port") + 1] = str(http)
            ray = subprocess.Popen(
                [str(bindir / "ray"), *ray_start[1:], "--block", "--num-cpus=2", f"--port={gcs}",
                 f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}",
                 f"--dashboard-agent-listen-port={agent}", f"--temp-dir={temp}"],
                cwd=REPO_ROOT, env=env, stdout=logs.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
            started = None
            while ray.poll() is None and (started is None or started.returncode != 0):
                # `serve start` once the cluster takes connections
                assert time.monotonic() < deadline, started.stderr[-4000:] if started else ""
                with contextlib.suppress(subprocess.TimeoutExpired):  # the cluster stopped meanwhile
                    started = subprocess.run([str(bindir / "serve"), *serve_start[1:]], cwd=REPO_ROOT, env=env,
                                             capture_output=True, text=True, timeout=SERVE_START_TIMEOUT_S)
            if ray.poll() is None:
                break
            _stop_group(ray, signal.SIGTERM, 60)  # what is left of the stopped cluster
            text = logs.read_text()
            assert "already in use" in text, text[-4000:]
            assert attempt + 1 < RAY_START_ATTEMPTS, f"ports taken on every one of {RAY_START_ATTEMPTS} starts"
        run = subprocess.Popen([str(bindir / "serve"), *serve_run[1:]], cwd=REPO_ROOT, env=env,
                               stdout=(tmp_path / "run.log").open("wb"), stderr=subprocess.STDOUT,
                               start_new_session=True)
        url = curl[-1].replace("8001", str(http))
        assert url == f"127.0.0.1:{http}/health/ready"
        with httpx.Client(timeout=30.0, trust_env=False) as http_client:
            while True:  # the replicas start and pass their self-tests
                assert run.poll() is None, (tmp_path / "run.log").read_text()[-4000:]
                assert time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-4000:]
                with contextlib.suppress(httpx.HTTPError):
                    if http_client.get(f"http://{url}").status_code == 200:
                        break
                time.sleep(1.0)
            status = None
            while status is None or status.get("applications", {}).get("default", {}).get("status") != "RUNNING":
                assert time.monotonic() < deadline, status
                done = subprocess.run([str(bindir / "serve"), *serve_status[1:], "--address",
                                       f"http://127.0.0.1:{dashboard}"], cwd=REPO_ROOT, env=env,
                                      capture_output=True, text=True, timeout=120)
                assert done.returncode == 0, done.stderr[-4000:]
                status = yaml.safe_load(done.stdout)
            deployments = status["applications"]["default"]["deployments"]
            assert deployments["DeconvServer"]["status"] == "HEALTHY"
            assert deployments["DeconvServer"]["replica_states"] == {"RUNNING": 2}
            assert deployments["Gateway"]["status"] == "HEALTHY"
            x = np.random.default_rng(3).standard_normal((2, 16, 5, 6)).astype(np.float32)
            r = http_client.post(f"http://127.0.0.1:{http}/deconv", params={"layer": "demo"}, content=_npy(x),
                                 headers={"content-type": NPY})
            assert r.status_code == 200, r.text[:500]
            assert rel_err(_load_npy(r.content), demo_reference(x)) < 1e-5
            assert r.headers[REPLICA_HEADER]
    finally:
        if run is not None:
            _stop_group(run, signal.SIGINT, 60)  # Ctrl-C: serve run removes the application
        if ray is not None:
            _stop_group(ray, signal.SIGTERM, 60)  # `ray start --block` stops its cluster
        shutil.rmtree(temp, ignore_errors=True)
