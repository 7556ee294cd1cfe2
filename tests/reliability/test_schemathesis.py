"""schemathesis against the service's own OpenAPI document, every route, on a real server: no 5xx (a 504 for a
request whose own deadline passed is an answer, not a failure), no internals.

The cases are spread over the operations so that at least ``DECONV_FUZZ_EXAMPLES`` run in all.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import settings

from bench.serving.reliability.server import Server
from service import codec
from service.config import Settings
from service.http.app import create_app

from .conftest import FUZZ_EXAMPLES, count_case, leaks_internals, server_error
from .strategies import npy_bodies, safetensors_bodies

pytestmark = pytest.mark.slow

DOCUMENT = create_app(Settings()).openapi()
OPERATIONS = sum(len(item) for item in DOCUMENT["paths"].values())
# Operations without parameters run out of distinct cases early, so the others get twice their share.
PER_OPERATION = math.ceil(2 * FUZZ_EXAMPLES / OPERATIONS)


@pytest.fixture(scope="module")
def live_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("schemathesis") / "server.log"
    server = Server.start({"DECONV_MAX_QUEUE_DELAY_MS": "0"}, log)
    try:
        yield server.url
    finally:
        assert server.stop() == 0
        assert "Traceback" not in server.log(), server.log()[-3000:]


# Tensor bodies: near-valid .npy and safetensors files (schemathesis has no generator for these media types).
schemathesis.openapi.media_type(codec.NPY, npy_bodies())
schemathesis.openapi.media_type(codec.SAFETENSORS, safetensors_bodies())
# The document the server publishes at /openapi.json (built the same way, without starting anything).
schema = schemathesis.openapi.from_dict(DOCUMENT)


def test_the_document_lists_every_route():
    paths = DOCUMENT["paths"]
    assert {"/deconv", "/v1/layers", "/v1/layers/{name}", "/health/live", "/health/ready", "/metrics", "/v2",
            "/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"} <= set(paths)
    assert OPERATIONS >= 15


@schema.parametrize()
@settings(max_examples=PER_OPERATION)
def test_every_route_answers_without_a_server_error(case, live_url):
    count_case("schemathesis")
    response = case.call(base_url=live_url, timeout=30)
    assert not server_error(response.status_code, response.text), (case.method, case.path, response.text[:300])
    if response.status_code >= 400:
        sent = [*(case.path_parameters or {}).values(), *(case.query or {}).values(), *(case.headers or {}).values()]
        assert not leaks_internals(response.text, sent), response.text[:300]


def test_an_echo_of_the_request_is_no_leak():
    # schemathesis once named a layer "Traceback"; the 404 quotes the name back.
    message = '{"error":{"type":"unknown_layer","message":"no layer named \'Traceback\'; GET /v1/layers lists them"}}'
    assert leaks_internals(message)
    assert not leaks_internals(message, ["Traceback"])
    quoted = '{"error":"no layer named \'File \\"x\'"}'  # the name File "x, escaped by repr and by JSON
    assert not leaks_internals(quoted, ['File "x'])
    assert leaks_internals(quoted + ' File "/srv/app.py", line 1', ['File "x'])
