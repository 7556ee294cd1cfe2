"""Attacks on KServe system shared memory, raw sockets against ``python -m service`` on 127.0.0.1, each returning its
figures and checks (``ok``):

- ``region_swap``: a request whose input and output lie in region ``r`` on object X is held in its batch (test-mode
  fault ``hold``, released by the drain) while ``r`` is unregistered and registered again on object Y; Y must never
  receive its output.
- ``replaced_object``: region ``r`` registered on an object that is then deleted and created again with new
  contents under the same key: every request naming ``r`` must be refused (400), in every process.

The scenario ``regions`` of ``python -m bench.serving.reliability`` runs them; the tests in tests/reliability call them
at bounded sizes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from bench.serving.reliability.server import (
    JSON,
    ROOT,
    head,
    host_port,
    read_answer,
    request,
)

SHM = Path("/dev/shm")


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

    weights = load_file(str(ROOT / "layers" / "demo.safetensors"))
    y = torch.nn.functional.conv_transpose2d(torch.from_numpy(x).double(), weights["weight"].double(),
                                             weights["bias"].double(), stride=2, padding=1)
    return y.numpy()


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
            host, port = host_port(server.url)
            reader, writer = await asyncio.open_connection(host, port)
            body = region_infer_body("r", shape, in_bytes, out_bytes)
            writer.write(head("/v2/models/demo/infer", len(body), content_type=JSON) + body)
            await writer.drain()
        else:
            call = asyncio.ensure_future(asyncio.to_thread(grpc_region_infer, grpc, "r", shape, in_bytes, out_bytes))
        await asyncio.to_thread(server.wait_log, "fault injected: hold")  # checked, queued, held in its batch
        steps["unregister"] = await unregister(server.url, "r")
        steps["register_y"] = await register(server.url, "r", yo.key, size)
        server.proc.send_signal(signal.SIGTERM)  # the drain releases the batch
        if grpc is None:
            status, _, answer = await read_answer(reader, 120)
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
