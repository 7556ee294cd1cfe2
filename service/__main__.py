"""``python -m service [--host H] [--port P]`` (script ``deconv-serve``): run the server with uvicorn.

Settings come from ``DECONV_*`` environment variables (docs/operations.md); ``--host``/``--port`` override
``DECONV_HOST``/``DECONV_PORT``. On SIGTERM or Ctrl-C the server turns not-ready at once (503 for new
requests), computes every request it holds, then stops accepting connections, sends the last answers and exits:
after SIGTERM with status 0 when every queued request was answered within the drain timeout, 1 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
from types import FrameType

import uvicorn
from pydantic import ValidationError

from service.app import Service, create_app
from service.config import Settings

log = logging.getLogger("deconv.service")


class _Server(uvicorn.Server):
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
            # by SIGTERM" (status 143) however complete the drain was; main() chooses the exit status instead.
            self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Keep listening until every accepted request has been computed: one arriving meanwhile is answered 503
        # instead of finding the port closed (or being reset from the listen backlog).
        await self.service.wait_idle(float(self.config.timeout_graceful_shutdown or 0))
        await super().shutdown(sockets)


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, build the app and serve until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m service", description="Serve the deconv layers over HTTP.")
    parser.add_argument("--host", help="interface to bind (default: DECONV_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to bind (default: DECONV_PORT or 8000)")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        sys.exit(f"invalid settings:\n{exc}")
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    app.state.service.freeze_gc = True  # this process is the server: freeze the start-up heap once ready
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level, lifespan="on",
        access_log=settings.access_log,
        # Requests in flight get up to the request timeout to finish after SIGTERM.
        timeout_graceful_shutdown=int(settings.request_timeout_s) + 5,
    )
    server = _Server(config, app.state.service)
    server.run()
    if not server.started:  # startup failed (invalid layer repository, devices missing): exit non-zero
        sys.exit(3)
    if not app.state.service.drained:  # requests were still queued when the drain timeout ran out
        sys.exit(1)


if __name__ == "__main__":
    main()
