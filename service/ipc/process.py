"""What the processes of a multi-process server tell each other outside the frame protocol (``service.ipc.frames``):
an HTTP process's word to the supervisor that it serves, and a child's watch on its supervisor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable

log = logging.getLogger("deconv.service")

SERVING = b"s"  # what an HTTP process sends on its channel once it serves the connections handed to it


def watch_parent(on_exit: Callable[[], object]) -> None:
    """Call ``on_exit()`` (from a thread) when stdin, a pipe held by the supervisor, reaches end of file."""
    if sys.stdin is None or sys.stdin.isatty():
        return

    def wait() -> None:
        # os.read, not sys.stdin: a daemon thread blocked inside a buffered reader aborts interpreter shutdown.
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        log.warning("the supervisor is gone: shutting down")
        on_exit()

    threading.Thread(target=wait, name="deconv-parent-watch", daemon=True).start()
