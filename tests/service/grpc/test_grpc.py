"""The KServe v2 gRPC API against a live CPU server (``python -m service`` with ``DECONV_GRPC_PORT``), one process
and two HTTP processes in front of the engine process, through ``tritonclient.grpc`` as a user calls it: every
server and model call, inference with binary (raw) and typed contents checked against float64, the errors and
their status codes, the API key, a deadline, system shared memory, and gRPC and HTTP requests in one batch.

The batching tests use a layer whose batches hold two samples and wait for the second as long as it takes: a
lone request stays queued until another arrives, so two requests sent together run in one batch, whatever the
machine's speed, and a lone request with a deadline must miss it.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from torch import nn

from tests.numerics import rel_err

from ..conftest import REPO_ROOT, ServerProcess, free_port, metric_value, reference, write_layer

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

KEY = "grpc-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_BODY = 1 << 20  # DECONV_MAX_BODY_BYTES of the test server: a larger message is refused
WAIT_S = 120.0  # the longest any call here may take (a busy 2-core machine); never reached when things work


class Live:
    """A running server: its HTTP URL, its gRPC address and the float64 modules of its layers."""

    def __init__(self, proc: ServerProcess, grpc_port: int, modules: dict[str, nn.ConvTranspose2d]) -> None:
        self.proc = proc
        self.url = proc.url
        self.address = f"127.0.0.1:{grpc_port}"
        self.modules = modules

    def client(self) -> Any:
        """A new client (a new connection: with two HTTP processes the kernel picks the process)."""
        return grpcclient.InferenceServerClient(self.address)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=WAIT_S).text


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "two-http-processes"])
def live(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("grpc-layers")
    modules = {
        "up": write_layer(root, "up", 4, 6, 3, stride=2, padding=1),
        # Batches of two samples, waiting for the second as long as it takes (the module docstring).
        "pair": write_layer(root, "pair", 2, 3, 2, stride=2,
                            limits={"max_batch_size": 2, "max_queue_delay_ms": 3_600_000.0}),
    }
    grpc_port = free_port()
    log = tmp_path_factory.mktemp("grpc-server") / "server.log"
    proc = ServerProcess({"DECONV_LAYER_REPOSITORY": str(root), "DECONV_HTTP_PROCESSES": request.param,
                          "DECONV_GRPC_PORT": str(grpc_port), "DECONV_API_KEY": KEY,
                          "DECONV_MAX_BODY_BYTES": str(MAX_BODY), "DECONV_ACCESS_LOG": "0"}, log)
    try:
        proc.wait_ready()
        yield Live(proc, grpc_port, modules)
    finally:
        assert proc.stop(60) == 0, proc.log()[-5000:]
        assert "Traceback" not in proc.log(), proc.log()[-5000:]


def _input(x: np.ndarray) -> Any:
    tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return tensor


def _status(exc: InferenceServerException) -> str:
    return str(exc.status())


def test_server_and_model_calls(live: Live) -> None:
    client = live.client()
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta.name == "deconv"
    assert {"model_configuration", "model_repository", "statistics", "system_shared_memory"} <= set(meta.extensions)
    assert "cuda_shared_memory" not in meta.extensions  # a CPU server
    assert client.is_model_ready("up")
    assert client.is_model_ready("up", "1")

    model = client.get_model_metadata("up")
    assert (model.name, list(model.versions), model.platform) == ("up", ["1"], "deconv")
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [("input", "FP32", [-1, 4, -1, -1])]
    assert [(t.name, t.datatype, list(t.shape)) for t in model.outputs] == [("output", "FP32", [-1, 6, -1, -1])]

    described = httpx.get(f"{live.url}/v1/layers/pair", timeout=WAIT_S).json()
    config = client.get_model_config("pair").config
    assert config.name == "pair"
    assert config.max_batch_size == described["max_batch_size"] == 2
    assert [(i.name, list(i.dims)) for i in config.input] == [("input", [2, -1, -1])]
    assert [(o.name, list(o.dims)) for o in config.output] == [("output", [3, -1, -1])]
    assert config.input[0].data_type == config.output[0].data_type == 11  # TYPE_FP32
    assert config.dynamic_batching.max_queue_delay_microseconds == 3_600_000_000
    as_json = client.get_model_config("up", as_json=True)["config"]
    assert as_json["input"][0]["data_type"] == "TYPE_FP32"
    assert as_json["instance_group"][0]["kind"] == "KIND_CPU"

    index = client.get_model_repository_index(as_json=True)["models"]
    assert sorted((m["name"], m["version"], m["state"]) for m in index) == [("pair", "1", "READY"),
                                                                           ("up", "1", "READY")]
    assert len(client.get_model_repository_index().models) == 2


def test_infer_binary_matches_float64(live: Live) -> None:
    client = live.client()
    torch.manual_seed(1)
    # batched, one sample without the batch dimension, and one of 128 KiB (its bytes read as views of the message)
    for shape in ([3, 4, 5, 7], [4, 6, 3], [2, 4, 64, 64]):
        x = torch.randn(shape)
        result = client.infer("up", [_input(x.numpy())], headers=AUTH, request_id="req-7",
                              outputs=[grpcclient.InferRequestedOutput("output")])
        y = result.as_numpy("output")
        ref = reference(live.modules["up"], x if len(shape) == 4 else x[None])
        assert y.shape == (tuple(ref.shape) if len(shape) == 4 else tuple(ref.shape[1:]))
        assert rel_err(torch.from_numpy(y.copy()).reshape(ref.shape), ref) < 1e-5
        response = result.get_response()
        assert (response.model_name, response.model_version, response.id) == ("up", "1", "req-7")
        assert response.parameters["deconv_batch_size"].int64_param >= (shape[0] if len(shape) == 4 else 1)


def test_infer_typed_contents(live: Live) -> None:
    """FP32 values in ``contents.fp32_contents`` rather than raw bytes (tritonclient's own messages, sent as they
    are)."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    x = torch.randn(1, 4, 3, 3)
    request = service_pb2.ModelInferRequest(model_name="up")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.reshape(-1).tolist())
    with grpc.insecure_channel(live.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        response = stub.ModelInfer(request, metadata=tuple(AUTH.items()), timeout=WAIT_S)
        out = response.outputs[0]
        y = torch.from_numpy(np.frombuffer(response.raw_output_contents[0], dtype=np.float32).copy())
        ref = reference(live.modules["up"], x)
        assert (out.name, out.datatype, list(out.shape)) == ("output", "FP32", list(ref.shape))
        assert rel_err(y.reshape(ref.shape), ref) < 1e-5

        del request.inputs[0].contents.fp32_contents[-1]  # one value short
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request, metadata=tuple(AUTH.items()), timeout=WAIT_S)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "fp32_contents holds 35 values" in err.value.details()


def test_errors_have_their_status_codes(live: Live) -> None:
    client = live.client()
    x = np.zeros((1, 4, 3, 3), np.float32)
    cases = [
        (lambda: client.infer("nope", [_input(x)], headers=AUTH), "StatusCode.NOT_FOUND", "no layer named 'nope'"),
        (lambda: client.get_model_metadata("nope"), "StatusCode.NOT_FOUND", "no layer named 'nope'"),
        (lambda: client.get_model_config("up", "2"), "StatusCode.NOT_FOUND", "version '2' does not exist"),
        (lambda: client.is_model_ready("nope"), "StatusCode.NOT_FOUND", "no layer named 'nope'"),
        (lambda: client.infer("up", [_input(np.zeros((1, 3, 3, 3), np.float32))], headers=AUTH),
         "StatusCode.INVALID_ARGUMENT", "input has 3 channels; layer 'up' takes 4"),
        (lambda: client.infer("up", [_input(np.zeros((4, 3), np.float32))], headers=AUTH),
         "StatusCode.INVALID_ARGUMENT", "expected shape [N, C, H, W] or [C, H, W], got [4, 3]"),
        (lambda: client.infer("up", [_input(x)]), "StatusCode.UNAUTHENTICATED", "missing or wrong API key"),
        (lambda: client.infer("up", [_input(x)], headers={"authorization": "Bearer wrong"}),
         "StatusCode.UNAUTHENTICATED", "missing or wrong API key"),
        (lambda: client.get_system_shared_memory_status(), "StatusCode.UNAUTHENTICATED", "missing or wrong API key"),
        (lambda: client.infer("up", [_input(np.zeros((1, 4, 256, 256), np.float32))], headers=AUTH),
         "StatusCode.RESOURCE_EXHAUSTED", "larger than max"),  # 1 MiB of input over a 1 MiB limit
    ]
    for call, status, text in cases:
        with pytest.raises(InferenceServerException) as err:
            call()
        assert _status(err.value) == status, err.value
        assert text in err.value.message(), err.value
    metrics = live.metrics()
    assert metric_value(metrics, "deconv_requests_total", layer="unknown", api="grpc", status="404") >= 1
    assert metric_value(metrics, "deconv_requests_total", layer="up", api="grpc", status="422") >= 2


def _kserve_http(live: Live, name: str, x: torch.Tensor) -> httpx.Response:
    """A KServe binary request over HTTP (one sample)."""
    head = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.numel() * 4}}],
                       "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()
    return httpx.post(f"{live.url}/v2/models/{name}/infer", content=head + x.numpy().tobytes(), timeout=WAIT_S,
                      headers={**AUTH, "Inference-Header-Content-Length": str(len(head))})


def test_grpc_and_http_requests_share_a_batch(live: Live) -> None:
    """Layer ``pair`` runs a batch only once it holds two samples: one request over gRPC and one over HTTP, sent
    together, can only be answered from one batch, which both answers report."""
    torch.manual_seed(2)
    xs = [torch.randn(1, 2, 4, 5), torch.randn(1, 2, 4, 5)]
    client = live.client()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        over_grpc = pool.submit(client.infer, "pair", [_input(xs[0].numpy())], headers=AUTH,
                                client_timeout=WAIT_S)
        over_http = pool.submit(_kserve_http, live, "pair", xs[1])
        result, response = over_grpc.result(WAIT_S), over_http.result(WAIT_S)
    params = result.get_response().parameters
    assert params["deconv_batch_size"].int64_param == 2
    assert params["deconv_batch_requests"].int64_param == 2
    assert response.status_code == 200, response.text
    assert response.headers["x-deconv-batch-size"] == "2"
    ref = [reference(live.modules["pair"], x) for x in xs]
    assert rel_err(torch.from_numpy(result.as_numpy("output").copy()), ref[0]) < 1e-5
    head = int(response.headers["inference-header-content-length"])
    y = np.frombuffer(response.content[head:], dtype=np.float32).reshape(tuple(ref[1].shape))
    assert rel_err(torch.from_numpy(y.copy()), ref[1]) < 1e-5


def test_deadline_passes_in_the_queue_and_the_request_is_dropped(live: Live) -> None:
    """A lone request for ``pair`` waits for a second one that never comes: its gRPC deadline passes, it fails
    with DEADLINE_EXCEEDED and leaves the queue, so the next two requests make a batch of their own."""
    client = live.client()
    before = metric_value(live.metrics(), "deconv_requests_dropped_total", layer="pair", reason="deadline")
    x = np.zeros((1, 2, 3, 3), np.float32)
    with pytest.raises(InferenceServerException) as err:
        client.infer("pair", [_input(x)], headers=AUTH, client_timeout=1.0)
    assert _status(err.value) == "StatusCode.DEADLINE_EXCEEDED"
    dropped = before
    for _ in range(600):  # the drop may follow the client's error by a moment; each read is a /metrics request
        dropped = sum(metric_value(live.metrics(), "deconv_requests_dropped_total", layer="pair", reason=reason)
                      for reason in ("deadline", "cancelled", "disconnected"))
        if dropped > before:
            break
    assert dropped == before + 1
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: client.infer("pair", [_input(x)], headers=AUTH, client_timeout=WAIT_S),
                                range(2)))
    assert [r.get_response().parameters["deconv_batch_requests"].int64_param for r in results] == [2, 2]


def test_a_cancelled_call_leaves_the_queue(live: Live) -> None:
    """A call for ``pair`` waits in the queue for a second request; the client cancels it: the server drops it from
    the queue (``deconv_requests_dropped_total{reason="cancelled"}``), so the queue is empty again."""
    client = live.client()

    def dropped() -> float:
        return metric_value(live.metrics(), "deconv_requests_dropped_total", layer="pair", reason="cancelled")

    def depth() -> float:
        return metric_value(live.metrics(), "deconv_queue_depth", layer="pair")

    before = dropped()
    answers: list[Any] = []
    call = client.async_infer("pair", [_input(np.zeros((1, 2, 3, 3), np.float32))],
                              lambda result, error: answers.append((result, error)), headers=AUTH)
    for _ in range(600):  # until it waits in the queue (each read is a /metrics request)
        if depth() == 1:
            break
    else:
        raise AssertionError("the call never reached the queue")
    call.cancel()
    for _ in range(600):
        if dropped() > before and depth() == 0:
            break
    assert dropped() == before + 1
    assert depth() == 0
    assert answers == [] or answers[0][0] is None


def test_system_shared_memory(live: Live) -> None:
    import tritonclient.utils.shared_memory as shm

    client = live.client()
    torch.manual_seed(3)
    x = torch.randn(2, 4, 5, 6)
    ref = reference(live.modules["up"], x)
    in_bytes, out_bytes = x.numel() * 4, ref.numel() * 4
    tag = uuid.uuid4().hex[:8]
    names = {"in": f"in-{tag}", "out": f"out-{tag}"}
    handles = {k: shm.create_shared_memory_region(n, f"/deconv-grpc-{n}", size)
               for (k, n), size in zip(names.items(), (in_bytes, out_bytes + 64), strict=True)}
    try:
        shm.set_shared_memory_region(handles["in"], [x.numpy()])
        for kind, name in names.items():
            size = in_bytes if kind == "in" else out_bytes + 64
            client.register_system_shared_memory(name, f"/deconv-grpc-{name}", size, headers=AUTH)
        status = client.get_system_shared_memory_status(headers=AUTH, as_json=True)["regions"]
        assert {status[n]["name"]: int(status[n]["byte_size"]) for n in names.values()} == {
            names["in"]: in_bytes, names["out"]: out_bytes + 64}
        # One table for both protocols: the HTTP API sees the regions gRPC registered.
        over_http = httpx.get(f"{live.url}/v2/systemsharedmemory/status", headers=AUTH, timeout=WAIT_S).json()
        assert set(names.values()) <= {r["name"] for r in over_http}

        tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
        tensor.set_shared_memory(names["in"], in_bytes)
        output = grpcclient.InferRequestedOutput("output")
        output.set_shared_memory(names["out"], out_bytes + 64, offset=0)
        result = client.infer("up", [tensor], outputs=[output], headers=AUTH)
        out = result.get_output("output")
        assert out.parameters["shared_memory_region"].string_param == names["out"]
        assert out.parameters["shared_memory_byte_size"].int64_param == out_bytes
        y = shm.get_contents_as_numpy(handles["out"], np.float32, list(ref.shape))
        assert rel_err(torch.from_numpy(y.copy()), ref) < 1e-5

        client.unregister_system_shared_memory(names["in"], headers=AUTH)
        status = client.get_system_shared_memory_status(headers=AUTH, as_json=True).get("regions", {})
        assert names["in"] not in status
        assert names["out"] in status
        with pytest.raises(InferenceServerException) as err:
            client.infer("up", [tensor], headers=AUTH)
        assert _status(err.value) == "StatusCode.INVALID_ARGUMENT"
        assert f"no shared-memory region named {names['in']!r}" in err.value.message()
        with pytest.raises(InferenceServerException) as err:
            client.get_system_shared_memory_status(names["in"], headers=AUTH)
        assert _status(err.value) == "StatusCode.INVALID_ARGUMENT"
        client.unregister_system_shared_memory(headers=AUTH)  # every region
        assert client.get_system_shared_memory_status(headers=AUTH, as_json=True).get("regions", {}) == {}
    finally:
        for handle in handles.values():
            shm.destroy_shared_memory_region(handle)


def test_cuda_shared_memory_calls_on_a_cpu_server(live: Live) -> None:
    """The CUDA shared-memory calls answer as the HTTP routes do on a server without a GPU: registering fails with
    the reason, the status is empty, unregistering is a no-op."""
    client = live.client()
    with pytest.raises(InferenceServerException) as err:
        client.register_cuda_shared_memory("gpu", base64.b64encode(bytes(64)), 0, 1024, headers=AUTH)
    assert _status(err.value) == "StatusCode.INVALID_ARGUMENT"
    assert err.value.message()
    with pytest.raises(InferenceServerException) as err:
        client.register_cuda_shared_memory("gpu", base64.b64encode(bytes(8)), 0, 1024, headers=AUTH)
    assert "a CUDA IPC handle (cudaIpcMemHandle_t) has 64" in err.value.message()
    assert client.get_cuda_shared_memory_status(headers=AUTH, as_json=True).get("regions", {}) == {}
    client.unregister_cuda_shared_memory(headers=AUTH)


def test_statistics_agree_with_the_metrics(live: Live) -> None:
    client = live.client()
    x = np.ones((2, 4, 3, 3), np.float32)
    for _ in range(3):
        client.infer("up", [_input(x)], headers=AUTH)
    stats = client.get_inference_statistics("up", as_json=True)["model_stats"][0]
    metrics = live.metrics()
    answered = sum(metric_value(metrics, "deconv_requests_total", layer="up", api=api, status="200")
                   for api in ("grpc", "kserve", "native"))
    assert int(stats["inference_stats"]["success"]["count"]) == answered >= 3
    assert int(stats["inference_count"]) >= 6
    every = client.get_inference_statistics(as_json=True)["model_stats"]
    assert sorted(s["name"] for s in every) == ["pair", "up"]


def _exit_status(env: dict[str, str], tmp: Path) -> tuple[int, str]:
    """Start ``python -m service`` and wait for it to end (it must fail to start)."""
    log = tmp / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.run([sys.executable, "-m", "service"], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                              env={**env, "DECONV_DEVICES": "cpu", "DECONV_HOST": "127.0.0.1",
                                   "DECONV_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}, timeout=WAIT_S)
    return proc.returncode, log.read_text(errors="replace")


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_grpc_port_in_use_stops_the_start(processes: str, tmp_path: Path) -> None:
    import os

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, log = _exit_status({**os.environ, "DECONV_GRPC_PORT": str(port), "DECONV_HTTP_PROCESSES": processes},
                                 tmp_path)
    assert code == 3, log
    assert f"127.0.0.1:{port}" in log, log


@pytest.mark.parametrize("processes", ["1", "2"])
def test_sigterm_answers_the_grpc_call_in_progress(processes: str, tmp_path: Path, server_factory: Any) -> None:
    """A call queued when SIGTERM comes is computed and answered (the drain runs queued requests at once), and the
    server then exits 0: the gRPC server stops only after the HTTP side has drained."""
    module = write_layer(tmp_path / "layers", "pair", 2, 3, 2, stride=2,
                         limits={"max_batch_size": 2, "max_queue_delay_ms": 3_600_000.0})
    port = free_port()
    server = server_factory({"DECONV_LAYER_REPOSITORY": str(tmp_path / "layers"), "DECONV_HTTP_PROCESSES": processes,
                             "DECONV_GRPC_PORT": str(port)})
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    x = torch.randn(1, 2, 4, 4)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.infer, "pair", [_input(x.numpy())], client_timeout=WAIT_S)
        for _ in range(600):  # until the call waits in the queue (each read is a /metrics request)
            text = httpx.get(f"{server.url}/metrics", timeout=WAIT_S).text
            if metric_value(text, "deconv_queue_depth", layer="pair") == 1:
                break
        else:
            raise AssertionError("the call never reached the queue")
        assert not pending.done()
        server.terminate()
        result = pending.result(WAIT_S)
    assert result.get_response().parameters["deconv_batch_requests"].int64_param == 1
    assert rel_err(torch.from_numpy(result.as_numpy("output").copy()), reference(module, x)) < 1e-5
    assert server.proc.wait(WAIT_S) == 0, server.log()[-5000:]
    assert "Traceback" not in server.log()
