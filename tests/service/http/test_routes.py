"""Every route and error path, in-process through httpx.ASGITransport (lifespan run explicitly)."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from fastapi.openapi.constants import REF_TEMPLATE
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from service.config import Settings
from service.engine import paths as paths_module
from service.engine.local import LocalEngine
from service.http.app import create_app
from service.http.asgi import MAX_DEADLINE_MS
from service.http.schemas import (
    DeadlineHeader,
    ErrorBody,
    KServeError,
    KServeInferRequest,
    KServeInferResponse,
    LayerQuery,
    ModelPath,
    VersionedModelPath,
)
from tests.numerics import rel_err

from ..conftest import (
    NPY,
    REPO_ROOT,
    SAFETENSORS,
    load_npy,
    metric_value,
    npy_bytes,
    reference,
    run,
    serve_app,
    started,
    until,
    write_layer,
)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root: Path = tmp_path_factory.mktemp("layers")
    small = dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, output_padding=1)
    limits = {"max_batch_size": 4, "max_height": 32, "max_width": 32}
    modules = {
        "small": write_layer(root, "small", **small, limits=limits),
        "half": write_layer(root, "half", **small, dtype="float16", limits=limits),
        "bf": write_layer(root, "bf", **small, dtype="bfloat16", limits=limits),
        "slow": write_layer(root, "slow", **small, limits={**limits, "max_queue_delay_ms": 600_000,
                                                            "max_queue_size": 2}),
    }
    return {"root": root, "modules": modules}


def settings(repo: dict[str, Any], **kw: Any) -> Settings:
    return Settings(layer_repository=repo["root"], devices="cpu", **kw)


def post_npy(client, layer: str, arr: np.ndarray, **headers: str):
    return client.post(f"/deconv?layer={layer}", content=npy_bytes(arr), headers={"content-type": NPY, **headers})


def assert_error(r, status: int, type_: str) -> dict[str, Any]:
    assert r.status_code == status, r.text[:500]
    body = r.json()
    assert body["error"]["type"] == type_
    assert "Traceback" not in body["error"]["message"]
    return body


# --- /deconv -------------------------------------------------------------------------------------------------


def test_npy_in_npy_out_matches_pytorch(repo):
    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            x = np.random.default_rng(0).standard_normal((3, 4, 5, 7)).astype(np.float32)
            r = await post_npy(client, "small", x)
            assert r.status_code == 200, r.text
            assert r.headers["content-type"] == NPY
            assert int(r.headers["x-deconv-batch-size"]) >= 3
            assert float(r.headers["x-deconv-queue-ms"]) >= 0
            y = load_npy(r.content)
            assert y.dtype == np.float32
            assert y.shape == (3, 6, 10, 14)
            assert rel_err(y, reference(repo["modules"]["small"], torch.from_numpy(x))) < 1e-5

            # unbatched [C, H, W] in, [C_out, H_out, W_out] out
            r = await post_npy(client, "small", x[0])
            assert load_npy(r.content).shape == (6, 10, 14)

    run(main())


def test_safetensors_and_accept(repo):
    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            x = torch.randn(2, 4, 6, 6)
            r = await client.post("/deconv?layer=small", content=st_save({"anything": x}),
                                  headers={"content-type": SAFETENSORS})
            assert r.status_code == 200, r.text
            assert r.headers["content-type"] == SAFETENSORS
            out = st_load(r.content)
            assert list(out) == ["output"]
            assert rel_err(out["output"], reference(repo["modules"]["small"], x)) < 1e-5

            r = await client.post("/deconv?layer=small", content=st_save({"x": x}),
                                  headers={"content-type": SAFETENSORS, "accept": NPY})
            assert r.headers["content-type"] == NPY
            assert load_npy(r.content).shape == (2, 6, 12, 12)

            r = await post_npy(client, "small", x.numpy(), accept=SAFETENSORS)
            assert r.headers["content-type"] == SAFETENSORS

    run(main())


def test_half_and_bfloat16_keep_their_dtype(repo):
    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            x = torch.randn(2, 4, 5, 5)
            r = await post_npy(client, "half", x.half().numpy())
            assert r.status_code == 200, r.text
            y = load_npy(r.content)
            assert y.dtype == np.float16
            ref = reference(repo["modules"]["half"].half().double(), x.half())
            assert rel_err(y.astype(np.float64), ref) < 2e-2

            xb = x.to(torch.bfloat16)
            r = await client.post("/deconv?layer=bf", content=st_save({"x": xb}), headers={"content-type": SAFETENSORS})
            assert r.status_code == 200, r.text
            yb = st_load(r.content)["output"]
            assert yb.dtype == torch.bfloat16
            assert rel_err(yb, reference(repo["modules"]["bf"].bfloat16().double(), xb)) < 2e-2

            r = await client.post("/deconv?layer=bf", content=st_save({"x": xb}),
                                  headers={"content-type": SAFETENSORS, "accept": NPY})
            assert_error(r, 415, "unsupported_media_type")

    run(main())


def test_empty_batch(repo):
    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            r = await post_npy(client, "small", np.zeros((0, 4, 5, 5), np.float32))
            assert r.status_code == 200
            assert load_npy(r.content).shape == (0, 6, 10, 10)

    run(main())


def test_input_errors(repo):
    async def main() -> None:
        async with serve_app(settings(repo, max_body_bytes=20_000)) as (_, client):
            ok = np.zeros((1, 4, 5, 5), np.float32)
            assert_error(await post_npy(client, "nope", ok), 404, "unknown_layer")
            assert_error(await client.post("/deconv", content=npy_bytes(ok), headers={"content-type": NPY}),
                         422, "invalid_input")  # no layer parameter
            assert_error(await client.post("/deconv?layer=small", content=npy_bytes(ok),
                                           headers={"content-type": "application/json"}), 415, "unsupported_media_type")
            assert_error(await client.post("/deconv?layer=small", content=npy_bytes(ok)), 415, "unsupported_media_type")
            assert_error(await post_npy(client, "small", ok, accept="text/html"), 415, "unsupported_media_type")
            assert_error(await client.post("/deconv?layer=small", content=b"\x93NUMPY garbage",
                                           headers={"content-type": NPY}), 400, "malformed_body")
            assert_error(await client.post("/deconv?layer=small", content=st_save({"a": torch.zeros(1),
                                                                                    "b": torch.zeros(1)}),
                                           headers={"content-type": SAFETENSORS}), 400, "malformed_body")
            body = assert_error(await post_npy(client, "small", np.zeros((1, 3, 5, 5), np.float32)),
                                422, "invalid_input")
            assert "3 channels" in body["error"]["message"]
            assert_error(await post_npy(client, "small", ok.astype(np.float64)), 422, "invalid_input")
            assert_error(await post_npy(client, "small", np.zeros((4, 5), np.float32)), 422, "invalid_input")
            assert_error(await post_npy(client, "small", np.zeros((1, 4, 33, 5), np.float32)), 422, "invalid_input")
            assert_error(await post_npy(client, "small", np.zeros((5, 4, 5, 5), np.float32)),
                         413, "payload_too_large")  # max_batch_size 4
            assert_error(await post_npy(client, "small", np.zeros((4, 4, 32, 32), np.float32)),
                         413, "payload_too_large")  # body over max_body_bytes

            async def chunks():
                for _ in range(3):
                    yield b"\0" * 10_000

            r = await client.post("/deconv?layer=small", content=chunks(), headers={"content-type": NPY})
            assert_error(r, 413, "payload_too_large")  # no Content-Length: counted while reading
            assert_error(await post_npy(client, "small", ok, **{"x-deadline-ms": "soon"}), 422, "invalid_input")

    run(main())


def test_api_key_protects_inference_only(repo):
    async def main() -> None:
        async with serve_app(settings(repo, api_key="sekret")) as (_, client):
            x = np.zeros((1, 4, 5, 5), np.float32)
            r = await post_npy(client, "small", x)
            assert_error(r, 401, "unauthorized")
            assert r.headers["www-authenticate"] == "Bearer"
            assert_error(await post_npy(client, "small", x, authorization="Bearer wrong"), 401, "unauthorized")
            assert (await post_npy(client, "small", x, authorization="Bearer sekret")).status_code == 200
            r = await client.post("/v2/models/small/infer", json=_kserve_json(x))
            assert r.status_code == 401
            assert r.json()["type"] == "unauthorized"
            r = await client.post("/v2/models/small/infer", json=_kserve_json(x),
                                  headers={"authorization": "Bearer sekret"})
            assert r.status_code == 200
            for path in ("/v1/layers", "/health/ready", "/metrics", "/v2/models/small"):
                assert (await client.get(path)).status_code == 200

    run(main())


def test_inference_parameters_are_checked_like_fastapi_did(repo):
    # The app reads `layer` and X-Deadline-Ms itself, before the route runs (service.http.asgi.admit): the key
    # first, then the query, then the header (422).
    async def main() -> None:
        async with serve_app(settings(repo, api_key="sekret")) as (_, client):
            ok = npy_bytes(np.zeros((1, 4, 5, 5), np.float32))
            assert_error(await client.post("/deconv", content=ok, headers={"content-type": NPY}), 401, "unauthorized")
            r = await client.post("/deconv", content=ok, headers={"content-type": NPY, "x-deadline-ms": "soon"})
            assert_error(r, 401, "unauthorized")
            auth = {"authorization": "Bearer sekret", "content-type": NPY}
            body = assert_error(await client.post("/deconv", content=ok, headers=auth), 422, "invalid_input")
            assert body["error"]["message"] == "query.layer: Field required"
            r = await client.post("/deconv", content=ok, headers={**auth, "x-deadline-ms": "soon"})
            assert assert_error(r, 422, "invalid_input")["error"]["message"] == "query.layer: Field required"
            for bad in ("-1", "nan", "soon", ""):
                r = await client.post("/deconv?layer=small", content=ok, headers={**auth, "x-deadline-ms": bad})
                body = assert_error(r, 422, "invalid_input")
                assert "x-deadline-ms" in body["error"]["message"]
                r = await client.post("/v2/models/small/infer", json=_kserve_json(np.zeros((1, 4, 5, 5), np.float32)),
                                      headers={"authorization": "Bearer sekret", "x-deadline-ms": bad})
                assert r.status_code == 422
                assert r.json()["type"] == "invalid_input"
            r = await client.post("/deconv?layer=small", content=ok, headers={**auth, "x-deadline-ms": "0"})
            assert_error(r, 504, "deadline_exceeded")  # 0 ms: parsed, and passed before execution
            r = await client.post("/deconv?layer=small", content=ok, headers={**auth, "x-deadline-ms": "5000.5"})
            assert r.status_code == 200
            r = await client.post("/v2/models/small/versions/1/infer", headers={"authorization": "Bearer sekret"},
                                  json=_kserve_json(np.zeros((1, 4, 5, 5), np.float32)))
            assert r.status_code == 200
            assert r.json()["model_name"] == "small"
            r = await client.post("/v2/models/small/versions/2/infer", headers={"authorization": "Bearer sekret"},
                                  json=_kserve_json(np.zeros((1, 4, 5, 5), np.float32)))
            assert r.status_code == 404
            spec = (await client.get("/openapi.json")).json()
            params = {p["name"]: p for p in spec["paths"]["/deconv"]["post"]["parameters"]}
            assert (params["layer"]["in"], params["layer"]["required"]) == ("query", True)
            assert params["x-deadline-ms"]["in"] == "header"
            assert params["x-deadline-ms"]["schema"]["anyOf"][0] == {"type": "number", "minimum": 0,
                                                                     "maximum": MAX_DEADLINE_MS}
            v2 = spec["paths"]["/v2/models/{name}/versions/{version}/infer"]["post"]["parameters"]
            assert [(p["name"], p["in"]) for p in v2] == [("name", "path"), ("version", "path"),
                                                          ("x-deadline-ms", "header")]

    run(main())


def test_unknown_route_and_method_use_the_error_shape(repo):
    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            assert_error(await client.get("/nothing/here"), 404, "not_found")
            assert_error(await client.get("/deconv?layer=small"), 405, "method_not_allowed")
            r = await client.get("/v2/nothing")
            assert r.status_code == 404
            assert r.json()["type"] == "not_found"
            assert isinstance(r.json()["error"], str)

    run(main())


def test_kernel_failure_fails_the_batch_and_the_server_keeps_serving(repo, monkeypatch):
    real = paths_module.kernel_forward

    def fails_for_three(x, w, b, layer):
        if x.shape[0] == 3:
            raise RuntimeError("simulated kernel failure at /secret/path.cu:12")
        return real(x, w, b, layer)

    monkeypatch.setattr(paths_module, "kernel_forward", fails_for_three)

    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            body = assert_error(await post_npy(client, "small", np.ones((3, 4, 5, 5), np.float32)), 500, "internal")
            assert "/secret/path" not in body["error"]["message"]
            assert (await post_npy(client, "small", np.ones((1, 4, 5, 5), np.float32))).status_code == 200
            text = (await client.get("/metrics")).text
            assert metric_value(text, "deconv_requests_total", layer="small", api="native", status="500") == 1
            assert metric_value(text, "deconv_requests_total", layer="small", api="native", status="200") == 1

    run(main())


def test_deadline_passes_in_the_queue(repo):
    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            t0 = time.monotonic()
            r = await post_npy(client, "slow", np.ones((1, 4, 5, 5), np.float32), **{"x-deadline-ms": "100"})
            assert_error(r, 504, "deadline_exceeded")
            assert time.monotonic() - t0 > 0.09  # not before the deadline (a lower bound: no slow-machine risk)
            # Dropped from the queue rather than answered after its 10-minute batching delay: the metrics say so,
            # no upper bound on the time needed.
            text = (await client.get("/metrics")).text
            assert metric_value(text, "deconv_requests_dropped_total", layer="slow", reason="deadline") == 1
            assert metric_value(text, "deconv_batch_size_count", layer="slow") == 0  # never executed

    run(main())


def test_an_answer_written_once_the_drain_began_closes_its_connection(repo):
    """A request that came in while the server was ready and is answered after the drain began says
    ``Connection: close``, as every answer from then on does (in an HTTP process of N the engine's drain can arrive
    before the process's own signal)."""
    async def main() -> None:
        x = np.ones((1, 4, 5, 5), np.float32)
        async with serve_app(settings(repo)) as (app, client):
            queued = asyncio.ensure_future(post_npy(client, "slow", x))
            engine: LocalEngine = app.state.engine
            await until(lambda: engine.queues["slow"].depth == 1, "a request queued")
            engine.begin_drain()
            r = await asyncio.wait_for(queued, 60)
            assert r.status_code == 200
            assert r.headers["connection"] == "close"

    run(main())


def test_full_queue_429_and_shutdown_answers_the_queued(repo):
    async def main() -> None:
        x = np.ones((1, 4, 5, 5), np.float32)
        async with serve_app(settings(repo)) as (app, client):
            queued = [asyncio.ensure_future(post_npy(client, "slow", x)) for _ in range(2)]
            engine: LocalEngine = app.state.engine
            await until(lambda: engine.queues["slow"].depth == 2, "two requests queued")
            r = await post_npy(client, "slow", x)
            assert_error(r, 429, "overloaded")
            # Refused at once rather than after waiting for room: the queued two leave only when their 10-minute
            # delay runs out (or at the drain below), and they are still queued.
            assert engine.queues["slow"].depth == 2
            assert not any(q.done() for q in queued)
            assert int(r.headers["retry-after"]) >= 1
            engine.begin_drain()  # what SIGTERM does
            r = await client.get("/health/ready")
            assert_error(r, 503, "not_ready")
            assert "draining" in r.json()["error"]["message"]
            assert_error(await post_npy(client, "small", x), 503, "not_ready")
            # Flushed without the 10-minute delay; the bound only limits how long a broken drain is waited for.
            responses = await asyncio.wait_for(asyncio.gather(*queued), 60)
            assert [q.status_code for q in responses] == [200, 200]
            assert [q.headers["x-deconv-batch-size"] for q in responses] == ["2", "2"]

    run(main())


def test_cancelled_request_is_dropped_before_execution(repo):
    async def main() -> None:
        async with serve_app(settings(repo)) as (app, client):
            task = asyncio.ensure_future(post_npy(client, "slow", np.ones((1, 4, 5, 5), np.float32)))
            engine: LocalEngine = app.state.engine
            await until(lambda: engine.queues["slow"].depth == 1, "the request queued")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert engine.queues["slow"].depth == 0
            text = (await client.get("/metrics")).text
            assert metric_value(text, "deconv_requests_dropped_total", layer="slow", reason="cancelled") == 1
            assert metric_value(text, "deconv_batch_size_count", layer="slow") == 0

    run(main())


# --- readiness --------------------------------------------------------------------------------------------------


def test_live_at_once_ready_after_self_tests(repo, monkeypatch):
    original = LocalEngine._prepare

    async def main() -> None:
        gate = asyncio.Event()

        async def gated(self: LocalEngine) -> None:
            await gate.wait()
            await original(self)

        monkeypatch.setattr(LocalEngine, "_prepare", gated)
        async with serve_app(settings(repo), wait_ready=False) as (app, client):
            assert (await client.get("/health/live")).json() == {"status": "live"}
            assert (await client.get("/v2/health/live")).status_code == 200
            r = await client.get("/health/ready")
            assert_error(r, 503, "not_ready")
            assert "retry-after" in r.headers
            assert (await client.get("/v2/health/ready")).status_code == 503
            assert (await client.get("/v2/models/small/ready")).status_code == 503
            assert_error(await post_npy(client, "small", np.ones((1, 4, 5, 5), np.float32)), 503, "not_ready")
            assert "deconv_ready 0.0" in (await client.get("/metrics")).text
            gate.set()
            assert await started(app) == "ready"
            assert (await client.get("/health/ready")).json() == {"status": "ready"}
            assert "deconv_ready 1.0" in (await client.get("/metrics")).text

    run(main())


def test_failed_self_test_keeps_the_server_unready_with_the_reason(repo, monkeypatch):
    real = paths_module.kernel_forward
    monkeypatch.setattr(paths_module, "kernel_forward", lambda x, w, b, layer: real(x, w, b, layer) + 1.0)

    async def main() -> None:
        async with serve_app(settings(repo), wait_ready=False) as (app, client):
            assert await started(app) == "failed"
            body = assert_error(await client.get("/health/ready"), 503, "not_ready")
            assert "self-test failed" in body["error"]["message"]
            assert "'small'" in body["error"]["message"]

    run(main())


# --- layers, metrics, docs ---------------------------------------------------------------------------------------


def test_layer_descriptions(repo):
    async def main() -> None:
        async with serve_app(settings(repo, max_queue_size=99)) as (_, client):
            layers = (await client.get("/v1/layers")).json()["layers"]
            assert [d["name"] for d in layers] == ["bf", "half", "slow", "small"]
            d = (await client.get("/v1/layers/small")).json()
            assert d["kernel_size"] == [3, 3]
            assert d["output_padding"] == [1, 1]
            assert d["dtype"] == "float32"
            assert d["precision"] == "fp32"
            assert d["max_batch_size"] == 4  # the layer's own
            assert d["max_queue_size"] == 99  # the server's default
            assert d["input_shape"] == [-1, 4, -1, -1]
            assert d["output_size"].startswith("H_out = (H - 1) * 2 - 2 * 1 + 1 * (3 - 1) + 1 + 1")
            assert (await client.get("/v1/layers/bf")).json()["precision"] == "bf16"
            assert_error(await client.get("/v1/layers/nope"), 404, "unknown_layer")

    run(main())


def test_metrics_names(repo):
    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            await post_npy(client, "small", np.ones((2, 4, 5, 5), np.float32))
            r = await client.get("/metrics")
            assert r.headers["content-type"].startswith("text/plain")
            text = r.text
            for name in ("deconv_requests_total", "deconv_request_latency_seconds_bucket",
                         "deconv_queue_time_seconds_bucket", "deconv_batch_size_bucket", "deconv_queue_depth",
                         "deconv_worker_batches_total", "deconv_worker_busy", "deconv_worker_inflight_samples",
                         "deconv_ready"):
                assert name in text, name
            assert metric_value(text, "deconv_batch_size_sum", layer="small") == 2
            assert metric_value(text, "deconv_worker_batches_total", worker="cpu") >= 1

    run(main())


def test_openapi_documents_the_binary_bodies(repo):
    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            spec = (await client.get("/openapi.json")).json()
            body = spec["paths"]["/deconv"]["post"]["requestBody"]["content"]
            assert set(body) == {NPY, SAFETENSORS}
            assert body[NPY]["schema"] == {"type": "string", "format": "binary"}
            assert set(spec["paths"]["/deconv"]["post"]["responses"]["200"]["content"]) == {NPY, SAFETENSORS}
            infer = spec["paths"]["/v2/models/{name}/infer"]["post"]["requestBody"]["content"]
            assert set(infer) == {"application/json", "application/octet-stream"}
            assert infer["application/octet-stream"]["schema"] == {"type": "string", "format": "binary"}
            request = infer["application/json"]["schema"]["$ref"].removeprefix("#/components/schemas/")
            assert "inputs" in spec["components"]["schemas"][request]["properties"]
            for path in ("/v1/layers", "/v1/layers/{name}", "/health/live", "/health/ready", "/metrics", "/v2",
                         "/v2/health/live", "/v2/health/ready", "/v2/models/{name}", "/v2/models/{name}/ready"):
                assert path in spec["paths"], path
            assert (await client.get("/docs")).status_code == 200

    run(main())


# --- KServe v2 ----------------------------------------------------------------------------------------------------


def test_openapi_generates_the_inference_operations_from_their_models(repo):
    # The inference routes have no FastAPI route; their operations come from the route table's pydantic models.
    def unref(schema: dict[str, Any]) -> str:
        return schema["$ref"].removeprefix("#/components/schemas/")

    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            spec = (await client.get("/openapi.json")).json()
            x = np.zeros((1, 4, 5, 5), np.float32)
            body, headers = _kserve_binary(x, parameters={"binary_data_output": True})
            answers = [(await client.post("/v2/models/small/infer", json=_kserve_json(x))).json(),
                       _split_binary(await client.post("/v2/models/small/infer", content=body, headers=headers))[0]]
        schemas = spec["components"]["schemas"]

        def component(model: type[BaseModel], mode: JsonSchemaMode = "validation") -> None:
            # The model's schema and those of the models it holds are the document's components, as pydantic
            # writes them.
            schema = model.model_json_schema(ref_template=REF_TEMPLATE, mode=mode)
            for name, definition in {**schema.pop("$defs", {}), model.__name__: schema}.items():
                assert schemas[name] == definition, name

        binary = {"schema": {"type": "string", "format": "binary"}}
        errors = {"400", "401", "404", "413", "415", "422", "429", "500", "503", "504"}
        header = DeadlineHeader.model_json_schema(by_alias=True)["properties"]["x-deadline-ms"]
        deadline = {"name": "x-deadline-ms", "in": "header", "required": False, "schema": header,
                    "description": header["description"]}
        expected = {
            "/deconv": ([{"name": "layer", "in": "query", "required": True,
                          "schema": LayerQuery.model_json_schema()["properties"]["layer"],
                          "description": "Layer name (see GET /v1/layers)."}, deadline], ErrorBody),
            "/v2/models/{name}/infer": ([{"name": "name", "in": "path", "required": True,
                                          "schema": ModelPath.model_json_schema()["properties"]["name"],
                                          "description": "Layer name (see GET /v1/layers)."}, deadline], KServeError),
            "/v2/models/{name}/versions/{version}/infer": (
                [{"name": n, "in": "path", "required": True, "schema": f, "description": f["description"]}
                 for n, f in VersionedModelPath.model_json_schema()["properties"].items()] + [deadline], KServeError),
        }
        ids = []
        for path, (parameters, error) in expected.items():
            assert set(spec["paths"][path]) == {"post"}, path
            op = spec["paths"][path]["post"]
            ids.append(op["operationId"])
            assert op["tags"], path
            assert op["summary"], path
            assert op["parameters"] == parameters, path
            assert op["requestBody"]["required"] is True
            assert set(op["responses"]) == {"200", *errors}, path
            for code in errors:
                assert op["responses"][code]["content"] == {"application/json": {"schema": {
                    "$ref": f"#/components/schemas/{error.__name__}"}}}, (path, code)
            component(error, "serialization")
            if path == "/deconv":
                assert op["requestBody"]["content"] == {NPY: binary, SAFETENSORS: binary}
                assert op["responses"]["200"]["content"] == {NPY: binary, SAFETENSORS: binary}
            else:
                body, answer = op["requestBody"]["content"], op["responses"]["200"]["content"]
                assert unref(body["application/json"]["schema"]) == "KServeInferRequest"
                assert unref(answer["application/json"]["schema"]) == "KServeInferResponse"
                assert body["application/octet-stream"] == answer["application/octet-stream"] == binary
        assert len(set(ids)) == 3
        component(KServeInferRequest)
        component(KServeInferResponse, "serialization")
        for answer in answers:  # the documented response is what the server answers, JSON or binary
            assert KServeInferResponse.model_validate(answer).outputs[0].shape == [1, 6, 10, 10]

    run(main())


def _kserve_json(x: np.ndarray, datatype: str = "FP32", **extra: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": datatype,
                        "data": x.reshape(-1).tolist()}], **extra}


def _kserve_binary(x: np.ndarray | torch.Tensor, datatype: str = "FP32",
                   **extra: Any) -> tuple[bytes, dict[str, str]]:
    # bfloat16 has no numpy dtype: send its 16-bit patterns
    raw = x.tobytes() if isinstance(x, np.ndarray) else x.contiguous().view(torch.int16).numpy().tobytes()
    head = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": datatype,
                                   "parameters": {"binary_data_size": len(raw)}}], **extra}).encode()
    return head + raw, {"inference-header-content-length": str(len(head)), "content-type": "application/octet-stream"}


def _split_binary(r) -> tuple[dict[str, Any], bytes]:
    n = int(r.headers["inference-header-content-length"])
    return json.loads(r.content[:n]), r.content[n:]


def test_kserve_metadata_and_health(repo):
    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            meta = (await client.get("/v2")).json()
            assert meta["name"] == "deconv"
            assert "binary_tensor_data" in meta["extensions"]
            assert (await client.get("/v2/health/live")).status_code == 200
            assert (await client.get("/v2/health/ready")).status_code == 200
            m = (await client.get("/v2/models/bf")).json()
            assert m["inputs"] == [{"name": "input", "datatype": "BF16", "shape": [-1, 4, -1, -1]}]
            assert m["outputs"] == [{"name": "output", "datatype": "BF16", "shape": [-1, 6, -1, -1]}]
            assert (await client.get("/v2/models/bf/versions/1")).status_code == 200
            assert (await client.get("/v2/models/small/ready")).json()["ready"] is True
            assert (await client.get("/v2/models/small/versions/1/ready")).status_code == 200
            r = await client.get("/v2/models/nope")
            assert r.status_code == 404
            assert r.json() == {"error": "no layer named 'nope'; GET /v1/layers lists them", "type": "unknown_layer"}
            assert (await client.get("/v2/models/small/versions/2")).status_code == 404

    run(main())


def test_kserve_json_and_binary_infer(repo):
    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            x = np.random.default_rng(1).standard_normal((2, 4, 5, 6)).astype(np.float32)
            ref = reference(repo["modules"]["small"], torch.from_numpy(x))

            r = await client.post("/v2/models/small/infer", json=_kserve_json(x, id="req-1"))
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["id"] == "req-1"
            assert out["model_name"] == "small"
            (o,) = out["outputs"]
            assert (o["name"], o["datatype"], o["shape"]) == ("output", "FP32", [2, 6, 10, 12])
            assert rel_err(np.array(o["data"]).reshape(o["shape"]), ref) < 1e-5

            nested = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                  "data": x.tolist()}]}
            r = await client.post("/v2/models/small/versions/1/infer", json=nested)
            assert rel_err(np.array(r.json()["outputs"][0]["data"]).reshape(2, 6, 10, 12), ref) < 1e-5

            body, headers = _kserve_binary(x, outputs=[{"name": "output", "parameters": {"binary_data": True}}])
            r = await client.post("/v2/models/small/infer", content=body, headers=headers)
            assert r.status_code == 200, r.text
            head, raw = _split_binary(r)
            assert head["outputs"][0]["parameters"]["binary_data_size"] == len(raw)
            assert rel_err(np.frombuffer(raw, np.float32).reshape(2, 6, 10, 12), ref) < 1e-5

            body, headers = _kserve_binary(x, parameters={"binary_data_output": True})
            r = await client.post("/v2/models/small/infer", content=gzip.compress(body),
                                  headers={**headers, "content-encoding": "gzip"})
            assert r.status_code == 200, r.text
            _, raw = _split_binary(r)
            assert rel_err(np.frombuffer(raw, np.float32).reshape(2, 6, 10, 12), ref) < 1e-5

            xb = torch.from_numpy(x).to(torch.bfloat16)
            body, headers = _kserve_binary(xb, "BF16", parameters={"binary_data_output": True})
            r = await client.post("/v2/models/bf/infer", content=body, headers=headers)
            assert r.status_code == 200, r.text
            head, raw = _split_binary(r)
            assert head["outputs"][0]["datatype"] == "BF16"
            yb = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).view(2, 6, 10, 12)
            assert rel_err(yb, reference(repo["modules"]["bf"].bfloat16().double(), xb)) < 2e-2

    run(main())


def test_kserve_errors(repo):
    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            x = np.zeros((1, 4, 5, 5), np.float32)

            async def err(status: int, type_: str, **kw: Any) -> None:
                r = await client.post(kw.pop("path", "/v2/models/small/infer"), **kw)
                assert r.status_code == status, r.text
                assert r.json()["type"] == type_
                assert isinstance(r.json()["error"], str)

            await err(404, "unknown_layer", path="/v2/models/nope/infer", json=_kserve_json(x))
            await err(404, "unknown_layer", path="/v2/models/small/versions/7/infer", json=_kserve_json(x))
            await err(400, "malformed_body", content=b"{not json")
            await err(400, "malformed_body", json={"inputs": []})
            await err(422, "invalid_input", json={"inputs": [{**_kserve_json(x)["inputs"][0], "name": "x"}]})
            await err(422, "invalid_input", json=_kserve_json(x, "INT32"))
            await err(422, "invalid_input", json=_kserve_json(x, "FP64"))  # the layer takes FP32
            await err(422, "invalid_input", json=_kserve_json(np.zeros((1, 3, 5, 5), np.float32)))
            await err(422, "invalid_input", json=_kserve_json(x, outputs=[{"name": "y"}]))
            bad = _kserve_json(x)
            bad["inputs"][0]["data"] = bad["inputs"][0]["data"][:-1]
            await err(400, "malformed_body", json=bad)
            bad["inputs"][0]["data"] = ["a"] * 100
            await err(400, "malformed_body", json=bad)
            body, headers = _kserve_binary(x)
            await err(400, "malformed_body", content=body[:-4], headers=headers)  # binary shorter than declared
            too_long = {**headers, "inference-header-content-length": "9999"}
            await err(400, "malformed_body", content=body, headers=too_long)
            await err(415, "unsupported_media_type", content=body, headers={**headers, "content-encoding": "br"})
            await err(413, "payload_too_large", json=_kserve_json(np.zeros((5, 4, 5, 5), np.float32)))

    run(main())


# --- the app's own dispatch of the inference routes ------------------------------------------------------------


def _dispatch_cases() -> list[tuple[str, dict[str, Any]]]:
    x = np.random.default_rng(3).standard_normal((2, 4, 5, 6)).astype(np.float32)
    ok, npy = npy_bytes(x), {"content-type": NPY}
    body, binary = _kserve_binary(x)
    return [
        ("/deconv?layer=small", {"content": ok, "headers": npy}),
        ("/deconv?layer=small&layer=nope", {"content": ok, "headers": npy}),  # the last value counts
        ("/deconv?layer=small", {"content": ok, "headers": {**npy, "accept": SAFETENSORS}}),
        ("/deconv?layer=nope", {"content": ok, "headers": npy}),
        ("/deconv", {"content": ok, "headers": npy}),
        ("/deconv?layer=small", {"content": ok}),
        ("/deconv?layer=small", {"content": ok, "headers": {**npy, "content-encoding": "gzip"}}),
        ("/deconv?layer=small", {"content": b"\x93NUMPY", "headers": npy}),
        ("/deconv?layer=small", {"content": npy_bytes(x[:, :3]), "headers": npy}),
        ("/deconv?layer=small", {"content": npy_bytes(np.zeros((5, 4, 5, 5), np.float32)), "headers": npy}),
        ("/deconv?layer=small", {"content": ok, "headers": {**npy, "x-deadline-ms": "soon"}}),
        ("/deconv?layer=small", {"content": ok, "headers": {**npy, "x-deadline-ms": "0"}}),
        ("/deconv?layer=small", {"content": ok, "headers": {**npy, "content-length": "12x"}}),
        ("/deconv?layer=bf", {"content": ok, "headers": npy}),
        ("/v2/models/small/infer", {"content": body, "headers": binary}),
        ("/v2/models/small/versions/1/infer", {"json": _kserve_json(x)}),
        ("/v2/models/small/versions/2/infer", {"json": _kserve_json(x)}),
        ("/v2/models/nope/infer", {"json": _kserve_json(x)}),
        ("/v2/models/small/infer", {"content": b"{not json"}),
        ("/v2/models/small/infer", {"content": body, "headers": {**binary, "content-encoding": "br"}}),
        ("/v2/models/small/infer/", {"json": _kserve_json(x)}),  # not an inference route: FastAPI redirects
        ("/v2/models//infer", {"json": _kserve_json(x)}),
    ]


def test_the_app_answers_every_inference_case_in_the_routes_error_shape(repo):
    # App answers the inference routes straight from ASGI: each case gets its status, and an error is the JSON body
    # every other route writes (FastAPI's JSONResponse of service.errors.error_body), in the route's shape.
    async def main() -> list[tuple[str, httpx.Response]]:
        async with serve_app(settings(repo, max_body_bytes=20_000)) as (_, client):
            return [(path, await client.post(path, **kw)) for path, kw in _dispatch_cases()]

    answers = run(main())
    assert [r.status_code for _, r in answers] == [200, 404, 200, 404, 422, 415, 415, 400, 422, 413, 422, 504, 400,
                                                   422, 200, 200, 404, 404, 400, 415, 307, 404]
    for path, r in answers:
        if r.status_code == 307:  # not an inference route: the router redirects it to the one without the slash
            assert r.headers["location"] == f"http://test{path.rstrip('/')}"
        elif r.status_code >= 400:
            assert r.headers["content-type"] == "application/json"
            assert r.content == JSONResponse(r.json()).body
            model = KServeError if path.startswith("/v2/") else ErrorBody
            model.model_validate(r.json())
            assert set(r.json()) == set(model.model_fields)


def test_other_methods_on_the_inference_paths_answer_405(repo):
    # No FastAPI route serves these paths: the app answers their POSTs and the router every other method, as it
    # answers a route's other methods (405, Allow: POST, the error shape), and redirects a trailing slash.
    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            native, kserve = (await client.put("/v1/layers")).content, (await client.post("/v2/health/live")).content
            for path in ("/deconv?layer=small", "/v2/models/small/infer", "/v2/models/small/versions/1/infer"):
                for method in ("GET", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS"):
                    r = await client.request(method, path)
                    assert (r.status_code, r.headers["allow"]) == (405, "POST"), (method, path)
                    assert r.headers["content-type"] == "application/json"
                    assert r.content == (b"" if method == "HEAD" else kserve if path.startswith("/v2/") else native)
                bare = path.partition("?")[0]
                for method in ("GET", "POST"):
                    r = await client.request(method, bare + "/")
                    assert (r.status_code, r.headers["location"]) == (307, f"http://test{bare}")
            assert_error(await client.get("/deconv?layer=small"), 405, "method_not_allowed")
            assert (await client.get("/v2/models/small/infer")).json()["type"] == "method_not_allowed"

    run(main())


def test_unexpected_error_on_an_inference_route_is_a_bare_500(repo, monkeypatch, caplog):
    def broken(*_: Any) -> Any:
        raise RuntimeError("secret detail at /srv/deconv/service/http/routes.py")

    monkeypatch.setattr("service.http.native_routes.validate_input", broken)
    monkeypatch.setattr("service.http.kserve_routes.validate_input", broken)

    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            for path, kw in (("/deconv?layer=small", {"content": npy_bytes(np.zeros((1, 4, 5, 5), np.float32)),
                                                      "headers": {"content-type": NPY}}),
                             ("/v2/models/small/infer", {"json": _kserve_json(np.zeros((1, 4, 5, 5), np.float32))})):
                r = await client.post(path, **kw)
                assert r.status_code == 500
                assert r.headers["content-type"] == "application/json"
                assert "secret" not in r.text
                assert "Traceback" not in r.text
            assert r.json() == {"error": "internal server error", "type": "internal"}
            text = (await client.get("/metrics")).text
            assert metric_value(text, "deconv_requests_total", layer="small", api="native", status="500") == 1
            assert metric_value(text, "deconv_requests_total", layer="small", api="kserve", status="500") == 1

    run(main())
    logged = [rec for rec in caplog.records if rec.getMessage().startswith("unhandled error on POST")]
    assert len(logged) == 2
    assert "secret detail" in str(logged[0].exc_info[1])


def test_every_number_a_client_sends_is_range_checked(repo):
    # A 400-digit KServe timeout was an OverflowError (500) in the timeout's conversion.
    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            x = np.zeros((1, 4, 5, 5), np.float32)
            for timeout in (10**400, -1, 1e308 * 10, "100", True, [1]):
                body = json.dumps({**_kserve_json(x), "parameters": {"timeout": timeout}})
                r = await client.post("/v2/models/small/infer", content=body)
                assert r.status_code == 422, (timeout, r.text)
                assert "parameters.timeout" in r.json()["error"]
            for timeout in (0, 10**6, 2.5e6):
                r = await client.post("/v2/models/small/infer", json={**_kserve_json(x), "parameters": {
                    "timeout": timeout}})
                assert r.status_code == 200, (timeout, r.text)
            for deadline in ("1e400", "inf", "-1", "nan", "1" * 400):
                r = await client.post("/deconv?layer=small", content=npy_bytes(x),
                                      headers={"content-type": NPY, "x-deadline-ms": deadline})
                assert r.status_code == 422, (deadline, r.text)
            for dims in ([10**400, 4, 5, 5], [1, 4, 5, 10**30]):
                spec = {**_kserve_json(x)["inputs"][0], "shape": dims}
                r = await client.post("/v2/models/small/infer", content=json.dumps({"inputs": [spec]}))
                assert r.status_code in (400, 413, 422), (dims, r.text)
            spec = {**_kserve_json(x)["inputs"][0], "data": None, "parameters": {"binary_data_size": 10**400}}
            r = await client.post("/v2/models/small/infer", content=json.dumps({"inputs": [spec]}))
            assert r.status_code == 400, r.text
            metrics = (await client.get("/metrics")).text
            assert metric_value(metrics, "deconv_requests_total", layer="small", api="kserve", status="500") == 0

    run(main())


@pytest.mark.parametrize("value", [None, "1.5", True, False, [1.0], 10**400])
def test_kserve_json_data_takes_only_numbers(repo, value):
    # numpy read null as NaN, "1.5" as 1.5 and true as 1: the request was computed on values the client never sent.
    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            request = _kserve_json(np.zeros((1, 4, 5, 5), np.float32))
            for data in (request["inputs"][0]["data"], np.zeros((1, 4, 5, 5)).tolist()):  # flat and nested
                flat = isinstance(data[0], float)
                data = list(data)
                if flat:
                    data[7] = value
                else:
                    data[0][3][2][1] = value
                spec = {**request["inputs"][0], "data": data}
                r = await client.post("/v2/models/small/infer", content=json.dumps({"inputs": [spec]}))
                assert r.status_code == 400, r.text
                assert r.json()["type"] == "malformed_body"

    run(main())


def test_json_answers_are_encoded_a_slice_at_a_time(monkeypatch):
    # A large JSON answer used to be encoded in one go, holding the event loop for as long as it took.
    from service.http import kserve_routes as routes

    monkeypatch.setattr(routes, "JSON_VALUES_PER_STEP", 1000)
    y = torch.tensor(np.random.default_rng(0).standard_normal((2, 3, 40, 50)), dtype=torch.float32)
    y.view(-1)[[5, 1500]] = torch.tensor([float("nan"), float("inf")])
    response = {"model_name": "m", "model_version": "1", "outputs": [{"name": "output", "datatype": "FP32",
                                                                       "shape": list(y.shape)}], "id": 'a"data":[]'}
    expected = dict(response, outputs=[dict(response["outputs"][0], data=y.double().reshape(-1).tolist())])

    async def main() -> tuple[bytes, int]:
        turns = 0
        stop = False

        async def other() -> None:  # another connection's work: counts the loop's turns while encoding
            nonlocal turns
            while not stop:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(other())
        await asyncio.sleep(0)
        before = turns
        out = await routes._json_answer(response, response["outputs"][0], y)
        stop = True
        await task
        return out, turns - before

    out, turns = run(main())
    assert out == json.dumps(expected, separators=(",", ":")).encode()  # the same bytes as before
    assert turns >= y.numel() // 1000 - 1  # the loop ran between every two slices


def test_a_large_kserve_json_input_is_parsed_off_the_event_loop_and_counted_in_the_budget(repo, monkeypatch):
    # A large JSON input used to be parsed on the event loop (seconds for tens of MB, every other connection
    # waiting) and its Python objects, many times the body's size, were counted nowhere.
    import threading

    from service.http import kserve_routes as routes

    monkeypatch.setattr(routes, "JSON_INLINE_BYTES", 1000)
    parsed_on: list[threading.Thread] = []
    real = routes._parse_kserve

    def recording(body, header_length):
        parsed_on.append(threading.current_thread())
        return real(body, header_length)

    monkeypatch.setattr(routes, "_parse_kserve", recording)
    x = np.random.default_rng(0).standard_normal((2, 4, 5, 5)).astype(np.float32)
    small = json.dumps(_kserve_json(x[:1, :, :2, :2])).encode()
    large = json.dumps(_kserve_json(x)).encode()
    assert len(small) <= 1000 < len(large)

    async def main() -> None:
        # Room for the large request's parsed size and its output, not for the parsed size of two of them.
        budget = routes.PARSED_BYTES_PER_JSON_BYTE * len(large) + 2**16
        async with serve_app(settings(repo, max_inflight_bytes=budget)) as (app, client):
            inflight = app.state.budget
            loop_thread = threading.current_thread()
            r = await client.post("/v2/models/small/infer", content=small)
            assert r.status_code == 200, r.text
            assert parsed_on == [loop_thread]  # a small one on the loop, as before
            r = await client.post("/v2/models/small/infer", content=large)
            assert r.status_code == 200, r.text
            assert len(parsed_on) == 2
            assert parsed_on[1] is not loop_thread  # the large one in a thread
            assert inflight.used == 0  # everything given back
            inflight.take(budget // 2)  # another request holds half the budget: the parse does not fit
            r = await client.post("/v2/models/small/infer", content=large)
            assert (r.status_code, r.json()["type"]) == (429, "overloaded"), r.text
            assert "retry-after" in r.headers
            assert len(parsed_on) == 2  # refused before parsing
            inflight.give(budget // 2)

    run(main())


# --- the layers as KServe / Triton models (service.engine.kserve) ------------------------------------------


def test_model_configuration_index_and_statistics_are_built_from_the_layer_and_the_metrics(repo):
    from service.engine import kserve

    async def main() -> None:
        async with serve_app(settings(repo)) as (app, client):
            engine = app.state.engine
            small = engine.registry.get("small")
            config = kserve.model_config(engine, small)
            assert (config["name"], config["backend"], config["max_batch_size"]) == ("small", "deconv", 4)
            assert config["input"][0]["data_type"] == "TYPE_FP32"
            assert config["input"][0]["dims"] == [4, -1, -1]
            assert config["output"][0]["dims"] == [6, -1, -1]
            assert config["dynamic_batching"]["default_queue_policy"]["max_queue_size"] == 256
            assert config["instance_group"][0]["kind"] == "KIND_CPU"
            assert config["parameters"]["stride"] == {"string_value": "[2, 2]"}
            slow = kserve.model_config(engine, engine.registry.get("slow"))["dynamic_batching"]
            assert slow["max_queue_delay_microseconds"] == 600_000_000
            assert kserve.model_config(engine, engine.registry.get("bf"))["output"][0]["data_type"] == "TYPE_BF16"
            assert kserve.repository_index(engine) == [
                {"name": n, "version": "1", "state": "READY", "reason": ""} for n in ("bf", "half", "slow", "small")]

            for n in (1, 2, 3):
                r = await post_npy(client, "small", np.ones((n, 4, 5, 5), np.float32))
                assert r.status_code == 200
            assert (await post_npy(client, "small", np.ones((1, 3, 5, 5), np.float32))).status_code == 422
            stats = kserve.model_statistics(engine, "small")["model_stats"]
            assert [s["name"] for s in stats] == ["small"]
            s = stats[0]
            inf = s["inference_stats"]
            assert (inf["success"]["count"], inf["fail"]["count"], inf["queue"]["count"]) == (3, 1, 3)
            assert inf["success"]["ns"] > inf["queue"]["ns"] > 0
            assert inf["fail"]["ns"] > 0
            assert (s["inference_count"], s["execution_count"]) == (6, 3)  # sequential requests: a batch each
            assert inf["compute_infer"]["count"] == 3
            assert inf["compute_infer"]["ns"] == sum(b["compute_infer"]["ns"] for b in s["batch_stats"])
            assert [(b["batch_size"], b["compute_infer"]["count"]) for b in s["batch_stats"]] == [(1, 1), (2, 1),
                                                                                                  (3, 1)]
            assert s["last_inference"] > 0
            text = (await client.get("/metrics")).text
            assert inf["success"]["ns"] == round(
                1e9 * metric_value(text, "deconv_request_latency_seconds_sum", layer="small"))
            assert s["execution_count"] == metric_value(text, "deconv_batch_seconds_count", layer="small")
            every = kserve.model_statistics(engine)["model_stats"]
            assert [m["name"] for m in every] == ["bf", "half", "slow", "small"]
            assert every[0]["inference_stats"]["success"] == {"count": 0, "ns": 0}
            with pytest.raises(kserve.UnknownLayerError):
                kserve.model_statistics(engine, "small", "2")
            with pytest.raises(kserve.UnknownLayerError):
                kserve.model_statistics(engine, "nope")

    run(main())


def test_model_configuration_index_and_statistics_routes(repo):
    async def main() -> None:
        async with serve_app(settings(repo)) as (_, client):
            extensions = (await client.get("/v2")).json()["extensions"]
            assert {"model_configuration", "model_repository", "statistics"} <= set(extensions)
            config = (await client.get("/v2/models/half/config")).json()
            assert (config["name"], config["max_batch_size"]) == ("half", 4)
            assert config["input"][0] == {"name": "input", "data_type": "TYPE_FP16", "format": "FORMAT_NCHW",
                                          "dims": [4, -1, -1], "is_shape_tensor": False,
                                          "allow_ragged_batch": False, "optional": False}
            assert (await client.get("/v2/models/half/versions/1/config")).json() == config
            r = await client.get("/v2/models/half/versions/2/config")
            assert (r.status_code, r.json()["type"]) == (404, "unknown_layer")
            assert (await client.get("/v2/models/nope/config")).status_code == 404

            index = [{"name": n, "version": "1", "state": "READY", "reason": ""} for n in ("bf", "half", "slow",
                                                                                          "small")]
            for body in (b"", b"{}", b'{"ready": true}', b'{"ready": false}'):
                r = await client.post("/v2/repository/index", content=body)
                assert (r.status_code, r.json()) == (200, index), body
            for bad in (b"[", b"[]", b'{"ready": 1}'):
                r = await client.post("/v2/repository/index", content=bad)
                assert (r.status_code, r.json()["type"]) == (400, "malformed_body"), bad
            r = await client.post("/v2/repository/index", content=b" " * 5000)
            assert (r.status_code, r.json()["type"]) == (413, "payload_too_large")

            assert (await post_npy(client, "small", np.ones((2, 4, 5, 5), np.float32))).status_code == 200
            one = (await client.get("/v2/models/small/stats")).json()["model_stats"]
            assert [s["name"] for s in one] == ["small"]
            assert one[0]["inference_stats"]["success"]["count"] == 1
            assert one[0]["inference_count"] == 2
            assert (await client.get("/v2/models/small/versions/1/stats")).json()["model_stats"][0]["name"] == "small"
            every = (await client.get("/v2/models/stats")).json()["model_stats"]
            assert [s["name"] for s in every] == ["bf", "half", "slow", "small"]
            for path in ("/v2/models/nope/stats", "/v2/models/small/versions/3/stats"):
                r = await client.get(path)
                assert (r.status_code, r.json()["type"]) == (404, "unknown_layer"), path

    run(main())


def test_the_index_says_why_the_models_are_not_ready(repo, monkeypatch):
    from service.engine import kserve

    async def main() -> None:
        async with serve_app(settings(repo)) as (app, client):
            engine = app.state.engine
            engine.readiness.set("failed", "self-test of layer 'small' failed")
            r = await client.post("/v2/repository/index", content=b"")
            assert r.json()[0] == {"name": "bf", "version": "1", "state": "UNAVAILABLE",
                                   "reason": "self-test of layer 'small' failed"}
            assert (await client.post("/v2/repository/index", json={"ready": True})).json() == []
            engine.begin_drain()
            assert kserve.repository_index(engine)[0]["state"] == "UNLOADING"

    run(main())


# --- tritonclient against a live CPU server, one and two HTTP processes -------------------------------------


@pytest.mark.parametrize("processes", ["1", "2"])
def test_tritonclient_reads_the_configuration_index_and_statistics(tmp_path, server_factory, processes):
    """tritonclient.http's get_model_config, get_model_repository_index and get_inference_statistics against a live
    server: the values of the layer, and counts that equal the requests sent and agree with /metrics (in a
    multi-process server whichever HTTP process answers)."""
    import tritonclient.http as triton

    module = write_layer(tmp_path, "fast", in_channels=4, out_channels=6, kernel_size=4, stride=2, padding=1,
                         limits={"max_batch_size": 8, "max_queue_delay_ms": 2.5})
    proc = server_factory({"DECONV_LAYER_REPOSITORY": str(tmp_path), "DECONV_HTTP_PROCESSES": processes})
    if processes == "2":  # every HTTP process serving, so that the clients below reach both
        deadline = time.monotonic() + 60
        while "HTTP processes serving: 2 of 2" not in proc.log():
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.05)
    url = proc.url.removeprefix("http://")

    def client() -> Any:  # a new connection each: a multi-process server hands connections out in turn
        return triton.InferenceServerClient(url, network_timeout=30.0)

    c = client()
    try:
        config = c.get_model_config("fast")
        assert (config["name"], config["max_batch_size"]) == ("fast", 8)
        assert config["input"][0]["dims"] == [4, -1, -1]
        assert config["output"][0]["dims"] == [6, -1, -1]
        assert config["input"][0]["data_type"] == config["output"][0]["data_type"] == "TYPE_FP32"
        assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2500
        assert c.get_model_config("fast", "1") == config
        assert c.get_model_repository_index() == [{"name": "fast", "version": "1", "state": "READY", "reason": ""}]
        with pytest.raises(triton.InferenceServerException, match="no layer named 'nope'"):
            c.get_model_config("nope")
    finally:
        c.close()

    sent = 6
    for i in range(sent):
        c = client()
        try:
            x = np.random.default_rng(i).standard_normal((i % 3 + 1, 4, 5, 5)).astype(np.float32)
            inp = triton.InferInput("input", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            y = c.infer("fast", [inp], outputs=[triton.InferRequestedOutput("output", binary_data=True)])
            assert rel_err(y.as_numpy("output"), reference(module, torch.from_numpy(x))) < 1e-5
        finally:
            c.close()
    c = client()
    try:
        bad = triton.InferInput("input", [1, 3, 5, 5], "FP32")
        bad.set_data_from_numpy(np.ones((1, 3, 5, 5), np.float32), binary_data=True)
        with pytest.raises(triton.InferenceServerException, match="3 channels"):
            c.infer("fast", [bad])
    finally:
        c.close()

    text = httpx.get(f"{proc.url}/metrics", timeout=10).text
    for _ in range(int(processes)):  # each HTTP process in turn (a connection each) reports the same totals
        c = client()
        try:
            stats = c.get_inference_statistics("fast")["model_stats"]
            assert c.get_inference_statistics()["model_stats"][0]["name"] == "fast"
        finally:
            c.close()
        assert [s["name"] for s in stats] == ["fast"]
        s = stats[0]
        inf = s["inference_stats"]
        assert inf["success"]["count"] == sent == metric_value(text, "deconv_requests_total", layer="fast",
                                                               api="kserve", status="200")
        assert inf["fail"]["count"] == 1 == metric_value(text, "deconv_requests_total", layer="fast", api="kserve",
                                                         status="422")
        assert inf["queue"]["count"] == sent == metric_value(text, "deconv_queue_time_seconds_count", layer="fast")
        assert inf["compute_infer"]["count"] == sent
        assert s["inference_count"] == 12 == metric_value(text, "deconv_batch_size_sum", layer="fast")
        assert s["execution_count"] == metric_value(text, "deconv_batch_seconds_count", layer="fast")
        assert sum(b["compute_infer"]["count"] for b in s["batch_stats"]) == s["execution_count"]
        for key, metric in (("success", "deconv_request_latency_seconds_sum"),
                            ("queue", "deconv_queue_time_seconds_sum"),
                            ("fail", "deconv_failed_request_seconds_total")):
            assert abs(inf[key]["ns"] - 1e9 * metric_value(text, metric, layer="fast")) < 1e3, key
        assert abs(sum(b["compute_infer"]["ns"] for b in s["batch_stats"])
                   - 1e9 * metric_value(text, "deconv_batch_seconds_sum", layer="fast")) < 1e3
        assert s["last_inference"] > 0


def test_the_protocol_page_lists_every_route_and_extension(repo):
    """docs/protocol.md's route table names every operation of the app and every extension GET /v2 can list."""
    doc = (REPO_ROOT / "docs" / "protocol.md").read_text()
    table = doc[doc.index("## Routes"):doc.index("## `POST /deconv`")]
    app = create_app(settings(repo))
    routes = [f"`{method.upper()} {path}`" for path, item in app.openapi()["paths"].items() for method in item]
    routes += [f"`GET {app.openapi_url}`", f"`GET {app.docs_url}`", f"`GET {app.redoc_url}`"]
    assert len(routes) > 30
    assert [r for r in routes if r not in table] == []
    assert sorted(set(re.findall(r"`((?:GET|POST) [^`]+)`", table))) == sorted(r.strip("`") for r in routes)
    for extension in ("binary_tensor_data", "model_configuration", "model_repository", "statistics",
                      "system_shared_memory", "cuda_shared_memory"):
        assert f"`{extension}`" in table, extension
