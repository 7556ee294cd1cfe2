"""The multi-process server (``DECONV_HTTP_PROCESSES`` > 1): its frames, and what its supervisor does when a
process fails. Behaviour seen from outside (batching, 429, 504, drain, tritonclient) is covered by
tests/service/test_server.py, which runs every server test in both modes."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import math
import os
import signal
import socket
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

from service import codec
from service.codec import RawTensor, copy_into, tensor_bytes
from service.config import DEFAULT_LAYER_REPOSITORY
from service.engine.registry import BatchLimits, load_repository
from service.engine.worker import Worker
from service.errors import DeadlineExceededError, InternalError, OverloadedError
from service.ipc import frames, shm
from service.supervisor import SERVING, ConnectionDispatcher, _stop_all
from tests.numerics import rel_err

from ..conftest import (
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

# --- frames ---------------------------------------------------------------------------------------------------


class Recorder(frames.FrameProtocol):
    """Collects the frames it receives; remembers a protocol error."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[tuple[int, bytearray]] = []
        self.error: frames.ProtocolError | None = None

    def frame_received(self, kind: int, body: bytearray) -> None:
        self.frames.append((kind, body))

    def protocol_error(self, exc: frames.ProtocolError) -> None:
        self.error = exc


def _wire(parts: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(p) for p in parts)


def _feed(data: bytes, chunk: int) -> Recorder:
    async def main() -> Recorder:
        rec = Recorder()
        for i in range(0, len(data), chunk):
            rec.data_received(data[i:i + chunk])
        return rec

    return run(main())


@pytest.mark.parametrize("dtype", frames.DTYPES)
def test_submit_and_result_round_trip_bit_exact(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 5, 7, generator=g, dtype=torch.float64).to(dtype)
    data = _wire(frames.submit_frame(41, 2, x, 123.5, 130.25)) + _wire(frames.submit_frame(42, 0, x[:1], 1.0, None))
    y = torch.randn(3, 6, 10, 14, generator=g, dtype=torch.float64).to(dtype)
    data += _wire(frames.result_frame(41, y, 17, 5, 0.00125, "cuda:0"))
    for chunk in (1, 7, 4096):  # frames split anywhere in the stream are reassembled
        rec = _feed(data, chunk)
        assert rec.error is None
        assert [k for k, _ in rec.frames] == [frames.SUBMIT, frames.SUBMIT, frames.RESULT]
        a, b = (frames.parse_submit(body) for _, body in rec.frames[:2])
        assert (a.request_id, a.layer, a.received, a.deadline) == (41, 2, 123.5, 130.25)
        assert (b.request_id, b.layer, b.deadline) == (42, 0, None)
        assert (a.x.dtype, a.x.shape, b.x.shape) == (dtype, (3, 4, 5, 7), (1, 4, 5, 7))
        assert torch.equal(a.x.tensor(), x)
        assert torch.equal(b.x.tensor(), x[:1])
        out = frames.parse_result(rec.frames[2][1], dtype)
        assert (out.request_id, out.batch_samples, out.batch_requests, out.worker) == (41, 17, 5, "cuda:0")
        assert out.queue_s == 0.00125
        assert torch.equal(out.y.tensor(), y)


@pytest.mark.parametrize("dtype", frames.DTYPES)
def test_raw_tensors_gather_bit_exact(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, 3, 4, 5, generator=g, dtype=torch.float64).to(dtype) for n in (2, 1, 3)]
    raws = [RawTensor(memoryview(bytearray(tensor_bytes(x))), dtype, tuple(x.shape)) for x in xs]
    staged = torch.full((6, 3, 4, 5), float("nan"), dtype=dtype)
    copy_into(staged, raws)
    assert torch.equal(staged, torch.cat(xs))
    with pytest.raises(ValueError, match=r"the parts hold \d+ bytes, the destination"):
        copy_into(torch.empty(3, 3, 4, 5, dtype=dtype), raws[:1])
    # A RESULT built from a RawTensor carries the same bytes as one built from the tensor.
    assert b"".join(frames.result_frame(1, raws[2], 6, 3, 0.0, "w")) == b"".join(
        frames.result_frame(1, xs[2], 6, 3, 0.0, "w"))
    with pytest.raises(ValueError, match="cannot hold"):
        RawTensor(memoryview(b"\0" * 7), dtype, (1, 1, 1, 1))


def test_cpu_worker_answers_raw_inputs_with_raw_outputs() -> None:
    layer = load_repository(DEFAULT_LAYER_REPOSITORY, BatchLimits(64, 1 << 28, 2.0, 256)).get("demo")
    assert layer is not None
    worker = Worker(torch.device("cpu"))
    worker.load(layer)
    g = torch.Generator().manual_seed(3)
    c = layer.config
    xs = [torch.randn(n, c.in_channels, 6, 5, generator=g).to(layer.dtype) for n in (1, 2)]
    raws = [RawTensor(memoryview(bytearray(tensor_bytes(x))), x.dtype, tuple(x.shape)) for x in xs]
    try:
        expected = worker.submit(layer, xs).result()
        got = worker.submit(layer, raws).result()
    finally:
        worker.shutdown()
    assert all(isinstance(y, RawTensor) for y in got)
    for y, ref in zip(got, expected, strict=True):
        assert isinstance(ref, torch.Tensor)
        assert torch.equal(y.tensor(), ref)


def test_error_state_and_drop_frames() -> None:
    data = (_wire(frames.error_frame(7, OverloadedError("queue full", retry_after_s=2.5)))
            + _wire(frames.error_frame(8, DeadlineExceededError("late")))
            + _wire(frames.state_frame("ready", "ready", "cuda", ["a", "b"], True))
            + _wire(frames.drop_frame(9, "deadline")))
    rec = _feed(data, 3)
    (k1, e1), (k2, e2), (k3, s), (k4, d) = rec.frames
    assert (k1, k2, k3, k4) == (frames.ERROR, frames.ERROR, frames.STATE, frames.DROP)
    rid, err = frames.parse_error(e1)
    assert rid == 7
    assert isinstance(err, OverloadedError)
    assert (err.status, err.message, err.headers) == (429, "queue full", {"Retry-After": "3"})
    rid, err = frames.parse_error(e2)
    assert rid == 8
    assert isinstance(err, DeadlineExceededError)
    assert err.status == 504
    assert frames.parse_state(s) == {"state": "ready", "reason": "ready", "backend": "cuda", "layers": ["a", "b"],
                                     "cuda_shm": True, "cuda_shm_reason": "", "system_shm": False}
    assert frames.parse_drop(d) == (9, "deadline")


def test_unknown_error_type_becomes_internal() -> None:
    body = bytearray((5).to_bytes(8, "little")) + b'{"type": "no_such_type", "message": "m", "headers": {}}'
    rid, err = frames.parse_error(body)
    assert rid == 5
    assert isinstance(err, InternalError)
    assert err.message == "m"


@pytest.mark.parametrize("bad", [
    b"\x00\x00\x00\x00",  # a frame of length 0
    bytes(frames._frame(frames.SUBMIT, b"\x01\x02")[0]) + b"\x01\x02",  # a SUBMIT too short for its header
])
def test_malformed_frames_are_protocol_errors(bad: bytes) -> None:
    rec = _feed(bad + b"\x00" * 8, 64)
    if rec.error is None:
        with pytest.raises(frames.ProtocolError):
            frames.parse_submit(rec.frames[0][1])
    else:
        assert "empty frame" in str(rec.error)


def test_tensor_size_must_match_its_header() -> None:
    x = torch.ones(1, 2, 3, 4)
    frame = bytearray(_wire(frames.submit_frame(1, 0, x, 0.0, None)))
    with pytest.raises(frames.ProtocolError, match="needs 96 bytes, the frame holds 92"):
        frames.parse_submit(frame[5:-4])
    assert math.isnan(frames._SUBMIT.unpack_from(frame, 5)[-1])  # no deadline travels as NaN


# --- handing connections to the HTTP processes ---------------------------------------------------------------


def _receive_connections(channel: socket.socket, count: int) -> list[socket.socket]:
    channel.settimeout(10)
    out = []
    while len(out) < count:
        data, fds, _, _ = socket.recv_fds(channel, 64, 16)
        assert data, "the channel closed"
        out += [socket.socket(fileno=fd) for fd in fds]
    return out


def _handed_out(dispatcher: ConnectionDispatcher, total: int) -> list[int]:
    """The dispatcher's counts once it has counted ``total`` connections (it counts just after sending one)."""
    deadline = time.monotonic() + 10
    while sum(dispatcher.handed_out) < total and time.monotonic() < deadline:
        time.sleep(0.005)
    return list(dispatcher.handed_out)


class Rig:
    """A dispatcher on a local listener with ``n`` channels (``pairs[i][1]``: process i's end), and clients."""

    def __init__(self, n: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.pairs = [socket.socketpair() for _ in range(n)]
        self.dispatcher = ConnectionDispatcher(self.listener, [mine for mine, _ in self.pairs])
        self.clients: list[socket.socket] = []
        self.received: list[socket.socket] = []

    def connect(self, count: int) -> list[socket.socket]:
        new = [socket.create_connection(self.listener.getsockname()) for _ in range(count)]
        self.clients += new
        return new

    def receive(self, index: int, count: int) -> list[socket.socket]:
        got = _receive_connections(self.pairs[index][1], count)
        self.received += got
        return got

    def close(self) -> None:
        self.dispatcher.stop()
        for sock in [*self.clients, *self.received, *(s for pair in self.pairs for s in pair), self.listener]:
            sock.close()


@contextlib.contextmanager
def _rig(n: int, serving: tuple[int, ...] = ()) -> Iterator[Rig]:
    """A started ``Rig`` whose processes ``serving`` said they serve before it started; closed at the end."""
    rig = Rig(n)
    for i in serving:
        rig.pairs[i][1].send(SERVING)
    rig.dispatcher.start()
    try:
        yield rig
    finally:
        rig.close()


def test_dispatcher_hands_connections_out_in_turn_and_skips_a_closed_channel() -> None:
    with _rig(3, serving=(0, 1, 2)) as rig:
        clients = rig.connect(9)
        served = [rig.receive(i, 3) for i in range(3)]
        assert _handed_out(rig.dispatcher, 9) == [3, 3, 3]
        # What arrives is the client's own connection: its peer is a client, each exactly once, and it carries data.
        peers = sorted(conn.getpeername() for conns in served for conn in conns)
        assert peers == sorted(c.getsockname() for c in clients)
        by_peer = {conn.getpeername(): conn for conns in served for conn in conns}
        for i, client in enumerate(clients):
            by_peer[client.getsockname()].sendall(b"%d" % i)
            assert client.recv(8) == b"%d" % i
        # A process that exited (its end closed) is skipped from then on.
        rig.pairs[1][1].close()
        rig.connect(4)
        more = [rig.receive(i, 2) for i in (0, 2)]
        assert [len(m) for m in more] == [2, 2]
        assert rig.dispatcher.channels[1] is None
        assert _handed_out(rig.dispatcher, 13) == [5, 3, 5]
        assert rig.dispatcher.refused == 0


def test_dispatcher_hands_connections_only_to_processes_that_serve() -> None:
    with _rig(2) as rig:
        # Nobody serves yet: the connections wait in the listen backlog, none is lost.
        clients = rig.connect(3)
        time.sleep(0.5)
        assert rig.dispatcher.handed_out == [0, 0]
        assert rig.dispatcher.refused == 0
        rig.pairs[1][1].send(SERVING)
        served = rig.receive(1, 3)
        assert _handed_out(rig.dispatcher, 3) == [0, 3]
        assert sorted(c.getpeername() for c in served) == sorted(c.getsockname() for c in clients)
        # Once the other one serves too, both get their turn.
        rig.pairs[0][1].send(SERVING)
        rig.connect(4)
        assert [len(rig.receive(i, 2)) for i in (0, 1)] == [2, 2]
        assert _handed_out(rig.dispatcher, 7) == [2, 5]


def test_dispatcher_forgets_a_process_that_exits_before_it_serves() -> None:
    rig = Rig(2)
    rig.pairs[0][1].close()  # exited while starting
    rig.pairs[1][1].send(SERVING)
    rig.dispatcher.start()
    try:
        rig.connect(1)
        assert len(rig.receive(1, 1)) == 1
        deadline = time.monotonic() + 10
        while rig.dispatcher.channels[0] is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rig.dispatcher.channels[0] is None
        assert rig.dispatcher.serving == [False, True]
    finally:
        rig.close()


def _read_to_end(client: socket.socket) -> bytes:
    data = b""
    while chunk := client.recv(4096):
        data += chunk
    return data


def test_dispatcher_answers_503_to_a_connection_no_process_takes() -> None:
    # Before: it was closed unanswered, which a client that sent a request cannot tell from a lost request.
    listener = socket.create_server(("127.0.0.1", 0))
    mine, theirs = socket.socketpair()
    theirs.close()
    dispatcher = ConnectionDispatcher(listener, [mine])
    dispatcher.start()
    try:
        with socket.create_connection(listener.getsockname()) as client:
            client.settimeout(10)
            client.sendall(b"POST /deconv?layer=demo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nbody")
            answer = _read_to_end(client)  # then closed by the server
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ")
        assert b"connection: close" in head.lower()
        assert json.loads(body)["type"] == "not_ready"
        assert dispatcher.refused == 1
    finally:
        dispatcher.stop()
        mine.close()
        listener.close()


def test_dispatcher_stops_listening_after_handing_out_the_backlog() -> None:
    # Closing a listener resets the connections waiting in its backlog; they are handed out first, and only then
    # does the port close, so that later clients are refused (which they can retry) rather than reset.
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    address = listener.getsockname()
    mine, theirs = socket.socketpair()
    dispatcher = ConnectionDispatcher(listener, [theirs])
    dispatcher.serving = [True]  # (its process said SERVING; the accepting thread is not started)
    waiting = [socket.create_connection(address) for _ in range(5)]  # in the backlog: nobody accepts yet
    try:
        dispatcher.stop_listening()
        assert listener.fileno() == -1
        received = []
        mine.settimeout(10)
        while len(received) < 5:
            _, fds, _, _ = socket.recv_fds(mine, 64, 16)
            received += [socket.socket(fileno=fd) for fd in fds]
        assert dispatcher.refused == 0
        for conn, client in zip(received, waiting, strict=True):  # each the server end of a waiting connection
            client.sendall(b"x")
            conn.settimeout(10)
            assert conn.recv(1) == b"x"
            conn.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(address, timeout=10)
    finally:
        for c in waiting:
            c.close()
        mine.close()
        theirs.close()


def _tcp_connections_per_process(pids: list[int], port: int) -> list[int]:
    """Established TCP connections on local ``port`` that each process holds (Linux /proc)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":  # 01: ESTABLISHED
            inodes.add(fields[9])
    counts = []
    for pid in pids:
        links = [os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir() if f.is_symlink()]
        counts.append(sum(1 for link in links if link.startswith("socket:[") and link[8:-1] in inodes))
    return counts


# --- the processes --------------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout
    return [int(p) for p in out.split()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0): look at its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def _wait_gone(pids: list[int], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < deadline, f"processes still running: {[p for p in pids if not _gone(p)]}"
        time.sleep(0.05)


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, Any]:
    module = write_layer(tmp_path, "fast", in_channels=4, out_channels=6, kernel_size=4, stride=2, padding=1)
    return tmp_path, module


def _wait_serving(proc: ServerProcess, count: int) -> None:
    """Wait until ``count`` HTTP processes serve: ready is one of them; the others may still be starting (and
    report not ready in the merged ``deconv_ready`` until then)."""
    deadline = time.monotonic() + 60
    while f"HTTP processes serving: {count} of {count}" not in proc.log():
        assert time.monotonic() < deadline, proc.log()
        time.sleep(0.05)


async def _post_all_checked(url: str, module: Any, xs: list[np.ndarray]) -> list[httpx.Response]:
    """Post every input of layer ``fast`` at once, each on its own connection (any HTTP process may accept it), and
    check every answer against the float64 reference."""

    async def one(x: np.ndarray) -> httpx.Response:
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            return await client.post("/deconv?layer=fast", content=npy_bytes(x), headers={"content-type": NPY})

    responses = await asyncio.gather(*(one(x) for x in xs))
    for x, r in zip(xs, responses, strict=True):
        assert r.status_code == 200, r.text[:300]
        assert rel_err(load_npy(r.content), reference(module, torch.from_numpy(x))) < 1e-5
    return list(responses)


def test_requests_spread_over_the_http_processes_share_batches_and_metrics(repo, server_factory):
    root, module = repo
    proc = server_factory({"DECONV_LAYER_REPOSITORY": str(root), "DECONV_HTTP_PROCESSES": "3",
                           "DECONV_MAX_QUEUE_DELAY_MS": "300"})
    assert len(_children(proc.proc.pid)) == 4  # the engine and three HTTP processes
    _wait_serving(proc, 3)

    async def main() -> None:
        xs = [np.random.default_rng(i).standard_normal((1, 4, 5, 5)).astype(np.float32) for i in range(24)]

        responses = await _post_all_checked(proc.url, module, xs)
        assert max(int(r.headers["x-deconv-batch-size"]) for r in responses) > 1
        async with httpx.AsyncClient(base_url=proc.url, timeout=20) as client:
            texts = [(await client.get("/metrics")).text for _ in range(6)]
        for text in texts:  # whichever process answers, it reports every process's counts
            assert metric_value(text, "deconv_requests_total", layer="fast", api="native", status="200") == 24
            assert metric_value(text, "deconv_batch_size_sum", layer="fast") == 24
            assert metric_value(text, "deconv_queue_time_seconds_count", layer="fast") == 24  # once each
            assert metric_value(text, "deconv_ready") == 1
            assert metric_value(text, "deconv_ipc_requests_total", path="shared") == 24  # through shared memory

    run(main())


def test_large_bodies_of_every_format_are_answered_from_the_shared_memory(repo, server_factory):
    """Bodies of 64 KiB or more are read into the HTTP process's arena and their tensors go to the engine where they
    lie (test_shm.py shows the frames): every format and layout, whatever offset the tensor has in the body."""
    root, module = repo
    proc = server_factory({"DECONV_LAYER_REPOSITORY": str(root), "DECONV_HTTP_PROCESSES": "2"})
    _wait_serving(proc, 2)

    async def main() -> None:
        x = np.random.default_rng(7).standard_normal((4, 4, 48, 48)).astype(np.float32)  # 144 KiB
        ref = reference(module, torch.from_numpy(x))
        kserve = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                              "parameters": {"binary_data_size": x.nbytes}}],
                  "parameters": {"binary_data_output": True}, "id": "odd"}  # an odd JSON length
        head = json.dumps(kserve).encode()
        async with httpx.AsyncClient(base_url=proc.url, timeout=30) as client:
            for body, content_type in ((npy_bytes(x), NPY), (npy_bytes(np.asfortranarray(x)), NPY),
                                       (codec.encode(torch.from_numpy(x), codec.SAFETENSORS), codec.SAFETENSORS)):
                r = await client.post("/deconv?layer=fast", content=body,
                                      headers={"content-type": content_type, "accept": NPY})
                assert r.status_code == 200, r.text[:300]
                assert rel_err(load_npy(r.content), ref) < 1e-5
            for encoding in ("identity", "gzip"):
                body = head + x.tobytes()
                headers = {"inference-header-content-length": str(len(head)), "content-encoding": encoding,
                           "content-type": "application/octet-stream"}
                r = await client.post("/v2/models/fast/infer", headers=headers,
                                      content=gzip.compress(body) if encoding == "gzip" else body)
                assert r.status_code == 200, r.text[:300]
                n = int(r.headers["inference-header-content-length"])
                assert rel_err(np.frombuffer(r.content[n:], np.float32).reshape(tuple(ref.shape)), ref) < 1e-5
            text = (await client.get("/metrics")).text
        assert metric_value(text, "deconv_ipc_requests_total", path="shared") == 5

    run(main())


@pytest.mark.parametrize("arena_bytes", ["0", "8192"], ids=["socket", "small-arena"])
def test_requests_that_do_not_fit_the_shared_memory_travel_through_the_engine_socket(repo, server_factory,
                                                                                    arena_bytes):
    root, module = repo
    proc = server_factory({"DECONV_LAYER_REPOSITORY": str(root), "DECONV_HTTP_PROCESSES": "2",
                           "DECONV_IPC_SHM_BYTES": arena_bytes, "DECONV_MAX_QUEUE_DELAY_MS": "100"})
    _wait_serving(proc, 2)

    async def main() -> None:
        # [1, 4, 5, 5] needs 448 + 2400 bytes of a slot (two fit in 8 KiB); [2, 4, 12, 12] 4608 + 27648 (never).
        rng = np.random.default_rng(0)
        xs = [rng.standard_normal((1, 4, 5, 5) if i % 3 else (2, 4, 12, 12)).astype(np.float32) for i in range(30)]
        await _post_all_checked(proc.url, module, xs)
        # Inputs in a client's shared-memory region: read straight into a slot, or into a copy sent inline.
        key = f"/deconv-mp-{os.getpid()}-{arena_bytes}"
        fd = os.open(Path("/dev/shm") / key[1:], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.pwrite(fd, xs[0].tobytes() + xs[1].tobytes(), 0)
            async with httpx.AsyncClient(base_url=proc.url, timeout=20) as client:
                r = await client.post("/v2/systemsharedmemory/region/in/register",
                                      json={"key": key, "byte_size": xs[0].nbytes + xs[1].nbytes})
                assert r.status_code == 200, r.text
                for x, offset in ((xs[0], 0), (xs[1], xs[0].nbytes), (xs[0], 0)):
                    params = {"shared_memory_region": "in", "shared_memory_byte_size": x.nbytes,
                              "shared_memory_offset": offset}
                    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                        "parameters": params}], "parameters": {"binary_data_output": True}}
                    r = await client.post("/v2/models/fast/infer", json=body)
                    assert r.status_code == 200, r.text[:300]
                    head = int(r.headers["inference-header-content-length"])
                    y = np.frombuffer(r.content[head:], np.float32).reshape(-1)
                    ref = reference(module, torch.from_numpy(x))
                    assert rel_err(y.reshape(tuple(ref.shape)), ref) < 1e-5
                text = (await client.get("/metrics")).text
        finally:
            os.close(fd)
            (Path("/dev/shm") / key[1:]).unlink()
        shared = metric_value(text, "deconv_ipc_requests_total", path="shared")
        inline = metric_value(text, "deconv_ipc_requests_total", path="inline")
        assert shared + inline == 33
        if arena_bytes == "0":
            assert shared == 0
        else:
            assert 0 < shared <= 21
            assert inline >= 12

    run(main())


def test_keep_alive_connections_are_spread_evenly_over_the_http_processes(repo, server_factory):
    root, _ = repo
    proc = server_factory({"DECONV_LAYER_REPOSITORY": str(root), "DECONV_HTTP_PROCESSES": "3"})
    children = _children(proc.proc.pid)
    http = [p for p in children if b"service.http.frontend" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(http) == 3
    _wait_serving(proc, 3)
    clients = [httpx.Client(base_url=proc.url, timeout=20) for _ in range(12)]
    try:
        for client in clients:  # each keeps its connection open
            assert client.get("/health/live").status_code == 200
        assert _tcp_connections_per_process(http, proc.port) == [4, 4, 4]
        assert _tcp_connections_per_process([proc.proc.pid], proc.port) == [0]  # the supervisor keeps none
    finally:
        for client in clients:
            client.close()


def test_an_http_process_stopped_while_it_waits_for_the_engine_stops_at_once(repo, tmp_path, monkeypatch) -> None:
    import service.engine.remote
    from service.config import Settings
    from service.engine.remote import RemoteEngine

    monkeypatch.setattr(service.engine.remote, "watch_parent", lambda on_exit: None)  # pytest's stdin is no supervisor
    root, _ = repo
    gone = tmp_path / "engine.sock"
    with socket.socket(socket.AF_UNIX) as dead:  # a socket file nobody listens on any more: connect is refused
        dead.bind(str(gone))
    engine = RemoteEngine(Settings(layer_repository=root, devices="cpu"), str(gone))

    async def main() -> None:
        task = asyncio.create_task(engine.start())
        await asyncio.sleep(0.3)
        assert not task.done()  # retrying: the engine may still be starting
        engine.begin_drain()
        # Guards retrying on until CONNECT_TIMEOUT_S (30 s) and then failing: start() would raise ConnectionError
        # instead of returning; the bound only limits how long that is waited for.
        await asyncio.wait_for(task, 60)

    run(main(), 120)
    assert engine.client is None
    assert engine.queues == {}


def test_engine_death_stops_the_server(repo, server_factory):
    root, _ = repo
    proc = server_factory({"DECONV_LAYER_REPOSITORY": str(root), "DECONV_HTTP_PROCESSES": "2"})
    children = _children(proc.proc.pid)
    engine = next(p for p in children if b"service.engine.process" in Path(f"/proc/{p}/cmdline").read_bytes())
    os.kill(engine, signal.SIGKILL)
    try:
        code = proc.proc.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not stop within 30 s of its engine's death:\n{proc.log()}")
    assert code == 1, proc.log()
    _wait_gone(children)
    log = proc.log()
    assert "the engine (pid" in log
    assert "exited with status -9: stopping the server" in log
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{proc.url}/health/live", timeout=2)


def test_children_stop_when_the_supervisor_is_killed(repo, tmp_path):
    root, _ = repo
    proc = ServerProcess({"DECONV_LAYER_REPOSITORY": str(root), "DECONV_HTTP_PROCESSES": "2"},
                         tmp_path / "server.log")
    try:
        proc.wait_ready()
        children = _children(proc.proc.pid)
        assert len(children) == 3
        proc.proc.kill()
        _wait_gone(children)
        assert "the supervisor is gone: shutting down" in proc.log()
    finally:
        proc.stop()


def test_a_child_that_sigterm_ends_while_it_starts_stopped_cleanly() -> None:
    """A child that SIGTERM kills had not installed its handler yet (it was importing), so it had nothing to drain:
    0. One that handles the signal keeps its own status."""
    ready = "import sys; sys.stdout.write('r'); sys.stdout.flush(); "
    starting = subprocess.Popen([sys.executable, "-c", ready + "import time; time.sleep(60)"], stdout=subprocess.PIPE)
    failing = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
                                "signal.signal(signal.SIGTERM, lambda *a: sys.exit(1)); " + ready + "time.sleep(60)"],
                               stdout=subprocess.PIPE)
    for child in (starting, failing):
        assert child.stdout is not None
        assert child.stdout.read(1) == b"r"  # running (and the second one's handler installed)
    assert _stop_all([starting, failing], 20) == [0, 1]
    for child in (starting, failing):
        assert child.stdout is not None
        child.stdout.close()


def test_port_in_use_fails_at_start(repo, tmp_path):
    root, _ = repo
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "DECONV_LAYER_REPOSITORY": str(root), "DECONV_DEVICES": "cpu",
               "DECONV_HTTP_PROCESSES": "2", "DECONV_HOST": "127.0.0.1", "DECONV_PORT": str(port)}
        done = subprocess.run([sys.executable, "-m", "service"], cwd=REPO_ROOT, env=env, capture_output=True,
                              text=True, timeout=60, check=False)
    assert done.returncode == 3
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


def test_an_http_process_serves_only_once_it_knows_the_engines_state(repo, tmp_path, monkeypatch) -> None:
    """``RemoteEngine.start`` returns after the engine's first ``STATE`` (which the engine sends once it has mapped
    and page-locked the arena), so that no request meets a process that has not heard what the engine offers: its
    readiness and the shared-memory extensions ``/v2`` lists."""
    import service.engine.remote
    from service.config import Settings
    from service.engine.remote import RemoteEngine

    monkeypatch.setattr(service.engine.remote, "watch_parent", lambda on_exit: None)  # pytest's stdin is no supervisor
    root, _ = repo
    path = str(tmp_path / "engine.sock")
    engine = RemoteEngine(Settings(layer_repository=root, devices="cpu", ipc_shm_bytes=0), path)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(path)
            listener.listen(1)
            listener.setblocking(False)
            task = asyncio.create_task(engine.start())
            conn, _ = await loop.sock_accept(listener)
            with conn:
                conn.setblocking(True)
                assert await loop.run_in_executor(None, shm.recv_hello, conn) is None  # no arena
                for _ in range(50):
                    await asyncio.sleep(0)
                assert not task.done()  # connected, but no state yet
                assert engine.readiness.state == "starting"
                assert not engine.cuda_memory.available
                names = [layer.name for layer in engine.registry]  # type: ignore[union-attr]
                state = frames.state_frame("ready", "", "cuda", names, True, "", True)
                await loop.sock_sendall(conn, _wire(state))
                await asyncio.wait_for(task, 60)
                assert engine.readiness.state == "ready"
                assert engine.cuda_memory.available
                assert engine.cuda_memory.system_available
                engine.client.close()  # type: ignore[union-attr]

    run(main(), 120)
