"""The supervisor of a multi-process server: ``python -m service`` with ``DECONV_HTTP_PROCESSES`` = N > 1.

One Python process parses HTTP for every request, which limits a single-process server to a few thousand small
requests per second however fast the GPU is. Here the work is split:

* one **engine** process (``service.engine.process``): the ``LocalEngine`` a server of one process serves HTTP on
  (the layer repository, the self-tests, one batcher per layer and two worker threads a GPU), fed over a Unix socket
  instead of HTTP;
* N **HTTP** processes (``service.http.frontend``): the same HTTP code as a server of one process, on a
  ``RemoteEngine``: they serve the connections this process hands them, decode and validate tensors, and forward
  each request to the engine. Requests from every HTTP process share the engine's queues, so they batch together.

This process binds the port, starts the engine, waits for its socket, starts the HTTP processes, then accepts every
connection itself and passes it to the HTTP processes in turn (``ConnectionDispatcher``), and watches: on SIGTERM or
SIGINT it stops listening first (the port takes no new connection, the connections waiting in the backlog are
accepted and handed out, then the port closes, so that later clients are refused and can retry elsewhere:
``service.http.listening``), then passes the signal on as SIGTERM to every process (each drains: every accepted
connection is answered, 503 with ``Connection: close`` once the drain began; nothing accepted is lost or closed
unanswered), and if any process exits on its own the others are stopped and the supervisor exits non-zero, so that
whatever restarts the server (Docker's restart policy, Kubernetes) sees the failure. Children run in their own
session, so a Ctrl-C in a terminal reaches only the supervisor, and they stop by themselves if the supervisor dies
(their stdin, a pipe from it, reaches end of file). Metrics from all processes are merged through
prometheus-client's multiprocess mode (``service.metrics``).

Exit status: 0 when every process drained cleanly after SIGTERM/SIGINT, 3 when start-up failed (invalid layer
repository, devices missing, port in use), 1 otherwise.
"""

from __future__ import annotations

import logging
import os
import select
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
from service.http.listening import take_waiting
from service.ipc.process import SERVING

log = logging.getLogger("deconv.service")

ENGINE_START_TIMEOUT_S = 120.0  # the engine loads the repository before its socket appears (kernels build later)
HANDOVER_TIMEOUT_S = 1.0  # how long a connection waits for one HTTP process's channel before the next one is tried


class ConnectionDispatcher:
    """Accepts the port's connections on a thread and hands each to the next HTTP process, round robin.

    A connection travels as a file descriptor (SCM_RIGHTS) over the HTTP process's end of a Unix socket pair;
    from then on the HTTP process alone serves it. Handing out in turn keeps the processes evenly loaded under
    keep-alive clients. Listening sockets of their own would not: one socket shared by every process gives a burst
    of connections to whichever process wakes first (an event loop accepts all it can), and ``SO_REUSEPORT``
    spreads them by address hash, which left one process with twice the connections of another under 64 clients.

    A process gets connections only once it has said on its channel that it serves them (``SERVING``, sent when
    its start-up is done): a process still importing or connecting to the engine would leave a connection handed
    to it waiting for seconds. Until one process serves, connections wait in the listen backlog. A process whose
    channel is closed (it exited) is skipped from then on; one whose channel stays full for ``HANDOVER_TIMEOUT_S``
    is skipped for that connection. A connection no process takes is answered 503 here (``refuse``), never closed
    unanswered.
    """

    def __init__(self, listener: socket.socket, channels: list[socket.socket]) -> None:
        self.listener = listener
        self.channels: list[socket.socket | None] = list(channels)
        self.serving = [False] * len(channels)  # which processes said they serve
        self.handed_out = [0] * len(channels)  # connections given to each process
        self.refused = 0  # connections closed because no process took them
        self._next = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deconv-accept", daemon=True)

    def start(self) -> None:
        """Start accepting."""
        self.listener.settimeout(0.2)  # so that the thread sees stop() within that time
        for channel in self.channels:
            if channel is not None:
                channel.settimeout(HANDOVER_TIMEOUT_S)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting (connections waiting in the backlog are closed with the listener)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def stop_listening(self) -> None:
        """Stop accepting, stop taking new connections, hand out every connection waiting in the backlog, and close
        the listener (``service.http.listening.take_waiting``): from now on clients are refused (closing it with
        connections waiting would reset them, after they sent a request)."""
        self.stop()
        if self.listener.fileno() < 0:
            return
        try:
            take_waiting(self.listener, self._take)
        finally:
            self.listener.close()
        log.info("stopped listening: %d connection(s) answered here, none closed unanswered", self.refused)

    def _take(self, conn: socket.socket) -> None:
        with conn:  # this process's copy: the HTTP process that took it holds its own
            self._dispatch(conn)

    def _run(self) -> None:
        while not self._stop.is_set():
            open_channels = [i for i, c in enumerate(self.channels) if c is not None]
            starting = [i for i in open_channels if not self.serving[i]]
            if starting:
                serving_now = len(open_channels) > len(starting)
                self._hear_from(starting, 0.0 if serving_now else 0.2)
                if not serving_now and any(c is not None for c in self.channels):
                    continue  # nobody serves yet: connections wait in the backlog
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:  # out of file descriptors, or a connection reset while queued
                if self._stop.is_set():
                    return
                log.warning("accepting a connection failed: %s", exc)
                time.sleep(0.01)
                continue
            self._take(conn)

    def _dispatch(self, conn: socket.socket) -> None:
        """Hand ``conn`` to an HTTP process, or answer it 503 here when none takes it."""
        if self.hand_over(conn):
            return
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            log.error("no HTTP process took a connection (%d so far): answered 503", self.refused)
        refuse(conn)

    def _hear_from(self, indices: list[int], timeout_s: float) -> None:
        """Read what the starting processes ``indices`` sent (waiting up to ``timeout_s``): ``SERVING``, or the
        end of file of one that exited."""
        channels = {self.channels[i]: i for i in indices}
        readable, _, _ = select.select(list(channels), [], [], timeout_s)
        for channel in readable:
            index = channels[channel]
            try:
                data = channel.recv(64)
            except OSError:
                data = b""
            if not data:
                channel.close()
                self.channels[index] = None
            elif SERVING in data:
                self.serving[index] = True
                log.info("HTTP processes serving: %d of %d", sum(self.serving), len(self.channels))

    def hand_over(self, conn: socket.socket) -> bool:
        """Pass ``conn`` to the next HTTP process that takes it; whether one did."""
        count = len(self.channels)
        for _ in range(count):
            index = self._next
            self._next = (index + 1) % count
            channel = self.channels[index]
            if channel is None or not self.serving[index]:
                continue
            try:
                socket.send_fds(channel, [b"c"], [conn.fileno()])
            except TimeoutError:  # that process is not taking connections now: the next one
                continue
            except OSError:  # its end is closed: it exited or is shutting down
                channel.close()
                self.channels[index] = None
                continue
            self.handed_out[index] += 1
            return True
        return False


# What the supervisor answers a connection no HTTP process takes, and how long it reads what the client sends meanwhile
# (closing a socket with unread data resets it, and the client would see the reset instead of the answer).
_REFUSAL_BODY = b'{"error":"the server is shutting down; retry on another instance","type":"not_ready"}'
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
           b"content-length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\nconnection: close\r\n\r\n" + _REFUSAL_BODY)
REFUSAL_LINGER_S = 0.5
REFUSAL_LINGER_BYTES = 1 << 20


def refuse(conn: socket.socket) -> None:
    """Answer ``conn`` 503 with ``Connection: close`` and close it once the client has read it: what the client
    still sends is read and dropped until it closes, for at most ``REFUSAL_LINGER_S`` or ``REFUSAL_LINGER_BYTES``."""
    try:
        conn.settimeout(REFUSAL_LINGER_S)
        conn.sendall(REFUSAL)
        conn.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + REFUSAL_LINGER_S
        dropped = 0
        while dropped < REFUSAL_LINGER_BYTES and time.monotonic() < deadline:
            data = conn.recv(1 << 16)
            if not data:
                break
            dropped += len(data)
    except OSError:  # the client went, or is too slow: closed as it is
        pass


def supervise(settings: Settings) -> int:
    """Run the engine and ``settings.http_processes`` HTTP processes until SIGTERM/SIGINT; the exit status."""
    from prometheus_client.multiprocess import mark_process_dead

    from service.metrics import MULTIPROCESS_ENV

    signalled: list[int] = []

    def on_signal(sig: int, frame: FrameType | None) -> None:
        # Only a flag: the handler interrupts the main thread anywhere, and a lock it took (an Event's, logging's)
        # could be held by the code it interrupted. The main loop looks at the flag every 0.1 s.
        signalled.append(sig)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    try:
        listener = socket.create_server((settings.host, settings.port), backlog=4096)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
        return 3
    grpc_port: socket.socket | None = None
    if settings.grpc_port is not None:
        try:
            grpc_port = _reserve_port(settings.host, settings.grpc_port)
        except OSError as exc:
            listener.close()
            log.error("cannot listen for gRPC on %s:%d: %s", settings.host, settings.grpc_port, exc)
            return 3
    workdir = Path(tempfile.mkdtemp(prefix="deconv-"))  # mode 0700: only this user reaches the engine socket
    metrics_dir = workdir / "metrics"
    metrics_dir.mkdir()
    socket_path = workdir / "engine.sock"
    env = {**os.environ, MULTIPROCESS_ENV: str(metrics_dir)}
    frontend = "service.http.frontend"
    if grpc_port is not None:  # every HTTP process serves gRPC too, on the port reserved here
        frontend = "service.grpc.frontend"
        env.update(DECONV_HOST=settings.host, DECONV_GRPC_PORT=str(grpc_port.getsockname()[1]))

    def spawn(module: str, *args: str, fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdin=subprocess.PIPE,
                                pass_fds=fds, start_new_session=True)

    children: list[subprocess.Popen[bytes]] = []
    failed: subprocess.Popen[bytes] | None = None
    dispatcher: ConnectionDispatcher | None = None
    ours: list[socket.socket] = []  # this process's ends of the HTTP processes' connection channels
    try:
        engine = spawn("service.engine.process", "--socket", str(socket_path))
        children.append(engine)
        give_up = time.monotonic() + ENGINE_START_TIMEOUT_S
        while not socket_path.exists() and not signalled:
            if engine.poll() is not None or time.monotonic() > give_up:
                failed = engine
                break
            time.sleep(0.02)
        if failed is None and not signalled:
            host, port = listener.getsockname()[:2]
            for _ in range(settings.http_processes):
                mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                children.append(spawn(frontend, "--engine-socket", str(socket_path),
                                      "--connections-fd", str(theirs.fileno()), fds=(theirs.fileno(),)))
                theirs.close()  # its HTTP process holds it now
                ours.append(mine)
            dispatcher = ConnectionDispatcher(listener, ours)
            dispatcher.start()
            log.info("listening on http://%s:%d with %d HTTP processes (pids %s, connections handed out in turn) "
                     "feeding the engine (pid %d)", host, port, settings.http_processes,
                     ", ".join(str(c.pid) for c in children[1:]), engine.pid)
            while failed is None and not signalled:
                time.sleep(0.1)
                if not signalled:
                    failed = next((c for c in children if c.poll() is not None), None)
        if signalled:
            log.info("%s: stopping every process (each drains first)", signal.Signals(signalled[0]).name)
        if failed is not None:
            role = "the engine" if failed is engine else "an HTTP process"
            code = failed.poll()
            log.error("%s (pid %d) %s: stopping the server", role, failed.pid,
                      f"exited with status {code}" if code is not None else "did not start in time")
        if dispatcher is not None:  # later clients are refused; those waiting now are handed out first
            dispatcher.stop_listening()
        codes = _stop_all(children, settings.request_timeout_s + 15)
    finally:
        if dispatcher is not None:
            dispatcher.stop()
        for channel in ours:
            channel.close()
        listener.close()
        if grpc_port is not None:
            grpc_port.close()
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
            mark_process_dead(child.pid, str(metrics_dir))
        shutil.rmtree(workdir, ignore_errors=True)
    if failed is not None:
        return 3 if failed.returncode == 3 else 1
    return 0 if all(c == 0 for c in codes) else 1


def _reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT`` and not listening: it holds the gRPC port (0: a free
    one) for this server while each HTTP process listens on it with ``SO_REUSEPORT`` too; a port held by another
    program fails here, before anything starts."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _stop_all(children: list[subprocess.Popen[bytes]], timeout_s: float) -> list[int]:
    """SIGTERM every running child at once, wait up to ``timeout_s``, then SIGKILL; their exit statuses.

    A child that SIGTERM ended (status -SIGTERM) was still starting: the engine and the HTTP processes handle the
    signal, and drain, from before they take any work, so one that had not got that far had nothing to drain and
    counts as stopped cleanly (0).
    """
    signalled = set()
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            signalled.add(child.pid)
    deadline = time.monotonic() + timeout_s
    codes = []
    for child in children:
        try:
            code = child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("pid %d did not stop within %.0f s: killed", child.pid, timeout_s)
            child.kill()
            code = child.wait()
        if code == -signal.SIGTERM and child.pid in signalled:
            log.info("pid %d stopped while starting: nothing to drain", child.pid)
            code = 0
        codes.append(code)
    return codes
