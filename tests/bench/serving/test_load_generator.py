"""The ``--client raw`` load generator (bench/serving/raw_client.py's ``RawLoad``) against small local HTTP servers:
every request is counted once, as a status or as the exception that failed it, and the clients go on after failures;
and the GPU-utilisation sampler of bench/serving/servers.py."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from bench.serving import raw_client, servers

BODY = b"y" * 40000  # larger than one read, so that responses arrive in pieces

Behaviour = Callable[[int, asyncio.StreamWriter], Awaitable[bool]]  # request number, writer -> keep the connection


async def answer(writer: asyncio.StreamWriter, extra: bytes = b"", status: bytes = b"200 OK") -> None:
    writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/x-npy\r\nX-Deconv-Batch-Size: 3\r\n"
                 + extra + b"content-length: " + str(len(BODY)).encode() + b"\r\n\r\n")
    for i in range(0, len(BODY), 7000):  # in pieces, so that the client parses across reads
        writer.write(BODY[i:i + 7000])
        await writer.drain()


async def serve(behaviour: Behaviour) -> tuple[asyncio.Server, str, list[bytes]]:
    """A server that reads whole requests and lets ``behaviour`` answer each; returns it, its URL and the bodies."""
    received: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.lower().split(b"\r\n")
                                  if line.startswith(b"content-length:")))
                received.append(await reader.readexactly(length))
                if not await behaviour(len(received), writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", received


def feed(client: object, data: bytes) -> None:
    """``data`` arriving on ``client``'s connection, as the event loop hands a ``BufferedProtocol`` its reads."""
    while data:
        buf = client.get_buffer(len(data))  # type: ignore[attr-defined]
        n = min(len(buf), len(data))
        buf[:n] = data[:n]
        client.buffer_updated(n)  # type: ignore[attr-defined]
        data = data[n:]


async def run_load(url: str, count: int, clients: int, timeout: float = 5.0) -> object:
    load = raw_client.RawLoad(url, "/deconv?layer=demo", b"x" * 1000, "application/x-npy", count, timeout)
    await asyncio.wait_for(load.run(clients), 30)
    return load


def test_every_request_answered_in_a_closed_loop() -> None:
    async def main() -> None:
        async def ok(_: int, writer: asyncio.StreamWriter) -> bool:
            await answer(writer)
            return True

        server, url, received = await serve(ok)
        async with server:
            load = await run_load(url, count=100, clients=7)
        assert load.statuses == {"200": 100}
        assert len(received) == 100
        assert all(body == b"x" * 1000 for body in received)
        assert len(load.latencies) == 100
        assert all(0 < v < 5 for v in load.latencies)
        assert load.batch_sizes == [3] * 100
        assert load.sample == BODY

    asyncio.run(main())


def test_connection_close_and_errors_are_counted_and_clients_go_on() -> None:
    async def main() -> None:
        async def mixed(n: int, writer: asyncio.StreamWriter) -> bool:
            if n % 10 == 3:  # the server closes after answering
                await answer(writer, b"connection: close\r\n")
                return False
            if n % 10 == 5:  # an error status
                await answer(writer, status=b"503 Service Unavailable")
                return True
            if n % 10 == 7:  # dropped without an answer
                return False
            if n % 10 == 9:  # not HTTP
                writer.write(b"garbage\r\n\r\n")
                return True
            await answer(writer)
            return True

        server, url, received = await serve(mixed)
        async with server:
            load = await run_load(url, count=60, clients=4)
        assert len(received) == 60  # every request was sent once, through the failures
        assert load.statuses == {"200": 42, "503": 6, "IncompleteReadError": 6, "ValueError": 6}
        assert len(load.latencies) == len(load.batch_sizes) == 42

    asyncio.run(main())


def test_a_request_without_an_answer_times_out() -> None:
    async def main() -> None:
        done = asyncio.Event()

        async def one_silent(n: int, writer: asyncio.StreamWriter) -> bool:
            if n == 2:
                await done.wait()  # silent until the load is over: only the client's timeout ends its wait
                return False
            await answer(writer)
            return True

        server, url, received = await serve(one_silent)
        async with server:
            try:
                load = await run_load(url, count=10, clients=2, timeout=0.5)
            finally:
                done.set()
        assert load.statuses == {"200": 9, "TimeoutError": 1}
        assert len(received) == 10

    asyncio.run(main())


def test_a_refused_connection_fails_its_request() -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()  # nothing listens there now
        load = await run_load(f"http://127.0.0.1:{port}", count=5, clients=2)
        assert load.statuses == {"ConnectionRefusedError": 5}
        assert load.latencies == []

    asyncio.run(main())


def test_a_response_without_a_request_drops_the_connection() -> None:
    class Transport:
        aborted = False

        def abort(self) -> None:
            self.aborted = True

    load = raw_client.RawLoad("http://127.0.0.1:9", "/deconv", b"x", "application/x-npy", 1, 1.0)
    client = raw_client.RawClient(load)
    client.transport = transport = Transport()
    feed(client, b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")  # nothing was sent
    assert transport.aborted
    assert load.statuses == {}
    assert load.latencies == []


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 8, 13, 64, 10**6])
def test_responses_are_parsed_across_any_split_of_the_reads(piece: int) -> None:
    class Transport:
        aborted = False
        sent = 0

        def write(self, data: bytes) -> None:
            self.sent += 1

        def abort(self) -> None:
            self.aborted = True

    load = raw_client.RawLoad("http://127.0.0.1:9", "/deconv", b"x", "application/x-npy", 1, 1.0)
    client = raw_client.RawClient(load)
    client.transport = transport = Transport()
    client.sent_at = 1.0  # the first request in flight; the second leaves when the first is answered
    wire = (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-deconv-batch-size: 2\r\n\r\nfirst"
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
    for i in range(0, len(wire), piece):
        feed(client, wire[i:i + piece])
    assert transport.sent == 1
    assert load.statuses == {"200": 2}
    assert load.sample == b"first"  # the first answer's body, kept as the sample; the second only counted
    assert load.batch_sizes == [2, 1]
    assert transport.aborted  # no requests left: the client finished


def test_gpu_utilisation_is_the_mean_by_gpu_of_the_samples_in_the_window(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in for nvidia-smi: two samples of two GPUs, a line it could not measure, then it waits to be stopped.
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '0, 50\\n1, 90\\n0, [N/A]\\n0, 70\\n1, 100\\n'\nexec sleep 600\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    before = time.time()
    sampler = servers.GpuSampler()
    try:
        deadline = time.monotonic() + 60
        while len(sampler.samples) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        sampler.stop()
    assert sampler.proc.returncode is not None  # stopped, not left running
    assert [(index, util) for _, index, util in sampler.samples] == [(0, 50.0), (1, 90.0), (0, 70.0), (1, 100.0)]
    assert sampler.mean(before, time.time()) == {"0": 60.0, "1": 95.0}
    assert sampler.mean(0.0, before - 1) is None  # no sample in that window
