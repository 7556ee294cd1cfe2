"""The load generator of ``--client raw``: keep-alive HTTP/1.1 connections in a closed loop (``RawLoad``, one
``RawClient`` a connection), speaking just enough HTTP for the load benchmarks."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable

import httpx
from deconv_client import CodecError

from bench.serving.wire import Wire, header

RECV_BYTES = 1 << 20  # a raw client's socket reads, at most


class RawClient(asyncio.BufferedProtocol):
    """One client of ``--client raw``: a keep-alive HTTP/1.1 connection in a closed loop, speaking just enough HTTP
    for this benchmark.

    httpx costs about 1 ms of client CPU per request, several times what the server spends on one: above a few
    thousand requests/s the load generators, not the server, become the limit. Here a response is parsed as it
    arrives and the next request leaves from there (``RawLoad.send_next``): no task, coroutine, future or timer per
    request (a quarter to a third less CPU a request than a coroutine per request; docs/operations.md, "The load
    generator in a closed loop"). The socket is read into one reused buffer (``asyncio.BufferedProtocol``) and a
    body's bytes are only counted, unless a sample is wanted: with megabyte answers, copying each one out of the
    socket's chunks (into a ``bytes`` a chunk, then into the response's buffer) made the load generators the limit
    (bench/NOTES.md, "Megabyte answers: the load generator's own copies").
    """

    def __init__(self, load: RawLoad, slot: int = 0) -> None:
        self.load = load
        self.slot = slot  # which client this connection serves (its request body; shm: its region)
        self.transport: asyncio.Transport | None = None
        self.sent_at = 0.0  # perf_counter() when the request in flight left; 0.0: none in flight
        self.finished = False  # no more requests for this client
        self._chunk = memoryview(bytearray(RECV_BYTES))  # what the socket is read into
        self._buf = bytearray()  # the response's head until complete; then its body, when kept
        self._head: bytes | None = None  # the response's head, lower-cased, once complete
        self._length = 0  # the response body's length
        self._need = 0  # body bytes still to come
        self._keep = False  # whether this body is kept (a sample is wanted)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (asyncio's or uvloop's)
        self.load.send(self)  # the request this connection was opened for (RawLoad._connect)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._chunk

    def buffer_updated(self, nbytes: int) -> None:
        data = self._chunk[:nbytes]
        while data and self.transport is not None:
            if self._head is None:
                data = self._head_part(data)  # what follows the head, once complete
                if self._head is None:
                    return  # more of the head to come, or a bad one
            else:
                take = min(len(data), self._need)
                if self._keep:
                    self._buf += data[:take]
                self._need -= take
                data = data[take:]
            if not self._need:  # the response is complete
                head, body = self._head, bytes(self._buf) if self._keep else b""
                self._head = None
                self._buf.clear()
                self.load.answered(self, head, body, self._length)

    def _head_part(self, data: memoryview) -> memoryview:
        """Take ``data`` into the response's head; once it is complete (``_head`` set), what follows it."""
        buf = self._buf
        seen = len(buf)
        buf += data
        end = buf.find(b"\r\n\r\n", max(0, seen - 3))
        if end < 0:
            return data[len(data):]
        head = bytes(buf[:end + 2]).lower()  # each header line ends with \r\n
        rest = data[end + 4 - seen:]
        buf.clear()
        length = header(head, b"content-length")
        if not head.startswith(b"http/1.1 ") or not length or not length.isdigit():
            self.fail(ValueError(f"bad response head {head[:80]!r}"))
            return data[len(data):]
        self._head, self._length, self._need = head, int(length), int(length)
        self._keep = self.load.want_sample
        return rest

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.load.lost(self, exc)

    def fail(self, exc: BaseException) -> None:
        """Count the request in flight as failed with ``exc`` and drop the connection."""
        self.load.count_error(self, exc)
        self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # connection_lost follows
            self.transport = None


class RawLoad:
    """``count`` requests from ``clients`` ``RawClient`` connections; every failure is counted under its exception's
    name (a timeout, a refused or lost connection, a malformed response) and the client goes on with a new
    connection, as long as requests remain (and, with ``max_seconds``, until that long after ``run`` began).

    ``wire`` (a protocol's requests, one body a client slot or one for all) replaces ``path``, ``payload`` and
    ``content_type``; a 200 answer whose length lies outside its ``answer_bytes`` counts as ``wrong_size``, and
    ``sample`` is the first 200 answer's output as its ``decode`` reads it (the body itself without a wire).
    """

    def __init__(self, url: str, path: str, payload: bytes, content_type: str, count: int, timeout: float,
                 wire: Wire | None = None, max_seconds: float | None = None) -> None:
        u = httpx.URL(url)
        self.host, self.port, self.timeout = u.host, u.port or 80, timeout
        extra = ""
        if wire is not None:
            path, content_type, bodies = wire.path, wire.content_type, wire.bodies
            extra = "".join(f"{k}: {v}\r\n" for k, v in wire.headers.items())
        else:
            bodies = [payload]
        self.requests = [(f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: {content_type}\r\n{extra}"
                          f"content-length: {len(body)}\r\n\r\n").encode() + body for body in bodies]
        self.answer_bytes = wire.answer_bytes if wire is not None else (0, math.inf)
        self.decode = wire.decode if wire is not None else None
        self.max_seconds = max_seconds
        self.stop_at = math.inf  # perf_counter() after which no request leaves (set by run)
        self.remaining = count
        self.latencies: list[float] = []
        self.batch_sizes: list[int] = []
        self.statuses: Counter[str] = Counter()  # status code, or the name of the exception that failed a request
        self.sample = b""
        self.want_sample = True
        self.clients: set[RawClient] = set()
        self._running = 0  # clients not finished
        self._tasks: set[asyncio.Task[None]] = set()
        self._finished: asyncio.Future[None] | None = None
        self._watchdog: asyncio.TimerHandle | None = None

    async def run(self, clients: int) -> None:
        """Until every request was answered or failed."""
        loop = asyncio.get_running_loop()
        self._finished = loop.create_future()
        self._running = clients
        if self.max_seconds is not None:
            self.stop_at = time.perf_counter() + self.max_seconds
        for slot in range(clients):
            self._connect(loop, slot)
        self._watchdog = loop.call_later(min(1.0, self.timeout / 4), self._watch, loop)
        try:
            await self._finished
        finally:
            self._watchdog.cancel()
            for client in list(self.clients):
                client.close()

    def send_next(self, client: RawClient) -> None:
        """Send ``client``'s next request, or finish it when none remain (or time is up)."""
        if self.remaining <= 0 or time.perf_counter() >= self.stop_at:
            self._finish(client)
            return
        self.remaining -= 1
        self.send(client)

    def send(self, client: RawClient) -> None:
        """Send a request (already counted off ``remaining``) on ``client``'s connection."""
        assert client.transport is not None
        client.sent_at = time.perf_counter()
        client.transport.write(self.requests[client.slot % len(self.requests)])

    def answered(self, client: RawClient, head: bytes, body: bytes, length: int) -> None:
        """A complete response to ``client``'s request, of ``length`` body bytes (``body``: them, while a sample
        is wanted)."""
        if not client.sent_at:  # nothing was asked on this connection
            client.fail(ValueError("a response without a request"))
            return
        dt = time.perf_counter() - client.sent_at
        client.sent_at = 0.0
        status = head[9:12].decode("latin-1")
        if status == "200" and not self.answer_bytes[0] <= length <= self.answer_bytes[1]:
            status = "wrong_size"
        if status == "200" and self.want_sample:
            try:
                self.sample = body if self.decode is None else self.decode(client.slot, head, body)
                self.want_sample = False
            except (ValueError, KeyError, IndexError, TypeError, CodecError) as exc:
                status = f"bad_answer {type(exc).__name__}"
        self.statuses[status] += 1
        if status == "200":
            self.latencies.append(dt)
            batch = header(head, b"x-deconv-batch-size")
            self.batch_sizes.append(int(batch) if batch else 1)
        if header(head, b"connection") == b"close":
            client.close()  # the next request goes out on a new connection (lost())
        else:
            self.send_next(client)

    def count_error(self, client: RawClient, exc: BaseException) -> None:
        """Count ``client``'s request in flight, if any, as failed with ``exc``."""
        if client.sent_at:
            client.sent_at = 0.0
            self.statuses[type(exc).__name__] += 1

    def lost(self, client: RawClient, exc: Exception | None) -> None:
        """``client``'s connection is gone: its request in flight failed; it goes on with a new connection."""
        self.count_error(client, exc or asyncio.IncompleteReadError(b"", None))
        self.clients.discard(client)
        if not client.finished:
            client.finished = True  # this connection's client lives on in the new one
            self._connect(asyncio.get_running_loop(), client.slot)

    def _finish(self, client: RawClient) -> None:
        if not client.finished:
            client.finished = True
            client.close()
            self._client_done()

    def _client_done(self) -> None:
        self._running -= 1
        if self._running == 0 and self._finished is not None and not self._finished.done():
            self._finished.set_result(None)

    def _connect(self, loop: asyncio.AbstractEventLoop, slot: int) -> None:
        """Open a connection for client ``slot``'s next request (counted off ``remaining`` now), or finish the
        client."""
        if self.remaining <= 0 or time.perf_counter() >= self.stop_at:
            self._client_done()
            return
        self.remaining -= 1
        task = loop.create_task(self._open(loop, slot))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open(self, loop: asyncio.AbstractEventLoop, slot: int) -> None:
        try:
            _, client = await asyncio.wait_for(
                loop.create_connection(lambda: RawClient(self, slot), self.host, self.port), self.timeout)
        except (OSError, asyncio.TimeoutError) as exc:  # the request it was for fails; the client tries again
            self.statuses[type(exc).__name__] += 1
            self._connect(loop, slot)
            return
        if not client.finished:
            self.clients.add(client)

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        now = time.perf_counter()
        for client in list(self.clients):
            if client.sent_at and now - client.sent_at > self.timeout:
                client.fail(asyncio.TimeoutError())
        if self._finished is not None and not self._finished.done():
            self._watchdog = loop.call_later(min(1.0, self.timeout / 4), self._watch, loop)


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (as with the service's ``uvicorn[standard]``), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
