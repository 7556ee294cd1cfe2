"""Attacks of bench/serving/reliability.py on shared memory, JSON parsing, the drain and early refusals: raw sockets
against ``python -m service`` on 127.0.0.1, each returning its figures and checks (``ok``).

- ``region_swap``: a request whose input and output lie in region ``r`` on object X is held in its batch (test-mode
  fault ``hold``, released by the drain) while ``r`` is unregistered and registered again on object Y; Y must never
  receive its output.
- ``replaced_object``: region ``r`` registered on an object that is then deleted and created again with new
  contents under the same key: every request naming ``r`` must be refused (400), in every process.
- ``long_integers``: JSON numbers of thousands of digits in every JSON body (KServe infer, gzip or not, the
  register bodies): a 400/422 or a value, never a 500, and the connection stays usable.
- ``json_bombs``: concurrent gzip bodies whose JSON would be tens of megabytes: 413 before it is parsed, while
  /health/live keeps answering (its latency measured) and the server's RSS stays flat.
- ``drain_connections``: SIGTERM while clients keep connecting and sending: every connection the server accepted
  gets an answer (200 before the drain, 503 with ``Connection: close`` after), later ones are refused.
- ``early_refusals``: a 401 (no key), a 429 (budget) and ``Expect: 100-continue`` without a key are answered before
  the body is sent; duplicate ``Authorization`` headers are 400.

``bench/serving/reliability.py`` runs them (scenarios ``regions``, ``json``, ``drain_load``, ``refusals``); the tests in
tests/reliability call them at bounded sizes. Servers come from ``reliability.Server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import signal
import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from bench.serving import reliability as rel

SHM = Path("/dev/shm")
JSON = "application/json"


# --- shared-memory objects ---------------------------------------------------------------------------------------


class ShmObject:
    """A POSIX shared-memory object of this run (a file under /dev/shm), removed by ``remove``."""

    def __init__(self, size: int, name: str | None = None) -> None:
        self.name = name or f"deconv-rel-{uuid.uuid4().hex[:12]}"
        self.path = SHM / self.name
        self.size = size
        self.create(b"")

    @property
    def key(self) -> str:
        return "/" + self.name

    def create(self, fill: bytes) -> None:
        """(Re)create the object under its name: a new inode of ``size`` bytes, ``fill`` repeated."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.size)
            if fill:
                data = (fill * (self.size // len(fill) + 1))[:self.size]
                os.pwrite(fd, data, 0)
        finally:
            os.close(fd)

    def read(self, offset: int = 0, size: int | None = None) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(offset)
            return f.read(self.size - offset if size is None else size)

    def write(self, offset: int, data: bytes) -> None:
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


async def request(url: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                  timeout_s: float = 60.0) -> tuple[int | str, dict[str, str], bytes]:
    """One request on a new connection (with a multi-process server, each may land in another HTTP process)."""
    host, port = rel._host_port(url)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: deconv\r\nContent-Length: {len(body)}\r\n{extra}"
                     "\r\n".encode() + body)
        await writer.drain()
        return await rel.read_answer(reader, timeout_s)
    finally:
        writer.close()


async def register(url: str, name: str, key: str, byte_size: int, offset: int = 0) -> int | str:
    body = json.dumps({"key": key, "offset": offset, "byte_size": byte_size}).encode()
    return (await request(url, "POST", f"/v2/systemsharedmemory/region/{name}/register", body,
                          {"Content-Type": JSON}))[0]


async def unregister(url: str, name: str) -> int | str:
    return (await request(url, "POST", f"/v2/systemsharedmemory/region/{name}/unregister"))[0]


def region_infer_body(region: str, shape: tuple[int, ...], in_bytes: int, out_bytes: int,
                      out_region: str | None = None) -> bytes:
    """A KServe request whose input lies at offset 0 of ``region`` and whose output follows it (or lies at offset 0
    of ``out_region``)."""
    out = ({"shared_memory_region": region, "shared_memory_offset": in_bytes, "shared_memory_byte_size": out_bytes}
           if out_region is None else {"shared_memory_region": out_region, "shared_memory_byte_size": out_bytes})
    return json.dumps({
        "inputs": [{"name": "input", "shape": list(shape), "datatype": "FP32",
                    "parameters": {"shared_memory_region": region, "shared_memory_byte_size": in_bytes}}],
        "outputs": [{"name": "output", "parameters": out}]}).encode()


def demo_output(x: np.ndarray) -> np.ndarray:
    """The demo layer's output for ``x`` (its weights, from the repository), float64."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(rel.ROOT / "layers" / "demo.safetensors"))
    y = torch.nn.functional.conv_transpose2d(torch.from_numpy(x).double(), weights["weight"].double(),
                                             weights["bias"].double(), stride=2, padding=1)
    return y.numpy()


# --- point: a request's output never lands in another object -------------------------------------------------------

# Every batch waits for the drain (test-mode fault "hold"): the request is held between its check and its write.
SWAP_ENV = {"DECONV_TEST_MODE": "1", "DECONV_FAULTS": "hold:layer=demo", "DECONV_LOG_LEVEL": "warning"}


def grpc_region_infer(address: str, region: str, shape: tuple[int, ...], in_bytes: int,
                      out_bytes: int) -> tuple[int | str, bytes]:
    """The request of ``region_infer_body`` over KServe gRPC (tritonclient.grpc, blocking): (200, b"") when
    answered, else (the gRPC status code's name, its message)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(address)
    try:
        tensor = grpcclient.InferInput("input", list(shape), "FP32")
        tensor.set_shared_memory(region, in_bytes)
        output = grpcclient.InferRequestedOutput("output")
        output.set_shared_memory(region, out_bytes, offset=in_bytes)
        client.infer("demo", [tensor], outputs=[output], client_timeout=120)
        return 200, b""
    except InferenceServerException as exc:
        return str(exc.status()).removeprefix("StatusCode."), str(exc.message()).encode()
    finally:
        client.close()


async def region_swap(server: Any, *, shape: tuple[int, ...] = (1, 16, 128, 128),
                      grpc: str | None = None) -> dict[str, Any]:
    """Region ``r`` on object X holds the input (output after it); the request is held in its batch; meanwhile ``r``
    is unregistered and registered on object Y; SIGTERM releases the batch. Y must be untouched; X holds the
    request's output if it was answered (200, or OK over gRPC), else (4xx, or INVALID_ARGUMENT) X is untouched too.
    ``grpc``: the server's gRPC address (``DECONV_GRPC_PORT``): the request goes over KServe gRPC instead of HTTP.
    The server has ``SWAP_ENV`` and stops."""
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    in_bytes = x.nbytes
    out_bytes = 2 * in_bytes  # demo: half the channels, twice H and W
    size = in_bytes + out_bytes
    xo, yo = ShmObject(size), ShmObject(size)
    try:
        xo.write(0, x.tobytes())
        xo.write(in_bytes, b"\x11" * out_bytes)
        yo.create(b"\x77")
        y_before = yo.read()
        steps = {"register_x": await register(server.url, "r", xo.key, size)}
        if grpc is None:
            host, port = rel._host_port(server.url)
            reader, writer = await asyncio.open_connection(host, port)
            body = region_infer_body("r", shape, in_bytes, out_bytes)
            writer.write(rel.head("/v2/models/demo/infer", len(body), content_type=JSON) + body)
            await writer.drain()
        else:
            call = asyncio.ensure_future(asyncio.to_thread(grpc_region_infer, grpc, "r", shape, in_bytes, out_bytes))
        await asyncio.to_thread(server.wait_log, "fault injected: hold")  # checked, queued, held in its batch
        steps["unregister"] = await unregister(server.url, "r")
        steps["register_y"] = await register(server.url, "r", yo.key, size)
        server.proc.send_signal(signal.SIGTERM)  # the drain releases the batch
        if grpc is None:
            status, _, answer = await rel.read_answer(reader, 120)
            writer.close()
        else:
            status, answer = await asyncio.wait_for(call, 120)
        code = await asyncio.to_thread(server.proc.wait, 120)
        y_after, x_out = yo.read(), xo.read(in_bytes)
    finally:
        xo.remove()
        yo.remove()
    y_written = y_after != y_before
    x_written = x_out != b"\x11" * out_bytes
    x_right = False
    if x_written:
        got = np.frombuffer(x_out, np.float32).reshape(shape[0], 8, 2 * shape[2], 2 * shape[3])
        ref = demo_output(x)
        x_right = bool(np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-3)
    refused = (isinstance(status, int) and 400 <= status < 500) or status == "INVALID_ARGUMENT"
    checks = {"y_never_written": not y_written,
              "answered_200_into_x_or_4xx_untouched": (status == 200 and x_right) or (refused and not x_written),
              "steps_200": all(v == 200 for v in steps.values()), "exit_status_0": code == 0}
    return {"status": status, "answer": answer.decode(errors="replace")[:300], "y_written": y_written,
            "x_written": x_written, "x_holds_its_output": x_right, "steps": steps, "exit_status": code,
            "checks": checks, "ok": all(checks.values())}


# --- point: a replaced object is refused ------------------------------------------------------------------------


async def replaced_object(server: Any, *, requests: int = 6, shape: tuple[int, ...] = (1, 16, 8, 8)) -> dict[str, Any]:
    """Register ``r`` on object X, answer one request, then delete X and create it again under the same key with new
    contents: each of ``requests`` requests (each on a new connection) must be refused with 400, and the new object
    must not receive an output."""
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    in_bytes = x.nbytes
    out_bytes = 2 * in_bytes
    size = in_bytes + out_bytes
    obj = ShmObject(size)
    try:
        obj.write(0, x.tobytes())
        registered = await register(server.url, "r", obj.key, size)
        body = region_infer_body("r", shape, in_bytes, out_bytes)
        # one request per connection before, so that every process of the server opened the object
        first = [(await request(server.url, "POST", "/v2/models/demo/infer", body, {"Content-Type": JSON}))[0]
                 for _ in range(4)]
        obj.create(b"\x55")  # deleted and created again: another inode
        after = obj.read()
        answers = [await request(server.url, "POST", "/v2/models/demo/infer", body, {"Content-Type": JSON})
                   for _ in range(requests)]
        untouched = obj.read() == after
        await unregister(server.url, "r")
    finally:
        obj.remove()
    counted = dict(Counter(str(a[0]) for a in answers))
    checks = {"registered": registered == 200, "before_replacement_200": all(s == 200 for s in first),
              "every_request_400": counted == {"400": requests},
              "message_says_replaced": all(b"replaced" in a[2] for a in answers),
              "new_object_untouched": untouched}
    return {"first_statuses": first, "statuses": counted, "message": answers[0][2].decode(errors="replace")[:200],
            "checks": checks, "ok": all(checks.values())}


# --- point: JSON numbers of any length --------------------------------------------------------------------------

LONG = "9" * 5000  # past Python's 4,300 digits for int <-> str


def long_integer_bodies() -> dict[str, tuple[str, bytes, dict[str, str]]]:
    """Requests with a 5,000-digit integer somewhere in their JSON: name -> (path, body, headers)."""
    def infer(request: str) -> bytes:
        return request.replace("LONG", LONG).encode()

    x = '{"name": "input", "shape": [1, 16, 2, 2], "datatype": "FP32", "data": [' + ",".join(["0.5"] * 64) + "]}"
    kserve = {
        "ignored_id": infer('{"id": LONG, "inputs": [' + x + "]}"),
        "shape": infer('{"inputs": [{"name": "input", "shape": [1, LONG, 2, 2], "datatype": "FP32", "data": []}]}'),
        "data": infer('{"inputs": [{"name": "input", "shape": [1, 16, 2, 2], "datatype": "FP32", "data": [LONG'
                      + ", 0.5" * 63 + "]}]}"),
        "timeout": infer('{"parameters": {"timeout": LONG}, "inputs": [' + x + "]}"),
        "negative_in_outputs": infer('{"inputs": [' + x + '], "outputs": [{"name": "output", "parameters": '
                                     '{"binary_data": true, "shared_memory_offset": -LONG}}]}'),
    }
    infer_path = "/v2/models/demo/infer"
    out: dict[str, tuple[str, bytes, dict[str, str]]] = {}
    for name, body in kserve.items():
        out[f"kserve_{name}"] = (infer_path, body, {"Content-Type": JSON})
        out[f"kserve_{name}_gzip"] = (infer_path, gzip.compress(body), {"Content-Type": JSON,
                                                                        "Content-Encoding": "gzip"})
    head = infer('{"id": LONG, "inputs": [{"name": "input", "shape": [1, 16, 2, 2], "datatype": "FP32", '
                 '"parameters": {"binary_data_size": 256}}]}')
    out["kserve_binary_header"] = (infer_path, head + bytes(256), {
        "Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))})
    out["system_register_byte_size"] = ("/v2/systemsharedmemory/region/long/register",
                                        infer('{"key": "/deconv-none", "offset": 0, "byte_size": LONG}'),
                                        {"Content-Type": JSON})
    out["system_register_offset"] = ("/v2/systemsharedmemory/region/long/register",
                                     infer('{"key": "/deconv-none", "offset": LONG, "byte_size": 8}'),
                                     {"Content-Type": JSON})
    out["cuda_register_device"] = ("/v2/cudasharedmemory/region/long/register",
                                   infer('{"raw_handle": {"b64": ""}, "device_id": LONG, "byte_size": 8}'),
                                   {"Content-Type": JSON})
    out["float_literal"] = (infer_path, infer('{"inputs": [{"name": "input", "shape": [1, 16, 2, 2], "datatype": '
                                              '"FP32", "data": [LONG.5e-99999' + ", 0.5" * 63 + "]}]}"),
                            {"Content-Type": JSON})
    return out


async def long_integers(server: Any, *, api_key: str | None = None) -> dict[str, Any]:
    """Every body of ``long_integer_bodies`` on one kept-alive connection, then a valid request on it: each a 4xx
    (never a 500, never a traceback) and the connection still serving (no close, no reset)."""
    host, port = rel._host_port(server.url)
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reader, writer = await asyncio.open_connection(host, port)
    answers: dict[str, Any] = {}
    reconnects = 0

    async def send(path: str, body: bytes, headers: dict[str, str]) -> tuple[int | str, dict[str, str], bytes]:
        nonlocal reader, writer, reconnects
        extra = "".join(f"{k}: {v}\r\n" for k, v in {**headers, **auth}.items())
        writer.write(f"POST {path} HTTP/1.1\r\nHost: deconv\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
                     + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        answer = await rel.read_answer(reader, 60)
        if not isinstance(answer[0], int) or answer[1].get("connection", "").lower() == "close":
            reconnects += 1
            writer.close()
            reader, writer = await asyncio.open_connection(host, port)
        return answer

    for name, (path, body, headers) in long_integer_bodies().items():
        status, _, text = await send(path, body, headers)
        answers[name] = {"status": status, "error": text.decode(errors="replace")[:160]}
    x = '{"inputs": [{"name": "input", "shape": [1, 16, 2, 2], "datatype": "FP32", "data": [' + ",".join(
        ["0.5"] * 64) + "]}]}"
    final = (await send("/v2/models/demo/infer", x.encode(), {"Content-Type": JSON}))[0]
    writer.close()
    statuses = dict(Counter(str(a["status"]) for a in answers.values()))
    # A float literal of any length is a float (here 0.0): the request is valid.
    checks = {"float_literal_200": answers["float_literal"]["status"] == 200,
              "every_other_answer_4xx": all(isinstance(a["status"], int) and 400 <= a["status"] < 500
                                            for n, a in answers.items() if n != "float_literal"),
              "no_traceback": not any("Traceback" in a["error"] for a in answers.values()),
              "connection_kept": reconnects == 0, "valid_request_after_200": final == 200,
              "no_traceback_in_log": "Traceback" not in server.log()}
    return {"statuses": statuses, "answers": answers, "reconnects": reconnects, "final_status": final,
            "checks": checks, "ok": all(checks.values())}


# --- point: JSON bombs do not stall the event loop ---------------------------------------------------------------


def json_bomb(shape: tuple[int, ...], value: str = "0.5") -> bytes:
    """A gzip KServe JSON request of ``shape`` whose data is ``value`` repeated: tens of kilobytes that decompress
    to tens of megabytes of JSON."""
    count = int(np.prod(shape))
    head = json.dumps({"inputs": [{"name": "input", "shape": list(shape), "datatype": "FP32", "data": []}]})
    before, _, after = head.partition('"data": []')
    compressor = gzip.GzipFile(fileobj=(buf := __import__("io").BytesIO()), mode="wb", compresslevel=9)
    compressor.write(f'{before}"data": ['.encode())
    piece = (value + ",").encode() * 65536
    left = count
    while left > 65536:
        compressor.write(piece)
        left -= 65536
    compressor.write((value + ",").encode() * (left - 1) + value.encode() + b"]" + after.encode())
    compressor.close()
    return buf.getvalue()


async def _probe_live(url: str, stop: asyncio.Event, latencies: list[float]) -> None:
    """GET /health/live on one kept-alive connection, one after the other, until ``stop``: each latency (s)."""
    host, port = rel._host_port(url)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            writer.write(b"GET /health/live HTTP/1.1\r\nHost: deconv\r\n\r\n")
            await writer.drain()
            status, _, _ = await rel.read_answer(reader, 60)
            latencies.append(time.perf_counter() - t0)
            if status != 200:
                latencies.append(float("inf"))
                return
            await asyncio.sleep(0.005)
    finally:
        writer.close()


async def json_bombs(server: Any, *, bombs: int = 8, rounds: int = 1, shape: tuple[int, ...] = (14, 16, 256, 256),
                     value: str = "0.5", gzipped: bool = True, binary_output: bool = False,
                     expect: int = 413) -> dict[str, Any]:
    """``rounds`` waves of ``bombs`` gzip KServe JSON requests at once, each tens of kilobytes decompressing to
    about ``prod(shape)`` x 4 bytes of JSON: every one 413 without being parsed (the server's RSS grows far less than
    the parse would take, ~16 bytes a byte of JSON), while /health/live is probed on a kept-alive connection (its
    latencies reported). With ``expect=200`` and a shape whose JSON fits the limit (``binary_output``: the answer as
    binary), the same figures for requests the server parses and computes."""
    body = json_bomb(shape, value)
    headers = {"Content-Type": JSON, "Content-Encoding": "gzip"}
    if binary_output or not gzipped:
        request_json = gzip.decompress(body)
        if binary_output:
            request_json = request_json[:-1] + b', "parameters": {"binary_data_output": true}}'
        body = gzip.compress(request_json) if gzipped else request_json
        headers = {"Content-Type": JSON, **({"Content-Encoding": "gzip"} if gzipped else {})}
    rss = rel.RssSampler(server.pid)
    stop = asyncio.Event()
    latencies: list[float] = []
    probe = asyncio.create_task(_probe_live(server.url, stop, latencies))
    while not latencies:  # the probe connection serves before the bombs come
        await asyncio.sleep(0.005)
    idle = len(latencies)
    t0 = time.perf_counter()
    answers = []
    for _ in range(rounds):
        answers += await asyncio.gather(*(request(server.url, "POST", "/v2/models/demo/infer", body, headers, 120)
                                          for _ in range(bombs)))
    wall = time.perf_counter() - t0
    stop.set()
    await probe
    figures = rss.stop()
    during = latencies[idle:] or latencies
    counted = dict(Counter(str(a[0]) for a in answers))
    growth = figures["rss_peak_mib"] - figures["rss_before_mib"]
    checks = {f"every_answer_{expect}": counted == {str(expect): bombs * rounds},
              "message_says_binary": expect != 413 or all(b"binary" in a[2] for a in answers),
              "rss_growth_under_256_mib": expect != 413 or growth < 256,
              "live_answered_200": all(t != float("inf") for t in latencies)}
    return {"bombs": bombs, "rounds": rounds, "request_bytes": len(body), "gzip": gzipped,
            "json_bytes_each": int(np.prod(shape)) * (len(value) + 1), "statuses": counted,
            "message": answers[0][2].decode(errors="replace")[:240] if expect == 413 else "", "wall_s": round(wall, 2),
            "live_probes": len(during), "live_p50_ms": round(1000 * float(np.median(during)), 1),
            "live_p99_ms": round(1000 * float(np.percentile(during, 99)), 1),
            "live_max_ms": round(1000 * max(during), 1), "rss_growth_mib": round(growth, 1), **figures,
            "checks": checks, "ok": all(checks.values())}


# --- point: the drain answers every connection it accepted ------------------------------------------------------


async def drain_connections(server: Any, *, clients: int = 32, before: int = 200,
                            layer: str = "demo") -> dict[str, Any]:
    """``clients`` clients each connect, send one request, read the answer and start again; SIGTERM once ``before``
    answers came. Every connection the server accepted (the client's connect succeeded) must get an answer: 200
    before the drain, 503 with ``Connection: close`` during it; never a close or reset after sending. Each client
    stops at its first refused connection after the signal (the port closed); a handshake the closing listener
    resets before the client sent anything counts as refused (nothing was sent: the client may retry); the server
    exits 0."""
    host, port = rel._host_port(server.url)
    body = rel.npy(np.zeros((1, 16, 8, 8), np.float32))
    message = rel.head(f"/deconv?layer={layer}", len(body)) + body
    outcomes: Counter[str] = Counter()
    after_signal: Counter[str] = Counter()
    signalled = asyncio.Event()
    enough = asyncio.Event()
    answers = 0

    async def client() -> None:
        nonlocal answers
        while True:
            late = signalled.is_set()
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except ConnectionRefusedError:
                outcomes["refused"] += 1
                if late:
                    return
                continue
            except ConnectionResetError:
                if not signalled.is_set():
                    outcomes["connect ConnectionResetError"] += 1
                    return
                # The listener closed while this handshake was in its queue: the client sent nothing and may retry,
                # as after a refusal.
                outcomes["reset before sending"] += 1
                return
            except OSError as exc:
                outcomes[f"connect {type(exc).__name__}"] += 1
                return
            outcomes["accepted"] += 1
            try:
                writer.write(message)
                with contextlib.suppress(ConnectionError):
                    await writer.drain()
                status, headers, _ = await rel.read_answer(reader, 60)
            finally:
                writer.close()
            key = str(status) + (" close" if headers.get("connection", "").lower() == "close" else "")
            outcomes[key] += 1
            if late or signalled.is_set():
                after_signal[key] += 1
            if isinstance(status, int):
                answers += 1
                if answers >= before:
                    enough.set()
            if not isinstance(status, int) and signalled.is_set():
                return  # this connection's answer was lost: counted; the next ones would only repeat it

    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    await enough.wait()
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    signalled.set()
    await asyncio.gather(*tasks)
    try:
        code: int | None = await asyncio.to_thread(server.proc.wait, 60)
    except subprocess.TimeoutExpired:
        code = None
    exit_s = time.monotonic() - t0
    answered = sum(n for k, n in outcomes.items() if k.split(" ")[0].isdigit())
    not_connected = ("accepted", "refused", "reset before sending")
    unanswered = {k: n for k, n in outcomes.items() if k not in not_connected and not k[0].isdigit()}
    log = server.log()
    checks = {"every_accepted_connection_answered": answered == outcomes["accepted"] and not unanswered,
              "only_200_or_503_close": all(k in ("200", "200 close", "503 close") for k in outcomes
                                           if k.split(" ")[0].isdigit()),
              "later_clients_refused": outcomes["refused"] + outcomes["reset before sending"] >= clients,
              "exit_status_0": code == 0,
              "nothing_closed_unanswered_in_log": "closed" not in "".join(
                  line for line in log.splitlines() if "no HTTP process took" in line),
              "no_traceback_in_log": "Traceback" not in log}
    return {"clients": clients, "accepted": outcomes["accepted"], "answered": answered,
            "outcomes": dict(outcomes), "after_signal": dict(after_signal), "unanswered": unanswered,
            "exit_status": code, "exit_after_signal_s": round(exit_s, 2), "checks": checks, "ok": all(checks.values())}


# --- point: refusals go at once ----------------------------------------------------------------------------------

REFUSALS_KEY = "refusals-key"
# A budget of 2 MiB (a 4 MiB body does not fit) and a body timeout far beyond any wait here.
REFUSALS_ENV = {"DECONV_API_KEY": REFUSALS_KEY, "DECONV_MAX_INFLIGHT_BYTES": str(2 * 2**20),
                "DECONV_BODY_TIMEOUT_S": "600"}


async def _refused(url: str, head: bytes, sent: bytes, timeout_s: float) -> dict[str, Any]:
    """Send ``head`` and the first bytes ``sent`` of a body it declares larger, then wait for the answer."""
    host, port = rel._host_port(url)
    reader, writer = await asyncio.open_connection(host, port)
    t0 = time.perf_counter()
    try:
        writer.write(head + sent)
        await writer.drain()
        status, headers, body = await rel.read_answer(reader, timeout_s)
        after_s = time.perf_counter() - t0
        closed = await rel.closed_by_server(reader, timeout_s) if isinstance(status, int) else False
    finally:
        writer.close()
    return {"status": status, "after_ms": round(1000 * after_s, 1), "connection": headers.get("connection"),
            "retry_after": headers.get("retry-after"), "closed": closed, "type": body[:200].decode(errors="replace")}


async def early_refusals(server: Any, *, wait_s: float = 60.0) -> dict[str, Any]:
    """Against a server with ``REFUSALS_ENV``: a request without the key, one asking ``Expect: 100-continue``
    without the key, and one whose declared body does not fit the budget, each sending only part of its body (or
    none): each answered at once (401, 401 rather than ``100 Continue``, 429 with Retry-After), with ``Connection:
    close``, then closed. Then duplicate Authorization headers, right key first or wrong key first: 400."""
    npy = "application/x-npy"
    auth = f"Authorization: Bearer {REFUSALS_KEY}\r\n"
    infer = "/v2/models/demo/infer"
    declared = 4 * 2**20
    out = {
        "no_key": await _refused(server.url, rel.head("/deconv?layer=demo", declared, content_type=npy),
                                 b"\x93NUMPY", wait_s),
        "no_key_kserve": await _refused(server.url, rel.head(infer, declared, extra="Inference-Header-Content-"
                                                             "Length: 100\r\n", content_type=JSON), b"{", wait_s),
        "expect_100_no_key": await _refused(server.url, rel.head("/deconv?layer=demo", declared, content_type=npy,
                                                                 extra="Expect: 100-continue\r\n"), b"", wait_s),
        "over_budget": await _refused(server.url, rel.head("/deconv?layer=demo", declared, content_type=npy,
                                                           extra=auth), b"\x93NUMPY", wait_s),
    }
    x = rel.npy(np.zeros((1, 16, 8, 8), np.float32))
    dup = {}
    for name, keys in (("right_then_wrong", (REFUSALS_KEY, "wrong")), ("wrong_then_right", ("wrong", REFUSALS_KEY))):
        extra = "".join(f"Authorization: Bearer {k}\r\n" for k in keys)
        dup[name] = await _refused(server.url, rel.head("/deconv?layer=demo", len(x), extra=extra,
                                                        content_type=npy), x, wait_s)
    checks = {"no_key_401_at_once": out["no_key"]["status"] == 401 and out["no_key_kserve"]["status"] == 401,
              "expect_100_answered_401": out["expect_100_no_key"]["status"] == 401,
              "over_budget_429_with_retry_after": out["over_budget"]["status"] == 429
              and out["over_budget"]["retry_after"] is not None,
              "refusals_close_the_connection": all(r["connection"] == "close" and r["closed"] for r in out.values()),
              "duplicate_authorization_400": all(r["status"] == 400 for r in dup.values())}
    return {**out, "duplicate_authorization": dup, "checks": checks, "ok": all(checks.values())}


# --- the scenarios of bench/serving/reliability.py --------------------------------------------------------------------


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"runs": runs, "ok": all(r["ok"] for r in runs), "checks": {str(i): r["ok"] for i, r in enumerate(runs)}}


def run(chosen: list[str], sizes: dict[str, int], base: dict[str, str], workdir: Path) -> dict[str, Any]:
    """Run the scenarios of this module among ``chosen``, each on servers of its own; their results by name."""
    results: dict[str, Any] = {}

    def started(env: dict[str, str], log: str) -> Any:
        return rel.Server.start({**base, **env}, workdir / log)

    def stopped(server: Any, coro: Any) -> dict[str, Any]:
        try:
            return asyncio.run(coro)  # type: ignore[no-any-return]
        finally:
            server.stop()

    if "regions" in chosen:
        out: dict[str, Any] = {}
        for processes in (1, 2):
            env = {"DECONV_HTTP_PROCESSES": str(processes)}
            out[f"swap_processes_{processes}"] = _summary([
                stopped(s := started({**SWAP_ENV, **env}, f"swap-{processes}-{i}.log"), region_swap(s))
                for i in range(sizes["region_trials"])])
            out[f"replaced_processes_{processes}"] = stopped(s := started(env, f"replaced-{processes}.log"),
                                                             replaced_object(s))
        results["regions"] = {**out, "ok": all(r["ok"] for r in out.values()),
                              "checks": {k: r["ok"] for k, r in out.items()}}
    if "json" in chosen:
        out = {}
        for processes, key in ((1, None), (2, None), (1, REFUSALS_KEY)):
            env = {"DECONV_HTTP_PROCESSES": str(processes), **({"DECONV_API_KEY": key} if key else {})}
            name = f"long_integers_processes_{processes}" + ("_api_key" if key else "")
            out[name] = stopped(s := started(env, f"{name}.log"), long_integers(s, api_key=key))
        out["bombs"] = stopped(s := started({}, "bombs.log"), json_bombs(s, bombs=sizes["bombs"],
                                                                         rounds=sizes["bomb_rounds"]))
        # The largest JSON the server parses (just under its 4 MiB limit), computed, answered as binary: what a
        # legitimate large JSON request costs the other connections.
        out["largest_json"] = stopped(s := started({}, "largest-json.log"), json_bombs(
            s, bombs=sizes["bombs"], shape=(15, 16, 64, 64), binary_output=True, expect=200))
        results["json"] = {**out, "ok": all(r["ok"] for r in out.values()),
                           "checks": {k: r["ok"] for k, r in out.items()}}
    if "drain_load" in chosen:
        out = {}
        for processes in (1, 2):
            runs = []
            for i in range(sizes["drain_runs"]):
                server = started({"DECONV_HTTP_PROCESSES": str(processes), "DECONV_LOG_LEVEL": "info"},
                                 f"drain-load-{processes}-{i}.log")
                try:
                    runs.append(asyncio.run(drain_connections(server)))
                finally:
                    server.stop()
            out[f"processes_{processes}"] = {
                "runs": len(runs), "accepted": sum(r["accepted"] for r in runs),
                "answered": sum(r["answered"] for r in runs),
                "after_signal": dict(sum((Counter(r["after_signal"]) for r in runs), Counter())),
                "refused": sum(r["outcomes"].get("refused", 0) for r in runs),
                "exit_statuses": [r["exit_status"] for r in runs],
                "exit_after_signal_s": sorted(r["exit_after_signal_s"] for r in runs),
                "ok": all(r["ok"] for r in runs), "failed": [r for r in runs if not r["ok"]][:2]}
        results["drain_load"] = {**out, "ok": all(r["ok"] for r in out.values()),
                                 "checks": {k: r["ok"] for k, r in out.items()}}
    if "refusals" in chosen:
        out = {f"processes_{p}": stopped(s := started({**REFUSALS_ENV, "DECONV_HTTP_PROCESSES": str(p)},
                                                      f"refusals-{p}.log"), early_refusals(s))
               for p in (1, 2)}
        results["refusals"] = {**out, "ok": all(r["ok"] for r in out.values()),
                               "checks": {k: r["ok"] for k, r in out.items()}}
    return results
