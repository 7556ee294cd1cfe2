"""An HTTP process of a multi-process server that serves the gRPC API too (``DECONV_GRPC_PORT`` set).

``python -m service.grpc.frontend --engine-socket PATH --connections-fd N``, started by ``service.supervisor`` in
place of ``service.http.frontend``: the same process (``service.http.frontend.main``), with the gRPC front end
(``service.grpc.server.serving``) beside its HTTP app, on its ``RemoteEngine``, its shared-memory regions and its
budget. Every HTTP process listens on the gRPC port (``SO_REUSEPORT``: the kernel spreads the connections over
them), which the supervisor holds bound meanwhile, so that the port is this server's.
"""

from __future__ import annotations

import functools

from service.grpc.server import serving
from service.http import frontend


def main(argv: list[str] | None = None) -> None:
    """``python -m service.grpc.frontend --engine-socket PATH --connections-fd N``."""
    shared_port = functools.partial(serving, reuse_port=True)  # every HTTP process listens on the one port
    frontend.main(argv, companions=[shared_port], prog="python -m service.grpc.frontend")


if __name__ == "__main__":
    main()
