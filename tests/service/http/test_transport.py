"""The HTTP connection: one write per response (``service.http.server.CoalescingTransport`` under uvicorn's own
protocol), and request bodies through ``HTTPProtocol`` as they arrive: in pieces, past the reading high-water mark,
pipelined, in chunked transfer encoding, after ``Expect: 100-continue``, cut off by the client, and straight into
the application's buffer (``BODY_INTO``)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from service.http.asgi import BODY_INTO, BODY_TIMED_OUT, ON_DISCONNECT, disconnect_watch
from service.http.server import CoalescingTransport, HTTPProtocol

from ..conftest import REPO_ROOT


class FakeTransport(asyncio.Transport):
    """Records what reaches the socket: one entry per system call the real transport would make."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[bytes] = []
        self.closed = False
        self.aborted = False
        self.protocol: asyncio.BaseProtocol | None = None

    def write(self, data: Any) -> None:
        self.calls.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        self.calls.append(b"".join(bytes(d) for d in list_of_data))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def get_write_buffer_size(self) -> int:
        return 7

    def can_write_eof(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_writes_of_one_iteration_leave_together_and_close_flushes_first() -> None:
    async def main() -> None:
        real = FakeTransport()
        t = CoalescingTransport(real)
        t.write(b"head")
        t.writelines([b"-", memoryview(b"body")])
        t.write(b"")
        assert real.calls == []
        assert t.get_write_buffer_size() == 7 + 9
        await asyncio.sleep(0)
        assert real.calls == [b"head-body"]
        t.write(b"last")
        t.close()  # queued bytes go before the close, not after
        assert real.calls == [b"head-body", b"last"]
        assert real.closed
        await asyncio.sleep(0)
        assert real.calls == [b"head-body", b"last"]  # nothing written to a closed transport

    asyncio.run(main())


def test_abort_drops_queued_writes_and_the_rest_is_the_real_transport() -> None:
    async def main() -> None:
        real = FakeTransport()
        t = CoalescingTransport(real)
        t.write(b"never")
        t.abort()
        await asyncio.sleep(0)
        assert real.calls == []
        assert real.aborted
        assert t.is_closing()
        assert t.get_extra_info("peername") == ("127.0.0.1", 5000)
        proto = asyncio.Protocol()
        t.set_protocol(proto)
        assert real.protocol is proto

    asyncio.run(main())


def _protocol(app: Any, transport: FakeTransport) -> Any:
    config = uvicorn.Config(app, http=HTTPProtocol, lifespan="off", log_level="warning")
    config.load()
    protocol = config.http_protocol_class(config=config, server_state=ServerState(), app_state={})
    protocol.connection_made(transport)
    return protocol


async def _turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_uvicorns_protocol_sends_a_response_in_one_write() -> None:
    body = b"x" * 70000  # larger than a socket write can be assumed to take at once

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def main() -> None:
        real = FakeTransport()
        protocol = _protocol(app, real)
        protocol.data_received(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n")
        await _turns()
        assert len(real.calls) == 1, [c[:40] for c in real.calls]
        head, _, got = real.calls[0].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert got == body
        protocol.connection_lost(None)

    asyncio.run(main())


def test_a_forked_child_reports_metrics_under_its_own_process_id(tmp_path) -> None:
    # Multiprocess metrics keep one file per process id; the id is cached (no system call per update) and must
    # still change in a child made by fork().
    script = """
import os, sys
from service.metrics import Metrics, process_id
m = Metrics()
m.worker_batches.labels("w").inc()
pid = os.fork()
if pid == 0:
    ok = process_id() == os.getpid()
    Metrics().worker_batches.labels("w").inc(2)
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
print(os.getpid(), pid, os.waitstatus_to_exitcode(status))
"""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    parent, child, code = (int(v) for v in out)
    assert code == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert f"counter_{parent}.db" in names, names
    assert f"counter_{child}.db" in names, names


def test_a_process_starts_while_another_process_has_just_created_its_metrics_file(tmp_path) -> None:
    # prometheus-client creates a process's file empty and writes its header afterwards; a process starting at
    # that moment (the HTTP processes start together) must not read the directory and fail on it.
    (tmp_path / "counter_999999.db").write_bytes(b"")
    script = "from service.metrics import Metrics; m = Metrics(); m.worker_batches.labels('w').inc(); print('ok')"
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["ok"]


class CountingTransport(FakeTransport):
    """A FakeTransport that counts the protocol's reading pauses and resumptions (flow control)."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = 0
        self.resumed = 0

    def pause_reading(self) -> None:
        self.paused += 1

    def resume_reading(self) -> None:
        self.resumed += 1


def _echo_app(bodies: list[list[bytes]]) -> Any:
    """An ASGI app that reads its request's body message by message (recorded in ``bodies``, one list a request)
    and answers it back."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        parts: list[bytes] = []
        bodies.append(parts)
        while True:
            message = await receive()
            assert message["type"] == "http.request", message
            parts.append(message["body"])
            if not message["more_body"]:
                break
        body = b"".join(parts)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return app


def _answers(calls: list[bytes]) -> list[bytes]:
    """The bodies of the 200 answers written, in order."""
    data, out = b"".join(calls), []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        if head.startswith(b"HTTP/1.1 100"):
            data = rest
            continue
        assert head.startswith(b"HTTP/1.1 200"), head
        lengths = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
        length = int(lengths[0])
        out.append(rest[:length])
        data = rest[length:]
    return out


def test_a_body_reaches_the_application_piece_by_piece_as_it_arrives() -> None:
    body = bytes(range(256)) * 40  # 10240 bytes, sent in three pieces with the application reading between them
    bodies: list[list[bytes]] = []

    async def main() -> None:
        real = FakeTransport()
        protocol = _protocol(_echo_app(bodies), real)
        protocol.data_received(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:1000])
        await _turns()
        protocol.data_received(body[1000:5000])
        await _turns()
        protocol.data_received(body[5000:])
        await _turns()
        assert _answers(real.calls) == [body]

    asyncio.run(main())
    assert bodies == [[body[:1000], body[1000:5000], body[5000:]]]  # each piece as it came, none joined or lost


def test_reading_pauses_past_the_high_water_mark_until_the_application_reads() -> None:
    body = os.urandom(300_000)  # past uvicorn's 64 KiB high-water mark before the application reads any of it
    bodies: list[list[bytes]] = []

    async def main() -> None:
        real = CountingTransport()
        protocol = _protocol(_echo_app(bodies), real)
        head = b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body)
        protocol.data_received(head + body[:100_000])
        protocol.data_received(body[100_000:200_000])
        assert real.paused >= 1  # 200000 bytes waiting: the connection stops reading
        await _turns()
        assert real.resumed >= 1  # the application took them: reading resumes
        protocol.data_received(body[200_000:])
        await _turns()
        assert _answers(real.calls) == [body]

    asyncio.run(main())
    assert b"".join(bodies[0]) == body


def test_pipelined_and_chunked_bodies_go_to_their_own_requests() -> None:
    first, second = os.urandom(5000), os.urandom(7000)
    bodies: list[list[bytes]] = []
    chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (3000, second[:3000], 4000, second[3000:])

    async def main() -> None:
        real = FakeTransport()
        protocol = _protocol(_echo_app(bodies), real)
        # Two requests in one segment: the second (chunked transfer encoding) waits for the first's answer.
        protocol.data_received(b"POST /a HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(first) + first
                               + b"POST /b HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked)
        await _turns(60)
        assert _answers(real.calls) == [first, second]

    asyncio.run(main())
    assert [b"".join(parts) for parts in bodies] == [first, second]


def test_expect_100_continue_is_answered_before_the_body_is_read() -> None:
    body = b"y" * 3000
    bodies: list[list[bytes]] = []

    async def main() -> None:
        real = FakeTransport()
        protocol = _protocol(_echo_app(bodies), real)
        protocol.data_received(b"POST /x HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
                               b"Content-Length: %d\r\n\r\n" % len(body))
        await _turns()
        assert b"".join(real.calls).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        protocol.data_received(body)
        await _turns()
        assert _answers(real.calls) == [body]

    asyncio.run(main())


def test_a_client_gone_mid_body_is_a_disconnect_for_the_application() -> None:
    seen: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            seen.append(message)
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                return

    async def main() -> None:
        real = FakeTransport()
        protocol = _protocol(app, real)
        protocol.data_received(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n\r\n" + b"z" * 1000)
        await _turns()
        protocol.connection_lost(None)
        await _turns()

    asyncio.run(main())
    assert [m["type"] for m in seen] == ["http.request", "http.disconnect"]
    assert seen[0]["body"] == b"z" * 1000
    assert seen[0]["more_body"]



@pytest.mark.parametrize("through", ["connection", "receive"])
def test_a_request_waiting_after_its_body_learns_that_its_client_went(through: str) -> None:
    """A request's watch on its client (``disconnect_watch``, a ``Call``'s ``on_disconnect``): through the
    connection's own hook (``ON_DISCONNECT``), for a request that registered before the connection was lost, one
    after, and not for one that stopped watching; and, with no hook (another ASGI server), through the ASGI
    disconnect."""
    events: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if through == "receive":
            scope.pop(ON_DISCONNECT)
        on_disconnect = disconnect_watch(scope, receive)
        assert (await receive())["type"] == "http.request"  # the whole body
        gone = asyncio.get_running_loop().create_future()
        on_disconnect(lambda: gone.set_result(None))
        stop = on_disconnect(lambda: events.append("stopped one called"))
        stop()
        await gone
        events.append("gone")
        if through == "connection":
            later = asyncio.get_running_loop().create_future()
            on_disconnect(lambda: later.set_result(None))  # lost already: called soon
            await later
            events.append("gone already")

    async def main() -> None:
        real = FakeTransport()
        protocol = _protocol(app, real)
        protocol.data_received(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc")
        await _turns()
        assert events == []
        protocol.connection_lost(None)
        await _turns()

    asyncio.run(main())
    assert events == (["gone", "gone already"] if through == "connection" else ["gone"])


def _into_app(results: list[tuple[bytes, int, dict[str, Any]]]) -> Any:
    """An ASGI app that reads its body as ``service.http.asgi.read_body`` does: what came with the head from
    ``receive``, the rest through the connection's ``BODY_INTO`` into a buffer of the declared length, then one
    more ``receive`` (the body's end, or the disconnect). Records (the buffer, bytes filled, the last message)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        size = int(dict(scope["headers"])[b"content-length"])
        view = memoryview(bytearray(size))
        first = await receive()
        view[:len(first["body"])] = first["body"]
        filled, last = len(first["body"]), first
        if first["more_body"]:
            filled += await scope[BODY_INTO](scope, view[filled:])
            last = await receive()
        results.append((bytes(view), filled, last))
        if last["type"] == "http.request":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})

    return app


def test_a_body_read_into_the_applications_buffer_collects_nowhere_on_the_way() -> None:
    body = os.urandom(400_000)
    results: list[tuple[bytes, int, dict[str, Any]]] = []

    async def main() -> None:
        real = CountingTransport()
        protocol = _protocol(_into_app(results), real)
        head = b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body)
        protocol.data_received(head + body[:1000])
        protocol.data_received(body[1000:100_000])  # past the high-water mark before the application reads
        assert real.paused >= 1
        await _turns()
        assert real.resumed >= 1
        for start in range(100_000, len(body) - 5000, 60_000):
            protocol.data_received(body[start:min(start + 60_000, len(body) - 5000)])
            assert len(protocol.cycle.body) == 0  # each piece went straight into the application's buffer
        # The body's end and a pipelined request in one segment, before the application has run again.
        protocol.data_received(body[-5000:] + b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc")
        await _turns()
        assert _answers(real.calls) == [b"ok", b"ok"]

    asyncio.run(main())
    assert [(got, filled, last["type"], last["more_body"]) for got, filled, last in results] == [
        (body, len(body), "http.request", False), (b"abc", 3, "http.request", False)]


@pytest.mark.parametrize("ending", ["disconnect", "body timeout"])
def test_a_body_cut_off_while_read_into_a_buffer_comes_short_then_as_a_disconnect(ending: str) -> None:
    results: list[tuple[bytes, int, dict[str, Any]]] = []

    async def main() -> None:
        real = FakeTransport()
        protocol = _protocol(_into_app(results), real)
        protocol.data_received(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n\r\n" + b"z" * 1000)
        await _turns()
        protocol.data_received(b"y" * 1500)
        await _turns()
        assert not results  # still waiting for the rest
        if ending == "disconnect":
            protocol.connection_lost(None)
        else:
            protocol._body_timed_out()
        await _turns()
        assert protocol.scope.get(BODY_TIMED_OUT, False) == (ending == "body timeout")

    asyncio.run(main())
    ((got, filled, last),) = results
    assert (got[:2500], filled, last["type"]) == (b"z" * 1000 + b"y" * 1500, 2500, "http.disconnect")
