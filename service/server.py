"""uvicorn, run so that a shutdown drains: shared by ``python -m service`` and the HTTP processes of a
multi-process server (``service.frontend``)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Iterable
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from service.app import Service
from service.config import Settings
from service.supervisor import SERVING

log = logging.getLogger("deconv.service")
MAX_FDS_PER_MESSAGE = 16


class CoalescingTransport(asyncio.Transport):
    """A connection's transport whose writes during one event-loop iteration leave in one system call.

    uvicorn writes a response's status line and headers, then its body, each with its own ``write``: on a
    TCP_NODELAY socket that is two system calls and two segments the client wakes up for. Here the writes are
    queued and handed to the real transport together (``writelines``) at the end of the iteration; ``close``,
    ``write_eof`` and ``abort`` see the queue first. Everything else is the real transport's.
    """

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self._transport = transport
        self._loop = asyncio.get_running_loop()
        self._out: list[bytes | bytearray | memoryview] = []

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


class HTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]  # httptools' protocol, or h11's without it
    """uvicorn's HTTP protocol on a ``CoalescingTransport``: one write per response instead of two."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(CoalescingTransport(transport))  # type: ignore[arg-type]


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the service to drain as soon as the shutdown signal arrives.

    With ``connections`` (an HTTP process of a multi-process server) it has no listening socket: it serves the
    connections the supervisor accepted and passes over that Unix socket (``service.supervisor``).
    """

    def __init__(self, config: uvicorn.Config, service: Service, connections: socket.socket | None = None) -> None:
        super().__init__(config)
        self.service = service
        self.connections = connections
        self._handovers: set[asyncio.Task[object]] = set()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.connections is None:
            await super().startup(sockets)
            return
        await super().startup(sockets=[])  # the app's start-up, and no listener of its own
        self.connections.setblocking(False)
        asyncio.get_running_loop().add_reader(self.connections.fileno(), self._take_connections)
        if not self.should_exit:  # (a SIGTERM during start-up: no connections for a process about to stop)
            self.connections.send(SERVING)  # the supervisor hands this process connections from now on

    def _take_connections(self) -> None:
        """Serve every connection waiting on the channel (one file descriptor per message)."""
        assert self.connections is not None
        loop = asyncio.get_running_loop()
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
                task = loop.create_task(loop.connect_accepted_socket(self._protocol, socket.socket(fileno=fd)))
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
        if self.connections is not None and self.connections.fileno() >= 0:
            asyncio.get_running_loop().remove_reader(self.connections.fileno())
            self.connections.close()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig in (signal.SIGTERM, signal.SIGINT):
            self.service.begin_drain()
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            # uvicorn re-raises the signals it caught once it has shut down, which ends the process as "killed
            # by SIGTERM" (status 143) however complete the drain was; serve() chooses the exit status instead.
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Keep listening until every accepted request has been computed: one arriving meanwhile is answered 503
        # instead of finding the port closed (or being reset from the listen backlog).
        await self.service.wait_idle(float(self.config.timeout_graceful_shutdown or 0))
        self._close_channel()  # connections still in it are closed; the supervisor hands new ones to others
        await super().shutdown(sockets)


def serve(app: FastAPI, settings: Settings, connections: socket.socket | None = None) -> int:
    """Serve ``app`` until SIGTERM/SIGINT: the connections passed over ``connections``, or else on the settings'
    host and port.

    Returns the exit status: 0 after a complete drain, 1 when requests were still queued when the drain timeout
    ran out, 3 when start-up failed (invalid layer repository, devices missing).
    """
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level, lifespan="on",
        access_log=settings.access_log, http=HTTPProtocol,
        # Requests in flight get up to the request timeout to finish after SIGTERM.
        timeout_graceful_shutdown=int(settings.request_timeout_s) + 5,
    )
    service: Service = app.state.service
    server = DrainingServer(config, service, connections)
    server.run()
    if not server.started:
        return 3
    return 0 if service.drained else 1
