"""Client and AsyncClient against httpx.MockTransport: kinds and dtypes kept, headers, concurrency, layers."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from deconv_client import AsyncClient, Client, CodecError, InvalidInputError, LayerInfo, Retry
from deconv_client.codec import decode_npy, decode_safetensors, encode_safetensors_array

from .conftest import MakeClient, Mirror, error_response, npy_response

LAYER = {
    "name": "up1", "in_channels": 3, "out_channels": 2, "kernel_size": [4, 4], "stride": [2, 2],
    "padding": [1, 1], "output_padding": [0, 0], "dilation": [1, 1], "groups": 1, "bias": True,
    "dtype": "float32", "precision": "tf32", "max_batch_size": 64, "max_batch_bytes": 268435456,
    "max_queue_delay_ms": 2.0, "max_queue_size": 256, "max_height": 1024, "max_width": 1024,
    "input_shape": [-1, 3, -1, -1], "output_size": "H_out = (H - 1) * 2 - 2 * 1 + 1 * (4 - 1) + 0 + 1",
    "something_new": 1,
}  # fmt: skip


def fake_layer(x: np.ndarray) -> np.ndarray:
    """A stand-in for the server's layer: keeps the batch, makes 2 channels of twice the size."""
    y = np.repeat(np.repeat(x[..., :2, :, :] * 2, 2, axis=-2), 2, axis=-1)
    return np.ascontiguousarray(y)


class Echo:
    """A fake server: runs fake_layer on the body, answers in the Accept format; records requests."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path.endswith("/v1/layers"):
            return httpx.Response(200, json={"layers": [LAYER, {**LAYER, "name": "up2", "stride": 1}]})
        if path.endswith("/v1/layers/up1"):
            return httpx.Response(200, json=LAYER)
        if "/v1/layers/" in path:
            return error_response(404, "unknown_layer", "no layer")
        body = request.read()
        ctype = request.headers["content-type"]
        if ctype == "application/x-npy":
            x = decode_npy(body)
        else:
            tensor = decode_safetensors(body)
            if tensor.dtype == "BF16":
                t = torch.frombuffer(bytearray(tensor.data), dtype=torch.bfloat16).reshape(tensor.shape)
                y = torch.from_numpy(fake_layer(t.float().numpy())).to(torch.bfloat16)
                raw = memoryview(y.reshape(-1).view(torch.uint8).numpy())
                from deconv_client.codec import RawTensor, encode_safetensors

                out = encode_safetensors(RawTensor("BF16", tuple(y.shape), raw, "output")).tobytes()
                return httpx.Response(200, content=out, headers={"content-type": ctype})
            x = tensor.to_numpy()
        y = fake_layer(x)
        if request.headers["accept"] == "application/vnd.safetensors":
            out = encode_safetensors_array(y, "output").tobytes()
            return httpx.Response(200, content=out, headers={"content-type": "application/vnd.safetensors"})
        return npy_response(y, headers={"x-deconv-batch-size": "1", "x-deconv-queue-ms": "0.5"})


def rand(*shape: int, dtype: str = "float32") -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 6), (3, 5, 6)])
def test_numpy_in_numpy_out(make_client: MakeClient, dtype: str, shape: tuple[int, ...]) -> None:
    echo = Echo()
    client = make_client(echo)
    x = rand(*shape, dtype=dtype)
    y = client.deconv("up1", x)
    assert isinstance(y, np.ndarray)
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(y, fake_layer(x))
    assert y.flags.writeable  # decoded from a private buffer, not a read-only bytes object
    request = echo.requests[-1]
    assert request.method == "POST"
    assert request.url.path == "/deconv"
    assert request.url.params["layer"] == "up1"
    assert request.headers["content-type"] == "application/x-npy"
    assert request.headers["accept"] == "application/x-npy"
    assert int(request.headers["content-length"]) == len(request.read())
    assert "transfer-encoding" not in request.headers
    assert "x-deadline-ms" not in request.headers
    assert "authorization" not in request.headers


def test_numpy_through_safetensors(make_client: MakeClient) -> None:
    echo = Echo()
    client = make_client(echo)
    x = rand(2, 3, 4, 4)
    y = client.deconv("up1", x, wire_format="safetensors")
    np.testing.assert_array_equal(y, fake_layer(x))
    assert echo.requests[-1].headers["content-type"] == "application/vnd.safetensors"
    with pytest.raises(ValueError, match="wire_format"):
        client.deconv("up1", x, wire_format="json")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_torch_in_torch_out(make_client: MakeClient, dtype: torch.dtype) -> None:
    echo = Echo()
    client = make_client(echo)
    x = torch.randn(2, 3, 5, 5, dtype=dtype, requires_grad=dtype == torch.float32)
    y = client.deconv("up1", x)
    assert isinstance(y, torch.Tensor)
    assert y.dtype == dtype
    assert y.device == x.device
    assert torch.equal(y, torch.from_numpy(fake_layer(x.detach().numpy())))
    assert echo.requests[-1].headers["content-type"] == "application/x-npy"
    strided = torch.randn(2, 3, 10, 10, dtype=dtype)[:, :, ::2, ::2]
    assert torch.equal(client.deconv("up1", strided), torch.from_numpy(fake_layer(strided.contiguous().numpy())))


def test_bfloat16_goes_through_safetensors(make_client: MakeClient) -> None:
    echo = Echo()
    client = make_client(echo)
    x = torch.randn(2, 3, 4, 4).to(torch.bfloat16)
    y = client.deconv("up1", x)
    assert y.dtype == torch.bfloat16
    assert echo.requests[-1].headers["content-type"] == "application/vnd.safetensors"
    expected = torch.from_numpy(fake_layer(x.float().numpy())).to(torch.bfloat16)
    assert torch.equal(y, expected)
    with pytest.raises(CodecError, match="safetensors"):
        client.deconv("up1", x, wire_format="npy")


def test_only_tensors_are_accepted(make_client: MakeClient) -> None:
    client = make_client(Echo())
    with pytest.raises(TypeError, match=r"numpy\.ndarray or a torch\.Tensor"):
        client.deconv("up1", [[1.0, 2.0]])
    with pytest.raises(CodecError, match="cannot be sent"):
        client.deconv("up1", np.array(["a", "b"]))


def test_a_response_of_the_wrong_shape_is_an_error(make_client: MakeClient) -> None:
    client = make_client(lambda request: npy_response(np.zeros((3, 2, 8, 8), np.float32)))
    with pytest.raises(CodecError, match=r"shape \[3, 2, 8, 8\] for an input of shape \[2, 3, 4, 4\]"):
        client.deconv("up1", rand(2, 3, 4, 4))
    client = make_client(
        lambda request: httpx.Response(200, text="<html>hi</html>", headers={"content-type": "text/html"})
    )
    with pytest.raises(CodecError, match="text/html"):
        client.deconv("up1", rand(2, 3, 4, 4))


def test_headers_api_key_and_deadline(make_client: MakeClient) -> None:
    echo = Echo()
    client = make_client(echo, api_key="s3cret", headers={"X-Trace": "abc"})
    client.deconv("up1", rand(1, 3, 4, 4), deadline_ms=250)
    client.deconv("up1", rand(1, 3, 4, 4), deadline_ms=0.5)
    client.layers()
    first, second, third = echo.requests
    assert first.headers["authorization"] == "Bearer s3cret"
    assert third.headers["authorization"] == "Bearer s3cret"
    assert first.headers["x-trace"] == "abc"
    assert first.headers["user-agent"].startswith("deconv-client/")
    assert first.headers["x-deadline-ms"] == "250"
    assert second.headers["x-deadline-ms"] == "0.5"
    assert "x-deadline-ms" not in third.headers
    for bad in (0, -1):
        with pytest.raises(ValueError, match="deadline_ms"):
            client.deconv("up1", rand(1, 3, 4, 4), deadline_ms=bad)


def test_base_url_prefix_is_kept(make_client: MakeClient) -> None:
    echo = Echo()
    client = make_client(echo, base_url="http://gateway.test/models/deconv/")
    client.deconv("up1", rand(1, 3, 4, 4))
    client.layer("up1")
    assert [r.url.path for r in echo.requests] == ["/models/deconv/deconv", "/models/deconv/v1/layers/up1"]
    assert str(client.base_url) == "http://gateway.test/models/deconv/"


def test_layers_and_layer(make_client: MakeClient) -> None:
    echo = Echo()
    client = make_client(echo)
    layers = client.layers()
    assert [layer.name for layer in layers] == ["up1", "up2"]
    up1 = layers[0]
    assert isinstance(up1, LayerInfo)
    assert (up1.in_channels, up1.out_channels, up1.kernel_size, up1.stride) == (3, 2, (4, 4), (2, 2))
    assert up1.dtype == "float32"
    assert up1.precision == "tf32"
    assert up1.max_queue_size == 256
    assert up1.input_shape == (-1, 3, -1, -1)
    assert up1.raw["something_new"] == 1
    assert up1.output_hw(32, 30) == (64, 60)
    assert layers[1].stride == (1, 1)
    assert client.layer("up1") == up1
    with pytest.raises(Exception, match="no layer") as info:
        client.layer("a/b c")
    assert info.value.status_code == 404  # type: ignore[attr-defined]
    assert echo.requests[-1].url.raw_path == b"/v1/layers/a%2Fb%20c"


def test_malformed_layer_descriptions_are_codec_errors(make_client: MakeClient) -> None:
    client = make_client(lambda request: httpx.Response(200, json={"layers": [{"name": "x"}]}))
    with pytest.raises(CodecError, match="unexpected layer description"):
        client.layers()
    client = make_client(lambda request: httpx.Response(200, text="not json"))
    with pytest.raises(CodecError, match="JSON"):
        client.layers()


def test_ready(make_client: MakeClient) -> None:
    answers = iter([httpx.Response(200, json={"status": "ready"}), error_response(503, "not_ready", "draining")])
    client = make_client(lambda request: next(answers))
    assert client.ready() is True
    assert client.ready() is False


class Slow:
    """A fake server that takes longer for earlier requests (so answers come back out of order) and counts
    the requests in flight. Sync flavour: called concurrently from worker threads; async: awaited on the loop.
    ``gate``: the first ``gate`` requests are held until that many are in flight together (so that a client bounded
    at ``gate`` reaches its bound whatever the machine's pace; one that sends fewer at once fails the wait)."""

    GATE_TIMEOUT_S = 60.0

    def __init__(self, fail_on: float | None = None, gate: int = 0) -> None:
        self.lock = threading.Lock()
        self.opened = threading.Condition(self.lock)
        self.in_flight = 0
        self.peak = 0
        self.calls = 0
        self.fail_on = fail_on
        self.gate = gate
        self.gate_open = False
        self._gate_event: asyncio.Event | None = None  # the async flavour's, made on its loop

    def _enter(self, request: httpx.Request) -> tuple[np.ndarray, float, bool]:
        x = decode_npy(request.read())
        with self.lock:
            self.in_flight += 1
            self.calls += 1
            self.peak = max(self.peak, self.in_flight)
            held = self.calls <= self.gate
            if self.in_flight >= self.gate and not self.gate_open:
                self.gate_open = True
                self.opened.notify_all()
                if self._gate_event is not None:
                    self._gate_event.set()
        return x, 0.002 * (10 - float(x.flat[0]) % 10), held

    def _answer(self, x: np.ndarray) -> httpx.Response:
        if self.fail_on is not None and float(x.flat[0]) == self.fail_on:
            return error_response(422, "invalid_input", "bad sample")
        return npy_response(x + 1)

    def _leave(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def sync(self, request: httpx.Request) -> httpx.Response:
        x, delay, held = self._enter(request)
        try:
            if held:
                with self.opened:
                    assert self.opened.wait_for(lambda: self.gate_open, self.GATE_TIMEOUT_S), "gate never opened"
            time.sleep(delay)
            return self._answer(x)
        finally:
            self._leave()

    async def async_(self, request: httpx.Request) -> httpx.Response:
        if self._gate_event is None:
            self._gate_event = asyncio.Event()
            if self.gate_open:
                self._gate_event.set()
        x, delay, held = self._enter(request)
        try:
            if held:
                await asyncio.wait_for(self._gate_event.wait(), self.GATE_TIMEOUT_S)
            await asyncio.sleep(delay)  # the async client cancels this when another request fails
            return self._answer(x)
        finally:
            self._leave()


def _slow_client(mirror_factory: MakeClient, slow: Slow, flavour: str) -> Mirror:
    return mirror_factory(slow.sync if flavour == "sync" else slow.async_)


def test_deconv_many_keeps_order_and_bounds_concurrency(make_client: MakeClient, flavour: str) -> None:
    slow = Slow(gate=5)  # five in flight at once, then never a sixth
    client = _slow_client(make_client, slow, flavour)
    xs = [np.full((1, 3, 2, 2), i, np.float32) for i in range(40)]
    ys = client.deconv_many("up1", xs, concurrency=5)
    assert len(ys) == 40
    for i, y in enumerate(ys):
        np.testing.assert_array_equal(y, xs[i] + 1)
    assert slow.peak == 5
    assert client.deconv_many("up1", [], concurrency=5) == []
    ys = client.deconv_many("up1", iter(xs[:3]), concurrency=1)
    assert [float(y.flat[0]) for y in ys] == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="concurrency"):
        client.deconv_many("up1", xs, concurrency=0)


def test_deconv_many_raises_the_first_failure(make_client: MakeClient, flavour: str) -> None:
    slow = Slow(fail_on=3.0)
    client = _slow_client(make_client, slow, flavour)
    xs = [np.full((1, 3, 2, 2), i, np.float32) for i in range(200)]
    with pytest.raises(InvalidInputError, match="bad sample"):
        client.deconv_many("up1", xs, concurrency=4)
    assert slow.calls < 200  # the rest were not sent
    assert slow.in_flight == 0


def test_clients_are_context_managers(portal) -> None:
    transport = httpx.MockTransport(Echo())
    with Client(transport=transport, retry=Retry(max_attempts=2)) as client:
        assert client.retry.max_attempts == 2
        assert str(client.base_url) == "http://127.0.0.1:8000"
        client.layers()
    with pytest.raises(RuntimeError):
        client.layers()

    async def use() -> None:
        async with AsyncClient("http://x", transport=transport, retry=False) as aclient:
            assert aclient.retry.max_attempts == 1
            await aclient.layers()
        with pytest.raises(RuntimeError):
            await aclient.layers()

    portal.call(use)
    with pytest.raises(TypeError, match="retry"):
        Client(retry=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(("x", "named"), [
    (np.ones((1, 3, 4, 4), np.int32), "dtype int32 cannot be sent"),
    (np.ones((1, 3, 4, 4), np.uint16), "dtype uint16 cannot be sent"),
    (np.ones((1, 3, 4, 4), np.complex64), "dtype complex64 cannot be sent"),
    (np.ones((1, 3, 4, 4), bool), "dtype bool cannot be sent"),
    (torch.ones(1, 3, 4, 4, dtype=torch.int16), "dtype torch.int16 cannot be sent"),
    (torch.ones(1, 3, 4, 4, dtype=torch.uint8), "dtype torch.uint8 cannot be sent"),
])
def test_an_unsupported_dtype_is_named_as_the_caller_wrote_it_before_anything_is_sent(
        make_client: MakeClient, x: Any, named: str) -> None:
    echo = Echo()
    client = make_client(echo)
    for wire_format in (None, "npy", "safetensors"):
        with pytest.raises(CodecError, match=re.escape(named)) as err:
            client.deconv("up1", x, wire_format=wire_format)
        assert "float32, float16" in str(err.value)
        for wire_name in ("<i4", "<u2", "<c8", "|b1", "I32", "U16", "BOOL", "I16", "U8"):  # the wire's codes
            assert f"'{wire_name}'" not in str(err.value)
    assert echo.requests == []
    big_endian = rand(1, 3, 4, 4).astype(">f4")  # a served dtype in the other byte order is converted and sent
    np.testing.assert_array_equal(client.deconv("up1", big_endian), fake_layer(big_endian.astype(np.float32)))
