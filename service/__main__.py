"""``python -m service [--host H] [--port P]`` (script ``deconv-serve``): run the server with uvicorn.

Settings come from ``DECONV_*`` environment variables (docs/operations.md); ``--host``/``--port`` override
``DECONV_HOST``/``DECONV_PORT``. On SIGTERM or Ctrl-C the server turns not-ready at once (503 for new
requests), computes every request it holds, then stops accepting connections, sends the last answers and exits:
after SIGTERM with status 0 when every queued request was answered within the drain timeout, 1 otherwise.

With ``DECONV_HTTP_PROCESSES`` = 1 (the default) this process serves HTTP on a ``LocalEngine`` (batchers and worker
threads in this process). With N > 1 it becomes the supervisor of one engine process and N HTTP processes
(``service.supervisor``), each serving the same HTTP on a ``RemoteEngine``, with the same signals and exit statuses.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from service.config import Settings, configure_logging, load_settings

log = logging.getLogger("deconv.service")


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, build the app and serve until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m service", description="Serve the deconv layers over HTTP.")
    parser.add_argument("--host", help="interface to bind (default: DECONV_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to bind (default: DECONV_PORT or 8000)")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = load_settings(**overrides)
    problem = check_repository(settings)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(3)
    if settings.http_processes > 1:
        from service.supervisor import supervise

        configure_logging(settings, "supervisor")
        sys.exit(supervise(settings))
    configure_logging(settings)
    from service.engine.local import LocalEngine
    from service.http.server import serve

    companions = []
    if settings.grpc_port is not None:  # the KServe v2 gRPC API beside HTTP, on the same engine
        from service.grpc.server import serving

        companions.append(serving)
    status = serve(settings, LocalEngine(settings), companions=companions)  # as each HTTP process of N does
    if status:
        sys.exit(status)


def check_repository(settings: Settings) -> str | None:
    """Why the layer repository cannot be served (one line per problem), or None when it can.

    Run before anything starts, so that a wrong path or an invalid layer is a short message and exit status 3
    rather than a failed application start-up. Reads the configs and the weights files' headers only.
    """
    from service.engine.registry import RepositoryError, batch_limits, load_repository

    root = settings.layer_repository
    if not root.is_dir():
        given = os.environ.get("DECONV_LAYER_REPOSITORY")
        source = f" (DECONV_LAYER_REPOSITORY={given}, from {os.getcwd()})" if given else ""
        return f"layer repository {root} is not a directory{source}"
    try:
        load_repository(root, batch_limits(settings), weights=False)
    except RepositoryError as exc:
        return str(exc)
    return None


if __name__ == "__main__":
    main()
