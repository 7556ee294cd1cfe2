"""An HTTP process of a multi-process server (``DECONV_HTTP_PROCESSES`` > 1).

``python -m service.http.frontend --engine-socket PATH --connections-fd N`` (started by ``service.supervisor``) serves
HTTP exactly as a server of one process does (``service.http.server.serve``), with one difference: its engine is a
``service.engine.remote.RemoteEngine``, which sends each request to the engine process over the Unix socket at
PATH, instead of a ``LocalEngine`` of its own. It serves the connections the supervisor accepts and passes over
the Unix socket it inherited as file descriptor N.
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from service.config import configure_logging, load_settings
from service.engine.remote import RemoteEngine
from service.http.app import Companion
from service.http.server import serve


def main(argv: list[str] | None = None, companions: Sequence[Companion] = (),
         prog: str = "python -m service.http.frontend") -> None:
    """``python -m service.http.frontend --engine-socket PATH --connections-fd N``; ``companions`` serve beside
    the app (``service.http.app.Companion``: ``service.grpc.frontend`` passes the gRPC front end)."""
    parser = argparse.ArgumentParser(prog=prog,
                                     description="An HTTP process of a multi-process deconv server.")
    parser.add_argument("--engine-socket", required=True, help="the engine's Unix socket")
    parser.add_argument("--connections-fd", type=int, required=True,
                        help="inherited Unix socket over which the supervisor passes accepted connections")
    args = parser.parse_args(argv)
    settings = load_settings()
    configure_logging(settings, "http %(process)d")
    # The supervisor's private working directory holds the engine socket; the system shared-memory regions are kept
    # beside it, where every HTTP process sees them (service.http.shm_regions).
    regions_dir = Path(args.engine_socket).parent / "shm-regions"
    sys.exit(serve(settings, RemoteEngine(settings, args.engine_socket),
                   connections=socket.socket(fileno=args.connections_fd), regions_dir=regions_dir,
                   companions=companions))


if __name__ == "__main__":
    main()
