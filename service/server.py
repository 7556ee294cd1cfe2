"""uvicorn, run so that a shutdown drains: shared by ``python -m service`` and the HTTP processes of a
multi-process server (``service.frontend``)."""

from __future__ import annotations

import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from service.app import Service
from service.config import Settings


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the service to drain as soon as the shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service

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
        await super().shutdown(sockets)


def serve(app: FastAPI, settings: Settings, sockets: list[socket.socket] | None = None) -> int:
    """Serve ``app`` until SIGTERM/SIGINT, on ``sockets`` or else on the settings' host and port.

    Returns the exit status: 0 after a complete drain, 1 when requests were still queued when the drain timeout
    ran out, 3 when start-up failed (invalid layer repository, devices missing).
    """
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level, lifespan="on",
        access_log=settings.access_log,
        # Requests in flight get up to the request timeout to finish after SIGTERM.
        timeout_graceful_shutdown=int(settings.request_timeout_s) + 5,
    )
    service: Service = app.state.service
    server = DrainingServer(config, service)
    server.run(sockets=sockets)
    if not server.started:
        return 3
    return 0 if service.drained else 1
