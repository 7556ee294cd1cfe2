"""``python -m service [--host H] [--port P]`` (script ``deconv-serve``): run the server with uvicorn.

Settings come from ``DECONV_*`` environment variables (docs/operations.md; ``--help`` lists each with its default,
from ``service.config.Settings``); ``--host``/``--port`` override ``DECONV_HOST``/``DECONV_PORT``. On SIGTERM or
Ctrl-C the server turns not-ready at once (503 for new requests), computes every request it holds, then stops
accepting connections, sends the last answers and exits: after SIGTERM with status 0 when every queued request was
answered within the drain timeout, 1 otherwise.

``DECONV_HTTP_PROCESSES`` (default ``auto``: ``service.config.auto_http_processes``, the count logged at start) = 1:
this process serves HTTP on a ``LocalEngine`` (batchers and worker threads in this process). N > 1: it becomes the
supervisor of one engine process and N HTTP processes (``service.supervisor``), each serving the same HTTP on a
``RemoteEngine``, with the same signals and exit statuses.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from service.config import VERSION, Settings, configure_logging, load_settings

log = logging.getLogger("deconv.service")

ENV_PREFIX = "DECONV_"


def program_name(argv0: str | None = None) -> str:
    """How the server was started: ``deconv-serve`` (the script) or ``python -m service``."""
    name = Path(argv0 if argv0 is not None else sys.argv[0]).name
    return name if name.startswith("deconv-serve") else "python -m service"


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, float):
        return f"{value:g}"
    if value == "":
        return '""'
    return str(value)


def settings_help(width: int = 100) -> str:
    """Every ``DECONV_*`` setting with its default and description, from ``Settings`` (the ``--help`` epilog)."""
    lines = ["settings (environment variables; docs/operations.md describes each):"]
    for name, field in Settings.model_fields.items():
        lines.append(f"  {ENV_PREFIX}{name.upper()}={_default(field.get_default(call_default_factory=True))}")
        lines += textwrap.wrap(field.description or "", width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    lines.append("read by the kernels (README, docs/deploy.md): DECONV_KERNEL_CACHE (their build cache, default "
                 "~/.cache/deconv/kernels), DECONV_CUDA_ARCH (the architectures to build for), DECONV_BUILD_VERBOSE=1 "
                 "(show the compiler's output)")
    return "\n".join(lines)


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of ``deconv-serve`` / ``python -m service``."""
    p = argparse.ArgumentParser(prog=prog or program_name(), description="Serve the deconv layers over HTTP.",
                                epilog=settings_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", help="interface to bind (default: DECONV_HOST or 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default: DECONV_PORT or 8000)")
    p.add_argument("--version", action="version", version=f"%(prog)s {VERSION}")
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, build the app and serve until SIGTERM/SIGINT."""
    args = parser().parse_args(argv)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = load_settings(**overrides)
    problem = check_repository(settings)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(3)
    processes = settings.http_processes
    if processes > 1:
        from service.supervisor import supervise

        configure_logging(settings, "supervisor")
        log.info("HTTP processes: %d (%s)", processes, settings.http_processes_rule)
        os.environ["DECONV_HTTP_PROCESSES"] = str(processes)  # the count the children read, chosen once here
        sys.exit(supervise(settings))
    configure_logging(settings)
    log.info("HTTP processes: 1 (%s)", settings.http_processes_rule)
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
