"""Byte fuzzing of the decoders (.npy, safetensors, KServe v2) and of the inference routes over HTTP.

Bodies are built from near-valid structure (headers with odd fields, wrong lengths, truncations, flipped bytes),
so that the fuzzers get past the magic numbers into the code that trusts the header. Every decoder either returns
a tensor that its body really holds, or raises a ``ServiceError`` with a 4xx status; the server answers every
request below 500 without a traceback or a path of its own. ``DECONV_FUZZ_EXAMPLES`` sets the cases per fuzzer.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.serving.reliability.server import Server
from service import codec
from service.errors import ServiceError
from service.http import kserve_routes as routes
from service.http.bodies import decompress
from service.http.inference import timeout_ms

from .conftest import count_case, leaks_internals, server_error
from .strategies import kserve_bodies, npy_bodies, safetensors_bodies

pytestmark = pytest.mark.slow
settings.load_profile("deconv-fuzz")

LIMIT = 1 << 20  # the body limit the decoders are given here
CLIENT_STATUSES = {400, 413, 415, 422}
FLOAT_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}

def _outcome(fn: Any, *args: Any) -> Any:
    # The function's result, or the status of the ServiceError it raised (anything else fails the test).
    try:
        return fn(*args)
    except ServiceError as exc:
        return exc.status


def _check(decode: Any, body: bytes) -> None:
    t = _outcome(decode, bytearray(body))
    if isinstance(t, int):
        assert t in CLIENT_STATUSES
        return
    assert isinstance(t, torch.Tensor)
    assert t.dtype in FLOAT_DTYPES
    assert t.dim() <= 8
    assert t.numel() * t.element_size() <= len(body)  # the data was in the body, nothing was made up


# --- the decoders --------------------------------------------------------------------------------------------


@given(npy_bodies())
def test_npy_decoder_never_fails_but_with_a_4xx(body):
    count_case("npy")
    _check(lambda b: codec.decode(b, codec.NPY, LIMIT), body)


@given(safetensors_bodies())
def test_safetensors_decoder_never_fails_but_with_a_4xx(body):
    count_case("safetensors")
    _check(lambda b: codec.decode(b, codec.SAFETENSORS, LIMIT), body)


@given(kserve_bodies(), st.sampled_from([None, "identity", "gzip", "deflate", "br"]))
def test_kserve_decoder_never_fails_but_with_a_4xx(request_body, encoding):
    count_case("kserve")
    body, length = request_body
    if encoding == "gzip":
        body = gzip.compress(body)

    def decode() -> tuple[torch.Tensor, bytearray]:
        raw = asyncio.run(decompress(bytearray(body), encoding, LIMIT))
        req, binary = routes._parse_kserve(raw, length)
        x = routes._kserve_input(req, binary, LIMIT)
        routes._wants_binary(req)
        timeout_ms(req.get("parameters"))
        return x, raw

    out = _outcome(decode)
    if isinstance(out, int):
        assert out in CLIENT_STATUSES
        return
    x, raw = out
    assert x.dtype in FLOAT_DTYPES
    assert x.numel() <= len(raw)


def test_a_huge_claim_is_refused_with_413_before_any_allocation(monkeypatch):
    def no_view(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("a tensor was made for a refused header")

    monkeypatch.setattr(codec, "view_tensor", no_view)
    huge = "{'descr': '<f4', 'fortran_order': False, 'shape': (64, 16, 4096, 4096), }"
    raw = huge.encode() + b"\n"
    body = codec.NPY_MAGIC + b"\x01\x00" + struct.pack("<H", len(raw)) + raw + b"\0" * 64
    with pytest.raises(ServiceError) as info:
        codec.decode(bytearray(body), codec.NPY, LIMIT)
    assert info.value.status == 413
    head = json.dumps({"x": {"dtype": "F32", "shape": [2**20, 2**20], "data_offsets": [0, 2**42]}}).encode()
    with pytest.raises(ServiceError) as info:
        codec.decode(bytearray(struct.pack("<Q", len(head)) + head + b"\0" * 8), codec.SAFETENSORS, LIMIT)
    assert info.value.status == 413
    req = {"inputs": [{"name": "input", "shape": [0, 16, 10**18, 10**18], "datatype": "FP32",
                       "parameters": {"binary_data_size": 0}}]}
    with pytest.raises(ServiceError) as info:
        routes._kserve_input(req, memoryview(b""), LIMIT)
    assert info.value.status == 413


# --- the routes over HTTP ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    server = Server.start({"DECONV_MAX_BODY_BYTES": str(LIMIT), "DECONV_MAX_QUEUE_DELAY_MS": "0"}, log)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            yield client
    finally:
        assert server.stop() == 0
        assert "Traceback" not in server.log(), server.log()[-3000:]


bodies = st.one_of(npy_bodies(), safetensors_bodies(), kserve_bodies().map(lambda b: b[0]), st.binary(max_size=64))
media = st.sampled_from([codec.NPY, codec.SAFETENSORS, "application/json", "application/octet-stream", "text/plain",
                         "", "application/x-npy; charset=binary"])


@given(route=st.sampled_from(["/deconv?layer=demo", "/deconv?layer=demo_fp16", "/deconv?layer=dcgan_up2_bf16",
                              "/v2/models/demo/infer", "/v2/models/demo_fp16/versions/1/infer"]),
       body=bodies, content_type=media, accept=st.none() | media | st.just("*/*;q=0.1, image/png"),
       length=st.none() | st.sampled_from(["0", "-1", "x", "12"]), deadline=st.none() | st.sampled_from(
           ["0", "1e309", "-1", "nan", "5"]))
def test_routes_never_answer_5xx_nor_leak_internals(live, route, body, content_type, accept, length, deadline):
    count_case("http")
    headers = {"content-type": content_type}
    if accept is not None:
        headers["accept"] = accept
    if length is not None:
        headers["inference-header-content-length"] = length
    if deadline is not None:
        headers["x-deadline-ms"] = deadline
    r = live.post(route, content=body, headers=headers)
    assert not server_error(r.status_code, r.text), r.text[:300]
    assert r.status_code == 200 or not leaks_internals(r.text), r.text[:300]
