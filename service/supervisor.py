"""The supervisor of a multi-process server: ``python -m service`` with ``DECONV_HTTP_PROCESSES`` = N > 1.

One Python process parses HTTP for every request, which limits a single-process server to a few thousand small
requests per second however fast the GPU is. Here the work is split:

* one **engine** process (``service.engine``): the layer repository, the self-tests, one batcher per layer and one
  worker per GPU, exactly as in a single-process server, but fed over a Unix socket instead of HTTP;
* N **HTTP** processes (``service.frontend``): accept connections on the port (each on its own listening
  socket, bound here with SO_REUSEPORT, so that the kernel spreads connections evenly), decode and validate
  tensors, and forward each request to the engine. Requests from every HTTP process share the engine's queues, so
  they batch together.

This process binds the port, starts the engine, waits for its socket, starts the HTTP processes and then only
watches: SIGTERM or SIGINT is passed on as SIGTERM to every process (each drains: nothing accepted is lost), and if
any process exits on its own the others are stopped and the supervisor exits non-zero, so that whatever restarts
the server (Docker's restart policy, Kubernetes) sees the failure. Children run in their own session, so a Ctrl-C
in a terminal reaches only the supervisor, and they stop by themselves if the supervisor dies (their stdin, a pipe
from it, reaches end of file). Metrics from all processes are merged through prometheus-client's multiprocess
mode (``service.metrics``).

Exit status: 0 when every process drained cleanly after SIGTERM/SIGINT, 3 when start-up failed (invalid layer
repository, devices missing, port in use), 1 otherwise.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType

from service.config import Settings

log = logging.getLogger("deconv.service")

ENGINE_START_TIMEOUT_S = 120.0  # the engine loads the repository before its socket appears (kernels build later)


def supervise(settings: Settings) -> int:
    """Run the engine and ``settings.http_processes`` HTTP processes until SIGTERM/SIGINT; the exit status."""
    from prometheus_client.multiprocess import mark_process_dead

    from service.metrics import MULTIPROCESS_ENV

    stop = threading.Event()

    def on_signal(sig: int, frame: FrameType | None) -> None:
        log.info("%s: stopping every process (each drains first)", signal.Signals(sig).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    try:
        listeners = _listen(settings.host, settings.port, settings.http_processes)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
        return 3
    workdir = Path(tempfile.mkdtemp(prefix="deconv-"))  # mode 0700: only this user reaches the engine socket
    metrics_dir = workdir / "metrics"
    metrics_dir.mkdir()
    socket_path = workdir / "engine.sock"
    env = {**os.environ, MULTIPROCESS_ENV: str(metrics_dir)}

    def spawn(module: str, *args: str, fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdin=subprocess.PIPE,
                                pass_fds=fds, start_new_session=True)

    children: list[subprocess.Popen[bytes]] = []
    failed: subprocess.Popen[bytes] | None = None
    try:
        engine = spawn("service.engine", "--socket", str(socket_path))
        children.append(engine)
        give_up = time.monotonic() + ENGINE_START_TIMEOUT_S
        while not socket_path.exists() and not stop.is_set():
            if engine.poll() is not None or time.monotonic() > give_up:
                failed = engine
                break
            time.sleep(0.02)
        if failed is None and not stop.is_set():
            host, port = listeners[0].getsockname()[:2]
            for listener in listeners:
                fd = listener.fileno()
                children.append(spawn("service.frontend", "--engine-socket", str(socket_path), "--fd", str(fd),
                                      fds=(fd,)))
                listener.close()  # its HTTP process holds it now: the port closes when the last of them exits
            log.info("listening on http://%s:%d with %d HTTP processes (pids %s) feeding the engine (pid %d)",
                     host, port, settings.http_processes, ", ".join(str(c.pid) for c in children[1:]), engine.pid)
            while failed is None and not stop.wait(0.1):
                failed = next((c for c in children if c.poll() is not None), None)
        if failed is not None:
            role = "the engine" if failed is engine else "an HTTP process"
            code = failed.poll()
            log.error("%s (pid %d) %s: stopping the server", role, failed.pid,
                      f"exited with status {code}" if code is not None else "did not start in time")
        codes = _stop_all(children, settings.request_timeout_s + 15)
    finally:
        for listener in listeners:
            listener.close()
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
            mark_process_dead(child.pid, str(metrics_dir))
        shutil.rmtree(workdir, ignore_errors=True)
    if failed is not None:
        return 3 if failed.returncode == 3 else 1
    return 0 if all(c == 0 for c in codes) else 1


def _listen(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` listening sockets on one port (SO_REUSEPORT), one per HTTP process.

    The kernel spreads new connections over them by address hash. One socket shared by every process would hand
    a burst of connections to whichever process wakes first (an event loop accepts all it can), leaving the
    others idle under keep-alive clients.
    """
    first = socket.create_server((host, port), backlog=4096, reuse_port=True)
    sockets = [first]
    try:
        bound = first.getsockname()[1]  # the port chosen when port is 0
        for _ in range(count - 1):
            sockets.append(socket.create_server((host, bound), backlog=4096, reuse_port=True))
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _stop_all(children: list[subprocess.Popen[bytes]], timeout_s: float) -> list[int]:
    """SIGTERM every running child at once, wait up to ``timeout_s``, then SIGKILL; their exit statuses."""
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    codes = []
    for child in children:
        try:
            codes.append(child.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            log.error("pid %d did not stop within %.0f s: killed", child.pid, timeout_s)
            child.kill()
            codes.append(child.wait())
    return codes
