"""uvicorn, run so that a shutdown drains: ``serve(settings, engine)`` is how every process that serves HTTP
runs, a server of one process on a ``LocalEngine`` (``python -m service``) and each HTTP process of a multi-process
server on a ``RemoteEngine`` (``service.http.frontend``)."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import socket
from collections.abc import Callable, Iterable, Sequence
from http import HTTPStatus
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.config import Settings
from service.engine.interface import Engine, wait_idle
from service.errors import HeadersTooLargeError, NotReadyError, RequestTimeoutError, ServiceError
from service.http.app import Companion, create_app
from service.http.asgi import ANSWER_NOW, BODY_INTO, BODY_TIMED_OUT, ON_DISCONNECT, error_reply
from service.http.listening import take_waiting
from service.ipc.process import SERVING

if TYPE_CHECKING:
    from starlette.types import Scope

log = logging.getLogger("deconv.service")
MAX_FDS_PER_MESSAGE = 16


class CoalescingTransport(asyncio.Transport):
    """A connection's transport whose writes during one event-loop iteration leave in one system call.

    uvicorn writes a response's status line and headers, then its body, each with its own ``write``: on a
    TCP_NODELAY socket that is two system calls and two segments the client wakes up for. Here the writes are
    queued and handed to the real transport together (``writelines``) at the end of the iteration; ``close``,
    ``write_eof`` and ``abort`` see the queue first. Everything else is the real transport's.
    """

    def __init__(self, transport: asyncio.Transport, keep_open: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        self._out: list[bytes | bytearray | memoryview] = []
        self._keep_open = keep_open  # asked at close: True when the protocol closes the connection itself, later

    def write(self, data: bytes | bytearray | memoryview) -> None:  # type: ignore[override]
        if not data:
            return
        if not self._out:
            self._loop.call_soon(self._flush)
        self._out.append(data)

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:  # type: ignore[override]
        for data in list_of_data:
            self.write(data)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and not self._transport.is_closing():
            self._transport.writelines(out)

    def close(self) -> None:
        self._flush()
        if self._keep_open is not None and self._keep_open():
            return
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._out = []
        self._transport.abort()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(d) for d in self._out)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()


# After refusing a request whose client is still sending (431, 408), how long and how much of it is read and
# dropped before the connection closes.
LINGER_S = 2.0
LINGER_BYTES = 64 * 2**20


class HTTPProtocol(HttpToolsProtocol):  # type: ignore[misc]
    """uvicorn's HTTP protocol (httptools) on a ``CoalescingTransport`` (one write per response instead of two),
    with the limits uvicorn leaves out.

    uvicorn bounds only the idle time between requests (``timeout_keep_alive``); with httptools nothing bounds the
    size of a request's head, the time to send it, or the time to send a body (h11's
    ``h11_max_incomplete_event_size`` bounds the head only, and h11 costs far more CPU per request). So here:

    - a request head (request line and headers) larger than ``max_header_bytes`` is answered 431;
    - a head not complete ``header_timeout_s`` after the connection opened, or after the request's first byte, is
      answered 408;
    - a body not complete ``body_timeout_s`` after its head is answered 408 (the application sees the client
      gone, with ``BODY_TIMED_OUT`` in the scope; a body still arriving after an early answer just closes);

    and each time the connection closes. ``serve`` sets the limits from the settings (class attributes, as uvicorn
    builds the protocol itself).

    A request's body can also be read straight into a buffer the application chooses (``read_into``, in the scope
    as ``BODY_INTO``): uvicorn joins the pieces the parser hands over into its own buffer, and each ``receive``
    copies that again into a new ``bytes``; here, while the application waits in ``read_into``, each piece is copied
    once, into the application's buffer, and nothing collects in between.
    """

    max_header_bytes = 64 * 2**10
    header_timeout_s = 10.0
    body_timeout_s = 30.0
    draining = False  # set on the server's own subclass once its drain began (DrainingServer)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(CoalescingTransport(transport, self._linger_at_close))  # type: ignore[arg-type]
        self._linger_next_close = False  # answer_now: the next close lingers instead
        self._head_bytes = 0
        self._awaiting_head = True  # every byte received now belongs to a request head
        self._head_started = False  # a request's first byte is in and its head is not complete
        self._in_body = False
        self._lingering = False
        self._lingered = 0
        self._heads = 0  # request heads completed on this connection
        self._timer: asyncio.TimerHandle | None = self.loop.call_later(self.header_timeout_s, self._head_timed_out)
        # The application's buffer that the body's pieces go into (read_into), how much of it is filled, and the
        # future its wait ends with.
        self._sink: memoryview | None = None
        self._sunk = 0
        self._sink_done: asyncio.Future[int] | None = None
        # What to call when the client goes (on_disconnect); None once it has.
        self._on_gone: set[Callable[[], None]] | None = set()
        if self.draining:  # accepted as the server stopped listening: its request, whenever it comes, gets the 503
            self._refuse(NotReadyError("the server is shutting down; retry on another instance"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)
        self._end_sink()
        on_gone, self._on_gone = self._on_gone, None
        for callback in on_gone or ():
            callback()

    def on_disconnect(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once the connection is lost (soon, when it is already), for any request of this
        connection (in the scope as ``ON_DISCONNECT``: a request waiting for its result needs no task of its own to
        learn that its client went); returns what stops that."""
        on_gone = self._on_gone
        if on_gone is None:
            handle = self.loop.call_soon(callback)
            return handle.cancel
        on_gone.add(callback)
        return functools.partial(on_gone.discard, callback)

    async def read_into(self, scope: Scope, view: memoryview) -> int:
        """Fill ``view`` (writable bytes) with the next bytes of the body of ``scope``'s request: first those the
        connection holds already, then each piece as it arrives, copied once, straight from the parser.

        Returns the count written: all of ``view`` unless the body ended, the client went or the body timed out
        first (the next ``receive`` then says which). A request that is not this connection's current one gets only
        what the connection holds of its body.
        """
        cycle = self.cycle
        if cycle is None or cycle.scope is not scope:
            return 0
        filled = 0
        held = cycle.body  # what the parser handed over before the application asked (uvicorn's bytearray)
        if held:
            filled = min(len(held), view.nbytes)
            with memoryview(held) as pieces:
                view[:filled] = pieces[:filled]
            del held[:filled]
        if filled == view.nbytes or not cycle.more_body or cycle.disconnected or self._sink is not None:
            return filled
        self._sink, self._sunk = view, filled
        self._sink_done = done = self.loop.create_future()
        self.flow.resume_reading()  # uvicorn pauses past its high-water mark: nothing collects now
        try:
            return await done
        finally:
            if self._sink_done is done:  # cancelled while waiting
                self._sink, self._sink_done = None, None

    def answer_now(self, scope: Scope) -> bool:
        """Whether the application may answer ``scope``'s request now, before its body has all come (a refusal:
        401, 429, 503...), with ``Connection: close`` (in the scope as ``ANSWER_NOW``). True: once that answer is
        written the connection drops what the client still sends of the body, for up to ``LINGER_S`` or
        ``LINGER_BYTES``, then closes, so that the client reads the answer rather than a reset, and a client that
        asked for ``100 Continue`` is never told to send. False: the body is all here (or the request is not this
        connection's current one): the application reads the rest and the connection may be kept."""
        cycle = self.cycle
        if cycle is None or cycle.scope is not scope or not cycle.more_body or cycle.disconnected:
            return False
        self._linger_next_close = True
        return True

    def _linger_at_close(self) -> bool:
        """The transport's close hook: linger instead (``answer_now``), once."""
        if not self._linger_next_close or self._lingering:
            return False
        self._linger_next_close = False
        self._linger()
        return True

    def _end_sink(self) -> None:
        """Hand the application waiting in ``read_into`` the count written, and stop writing into its buffer at once
        (what the parser hands over next, of this body or a pipelined request's, goes to uvicorn as usual)."""
        done = self._sink_done
        if done is not None:
            self._sink, self._sink_done = None, None
            if not done.done():
                done.set_result(self._sunk)

    def on_body(self, body: bytes) -> None:
        sink = self._sink
        if sink is None:
            super().on_body(body)
            return
        start = self._sunk
        end = min(start + len(body), sink.nbytes)  # never past it: the buffer is the body's remaining length
        sink[start:end] = memoryview(body)[:end - start]
        self._sunk = end
        if end - start < len(body):
            super().on_body(body[end - start:])
        if end == sink.nbytes:
            self._end_sink()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # refused: what the client still sends is dropped (bounded) so that it reads the answer
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES:
                self.transport.close()
            return
        awaiting_head, heads = self._awaiting_head, self._heads
        super().data_received(data)
        if awaiting_head and self._heads == heads:  # no head completed in it: all of it was head, count it
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                self._refuse(HeadersTooLargeError(f"the request line and headers exceed {self.max_header_bytes} "
                                                  "bytes"))
        elif self._in_body and self._timer is None:  # a body that did not come with its head
            self._timer = self.loop.call_later(self.body_timeout_s, self._body_timed_out)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_started = True
        if self._timer is None:
            self._timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._cancel_timer()
        self._awaiting_head = self._head_started = False
        self._head_bytes = 0
        self._heads += 1
        self._in_body = True
        self.scope[BODY_INTO] = self.read_into  # type: ignore[literal-required]
        self.scope[ON_DISCONNECT] = self.on_disconnect  # type: ignore[literal-required]
        self.scope[ANSWER_NOW] = self.answer_now  # type: ignore[literal-required]
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._cancel_timer()
        self._in_body = False
        self._awaiting_head = True
        super().on_message_complete()
        self._end_sink()

    def _refuse(self, error: ServiceError, path: str = "/") -> None:
        """Write ``error``'s answer with ``Connection: close``, then close: at once when the client sends nothing
        more, else after dropping what it still sends for up to ``LINGER_S`` / ``LINGER_BYTES`` (closing a socket
        with unread data resets the connection, and the client would see the reset instead of the answer)."""
        self._cancel_timer()
        if self.transport.is_closing() or self._lingering:
            return
        reply = error_reply(error, path)
        head = (f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\ncontent-type: {reply.media_type}\r\n"
                f"content-length: {len(reply.body)}\r\nconnection: close\r\n\r\n")
        self.transport.write(head.encode() + reply.body)
        self._linger()

    def _linger(self) -> None:
        """The answer is written: end the sending side, drop what the client still sends for up to ``LINGER_S`` /
        ``LINGER_BYTES``, then close."""
        self._cancel_timer()
        self._lingering = True
        self._end_sink()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._timer = self.loop.call_later(LINGER_S, self.transport.close)

    def _head_timed_out(self) -> None:
        self._timer = None
        if self.cycle is None or self.cycle.response_complete:
            self._refuse(RequestTimeoutError(f"no complete request head within {self.header_timeout_s:g} s"))
        else:  # a pipelined request behind one still being answered
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._timer = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and not cycle.disconnected:
            cycle.scope[BODY_TIMED_OUT] = True  # type: ignore[literal-required]
            cycle.disconnected = True  # the application's reads see the client gone, its answer goes nowhere
            cycle.message_event.set()
            self._end_sink()
            self._refuse(RequestTimeoutError(f"the body did not arrive within {self.body_timeout_s:g} s"),
                         cycle.scope["path"])
        else:
            self.transport.close()

    def shutdown(self) -> None:
        """uvicorn's shutdown (it closes a connection between requests), but a request whose head is arriving is
        let in and answered (503 while draining, with ``Connection: close``) instead of reset; the header
        timeout bounds the wait. A connection refused already closes once its client has read the answer
        (``_refuse``)."""
        if self._lingering or (self._head_started and (self.cycle is None or self.cycle.response_complete)):
            return
        super().shutdown()

    def begin_drain(self) -> None:
        """The server drains: a connection between requests that has served some is closed (a kept-alive one); one
        that has served none yet, whose client has just connected to send one, is answered 503 with
        ``Connection: close``; any other closes after its current answer."""
        if self.transport.is_closing() or self._lingering:
            return
        if not self._head_started and (self.cycle is None or self.cycle.response_complete):
            if self._heads:
                self.transport.close()
            else:
                self._refuse(NotReadyError("the server is shutting down; retry on another instance"))
        elif self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
        # (a head still arriving: the application answers it with Connection: close)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the engine to drain as soon as the shutdown signal arrives.

    With ``connections`` (an HTTP process of a multi-process server) it has no listening socket: it serves the
    connections the supervisor accepted and passes over that Unix socket (``service.supervisor``).
    """

    def __init__(self, config: uvicorn.Config, engine: Engine, connections: socket.socket | None = None) -> None:
        super().__init__(config)
        self.engine = engine
        self.connections = connections
        self._handovers: set[asyncio.Task[object]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channel_open = False  # connections are read from the supervisor's channel (non-blocking)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.connections is None:
            await super().startup(sockets)
            return
        await super().startup(sockets=[])  # the app's start-up, and no listener of its own
        self.connections.setblocking(False)
        asyncio.get_running_loop().add_reader(self.connections.fileno(), self._take_connections)
        self._channel_open = True
        if not self.should_exit:  # (a SIGTERM during start-up: no connections for a process about to stop)
            self.connections.send(SERVING)  # the supervisor hands this process connections from now on

    def _take_connections(self) -> None:
        """Serve every connection waiting on the channel (one file descriptor per message)."""
        assert self.connections is not None
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.connections, 64, MAX_FDS_PER_MESSAGE)
            except BlockingIOError:
                return
            except OSError as exc:
                log.error("connection channel from the supervisor failed: %s", exc)
                self._close_channel()
                return
            if not data and not fds:  # the supervisor closed it (it exited): nothing more comes
                self._close_channel()
                return
            for fd in fds:
                self._serve_connection(socket.socket(fileno=fd))

    def _serve_connection(self, sock: socket.socket) -> None:
        """Serve ``sock``, a connection accepted elsewhere (by the supervisor, or from the backlog at the drain)."""
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.connect_accepted_socket(self._protocol, sock))
        self._handovers.add(task)
        task.add_done_callback(self._handed_over)

    def _protocol(self) -> asyncio.Protocol:
        # What uvicorn's own listeners create per connection (Server.startup's create_protocol).
        return self.config.http_protocol_class(  # type: ignore[call-arg,no-any-return]
            config=self.config, server_state=self.server_state, app_state=self.lifespan.state)

    def _handed_over(self, task: asyncio.Task[object]) -> None:
        self._handovers.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the client left before it was served
            log.debug("a handed-over connection could not be served: %s", task.exception())

    def _close_channel(self) -> None:
        self._channel_open = False
        if self.connections is not None and self.connections.fileno() >= 0:
            asyncio.get_running_loop().remove_reader(self.connections.fileno())
            self.connections.close()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()  # before uvicorn installs its signal handlers
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler runs in the main thread between two bytecodes of whatever it interrupted, which may hold a
        # lock that the drain takes: prometheus-client's (one lock for every metric of a process in multiprocess
        # mode, not reentrant), held while an HTTP process creates its metrics at start-up. Setting the readiness
        # gauge from here then waited for that lock forever and the process never stopped. So only flags here; the
        # drain begins on the event loop, at its next iteration.
        if sig in (signal.SIGTERM, signal.SIGINT) and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._begin_drain)
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            # uvicorn re-raises the signals it caught once it has shut down, which ends the process as "killed
            # by SIGTERM" (status 143) however complete the drain was; serve() chooses the exit status instead.
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    def _begin_drain(self) -> None:
        """On the event loop, after SIGTERM/SIGINT: the engine refuses new work (503), the server stops listening
        (later clients find the port closed, which they can retry elsewhere), then the connections drain; every
        connection accepted from now on, from the listen backlog or the supervisor, is answered 503."""
        self.engine.begin_drain()
        self.config.http_protocol_class.draining = True  # type: ignore[attr-defined]
        self._stop_listening()
        if self._channel_open:
            self._take_connections()  # handed over already: answered 503, never closed unread
        self._drain_connections()

    def _stop_listening(self) -> None:
        """Close the listening sockets once they take no new connection and every connection waiting in their
        backlog is accepted (``service.http.listening.take_waiting``: closing a listener resets those, and a client
        that sent its request would see the reset, not an answer); a client connecting meanwhile is refused."""
        for server in getattr(self, "servers", ()):  # (none yet when the signal came during start-up)
            for listening in server.sockets or ():
                take_waiting(listening, self._serve_connection)
            server.close()

    def _drain_connections(self) -> None:
        """Close the connections between requests; the others close after their current answer (every answer
        from now on says ``Connection: close``: ``service.http.asgi.App``)."""
        for connection in list(self.server_state.connections):
            if isinstance(connection, HTTPProtocol):
                connection.begin_drain()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # The listeners closed when the drain began (_begin_drain): wait until every accepted request has been
        # computed, then close what is left.
        await wait_idle(self.engine, float(self.config.timeout_graceful_shutdown or 0))
        if self._channel_open:
            self._take_connections()  # those still in it are answered 503 (the supervisor stopped handing out)
        self._close_channel()
        await super().shutdown(sockets)


def serve(settings: Settings, engine: Engine, connections: socket.socket | None = None,
          regions_dir: Path | None = None, companions: Sequence[Companion] = ()) -> int:
    """Serve the app (``service.http.app.create_app``) on ``engine`` until SIGTERM/SIGINT: the connections passed
    over ``connections``, or else on the settings' host and port. ``regions_dir``, ``companions``: as
    ``create_app``'s.

    Returns the exit status: 0 after a complete drain, 1 when requests were still queued when the drain timeout
    ran out, 3 when start-up failed (invalid layer repository, devices missing).
    """
    protocol = type("HTTPProtocol", (HTTPProtocol,), {
        "max_header_bytes": settings.max_header_bytes, "header_timeout_s": settings.header_timeout_s,
        "body_timeout_s": settings.body_timeout_s})
    engine.readiness.freeze_gc = True  # this process serves: freeze the start-up heap once ready
    app = create_app(settings, engine, regions_dir, companions)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level, lifespan="on",
        # uvicorn formats each access line's arguments before the logger's level is asked: above info, no line.
        access_log=settings.access_log and settings.log_level in ("info", "debug"), http=protocol,
        # Requests in flight get up to the request timeout to finish after SIGTERM.
        timeout_graceful_shutdown=int(settings.request_timeout_s) + 5,
    )
    server = DrainingServer(config, engine, connections)
    server.run()
    if not server.started:
        return 3
    return 0 if engine.drained else 1
