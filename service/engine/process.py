"""The engine process of a multi-process server (``DECONV_HTTP_PROCESSES`` > 1): layers, batchers and workers.

``python -m service.engine.process --socket PATH`` (started by ``service.supervisor``, never by hand) runs the
``LocalEngine`` a server of one process serves HTTP on (repository check, kernels, self-tests, one batcher per layer,
worker threads on each device), without HTTP: the HTTP processes, each on a ``service.engine.remote.RemoteEngine``,
connect to the Unix socket at PATH and send it the requests they decoded (``service.ipc.frames``). Requests from every
HTTP process share one queue per layer, so they batch together.

Signals: SIGTERM drains (queued requests run at once, new ones get 503), waits for the HTTP processes to hang
up, and exits 0 when everything queued was answered (1 otherwise; 3 when the repository or devices are invalid).
SIGINT is left to the supervisor. When the supervisor dies (this process's stdin reaches end of file) the engine
drains and exits the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Coroutine
from typing import Any

from service.codec import RawTensor, SlotTensor
from service.config import Settings, configure_logging, load_settings
from service.engine.batcher import Batcher, Pending
from service.engine.interface import Result
from service.engine.local import LocalEngine
from service.engine.ops import HostPin
from service.engine.registry import RepositoryError
from service.errors import DeadlineExceededError, InternalError, ServiceError, UnknownLayerError
from service.ipc import frames, shm
from service.ipc.process import watch_parent

log = logging.getLogger("deconv.service")

GPU_SAMPLE_PERIOD_S = 1.0
# Longest wait for a new connection's HELLO (service.ipc.shm) before it is closed.
HANDSHAKE_TIMEOUT_S = 10.0


class EngineConnection(frames.FrameProtocol):
    """One HTTP process's connection: its requests in, their results out."""

    def __init__(self, server: EngineServer, arena: memoryview | None = None, pinned: bool = False) -> None:
        super().__init__()
        self.server = server
        self.arena = arena  # the HTTP process's shared memory (service.ipc.shm), mapped here; None: tensors inline
        self.pinned = pinned  # the arena is page-locked for the GPUs (ops.HostPin)
        self.pending: dict[int, tuple[Batcher, Pending]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.server.connections.add(self)
        self.server.engine.metrics.http_processes.set(len(self.server.connections))
        self.send(self.server.state_frame())

    def frame_received(self, kind: int, body: bytearray) -> None:
        if kind == frames.SUBMIT:
            self._submit(frames.parse_submit(body, self.arena))
        elif kind == frames.DROP:
            self._drop(*frames.parse_drop(body))
        elif kind == frames.CUDA_OPEN:
            call_id, token, handle, device, byte_size = frames.parse_cuda_open(body)
            self._call(call_id, self.server.engine.cuda_memory.open(token, handle, device, byte_size))
        elif kind == frames.SYSTEM_OPEN:
            call_id, token, key, offset, byte_size, dev, ino = frames.parse_system_open(body)
            self._call(call_id, self.server.engine.cuda_memory.open_system(token, key, offset, byte_size, dev, ino))
        elif kind == frames.CUDA_CLOSE:
            call_id, tokens = frames.parse_cuda_close(body)
            self._call(call_id, self.server.engine.cuda_memory.close(tokens))
        else:
            raise frames.ProtocolError(f"unexpected frame kind {kind} from an HTTP process")

    def _call(self, call_id: int, work: Coroutine[Any, Any, None]) -> None:
        """Run a call of the HTTP process (CUDA shared memory) and answer it: ``REPLY``, or ``ERROR``."""
        task = self.loop.create_task(work)
        self.server.calls.add(task)

        def answer(done: asyncio.Task[None]) -> None:
            self.server.calls.discard(done)
            if done.cancelled():
                return
            exc = done.exception()
            if exc is None:
                self.send(frames.reply_frame(call_id))
                return
            if not isinstance(exc, ServiceError):
                log.error("engine: a shared-memory call failed", exc_info=exc)
                exc = InternalError("the engine failed to map or unmap shared memory")
            self.send(frames.error_frame(call_id, exc))

        task.add_done_callback(answer)

    def _submit(self, req: frames.Submit) -> None:
        engine = self.server.engine
        try:
            names = self.server.layers
            if not 0 <= req.layer < len(names):
                raise UnknownLayerError(f"no layer with index {req.layer}")
            engine.readiness.check_ready()
            batcher = engine.batchers[names[req.layer]]
            x = req.x if req.out_offset is None else self._slot(req, batcher)
            item = batcher.submit(x, received=req.received, deadline=req.deadline, on_done=self._answer,
                                  key=req.request_id)
        except ServiceError as exc:
            self.send(frames.error_frame(req.request_id, exc))
            return
        self.pending[req.request_id] = (batcher, item)

    def _slot(self, req: frames.Submit, batcher: Batcher) -> SlotTensor:
        """The input of a ``SUBMIT`` with a slot, with the place of its output in the arena."""
        assert self.arena is not None  # parse_submit checked both
        assert req.out_offset is not None
        n, _, h, w = req.x.shape
        end = req.out_offset + batcher.layer.output_bytes(n, h, w)
        if end > self.arena.nbytes:
            raise frames.ProtocolError(f"output slot [{req.out_offset}, {end}) is outside the {self.arena.nbytes}-byte "
                                    "arena")
        return SlotTensor.of(req.x, self.arena[req.out_offset:end], self.pinned)

    def _answer(self, request_id: int, outcome: Result | BaseException | None) -> None:
        """The batcher's answer to a request (its ``Answer``): a result, an exception, or None when dropped."""
        entry = self.pending.pop(request_id, None)
        x = entry[1].x if entry is not None else None
        if outcome is None:  # dropped at its caller's request: nobody waits for it
            if isinstance(x, SlotTensor):
                self.send(frames.done_frame(request_id))  # the slot is the HTTP process's again
            return
        if isinstance(outcome, BaseException):
            error = outcome if isinstance(outcome, ServiceError) else InternalError("batch execution failed")
            self.send(frames.error_frame(request_id, error))
            return
        r = outcome  # (an output in a CUDA region, codec.DeviceTensor, goes as such: result_frame)
        shared = isinstance(x, SlotTensor) and isinstance(r.output, RawTensor) and r.output.data is x.out
        self.send(frames.result_frame(request_id, r.output, r.batch_samples, r.batch_requests, r.queue_s, r.worker,
                                   shared))

    def _drop(self, request_id: int, reason: str) -> None:
        entry = self.pending.get(request_id)
        if entry is None:  # already answered; the answer crossed the drop on the way
            return
        batcher, item = entry
        if batcher.drop(item, reason) and reason == "deadline":
            deadline_ms = 1e3 * ((item.deadline or item.enqueued) - item.enqueued)
            self.send(frames.error_frame(request_id, DeadlineExceededError.before_execution(deadline_ms)))

    def lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.server.engine.metrics.http_processes.set(len(self.server.connections))
        for batcher, item in list(self.pending.values()):  # the HTTP process is gone: nobody waits for these
            batcher.drop(item, "disconnected")
        self.pending.clear()
        if exc is not None:
            log.error("engine: an HTTP process's connection failed: %s", exc)


class EngineServer:
    """A ``LocalEngine`` without HTTP, serving the HTTP processes on a Unix socket."""

    def __init__(self, settings: Settings, socket_path: str) -> None:
        self.settings = settings
        self.engine = LocalEngine(settings, observe_queue_time=False)  # the HTTP processes observe it (RESULT)
        self.engine.readiness.freeze_gc = True
        self.socket_path = socket_path
        self.connections: set[EngineConnection] = set()
        self.layers: list[str] = []
        self.calls: set[asyncio.Task[None]] = set()  # CUDA shared-memory calls of the HTTP processes in progress

    def state_frame(self) -> list[bytes | memoryview]:
        """The ``STATE`` frame for the engine as it is now."""
        e = self.engine
        return frames.state_frame(e.readiness.state, e.readiness.reason, e.backend, self.layers,
                                  e.cuda_memory.available, e.cuda_memory.reason, e.cuda_memory.system_available)

    def _broadcast(self) -> None:
        frame = self.state_frame()
        for conn in list(self.connections):
            conn.send(frame)

    async def run(self) -> int:
        """Serve until SIGTERM (or the supervisor's death); the exit status."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which sends SIGTERM
        watch_parent(lambda: loop.call_soon_threadsafe(stop.set))
        try:
            await self.engine.start()
        except (RepositoryError, RuntimeError) as exc:
            if isinstance(exc, RuntimeError):
                log.error("%s", exc)
            return 3
        assert self.engine.registry is not None
        self.layers = self.engine.registry.names()
        self.engine.metrics.http_processes.set(0)  # counts connections from here on
        self.engine.readiness.listeners.append(self._broadcast)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket_path)
        listener.listen(64)
        listener.setblocking(False)
        accepting = loop.create_task(self._accept(listener))
        log.info("engine: serving %d layer(s) to the HTTP processes on %s", len(self.layers), self.socket_path)
        sampler = loop.create_task(self._sample_gpus())
        await stop.wait()
        log.info("engine: stopping")
        if self.calls:  # a mapping made after the engine stopped would stay
            await asyncio.gather(*self.calls, return_exceptions=True)
        await self.engine.stop()  # every queued request runs and is answered (or fails past the timeout)
        accepting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await accepting
        listener.close()
        # The HTTP processes hang up once they have sent their last answers; wait for them, bounded.
        deadline = time.monotonic() + self.engine.settings.request_timeout_s + 5
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.close()
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        return 0 if self.engine.drained else 1

    async def _accept(self, listener: socket.socket) -> None:
        """Accept the HTTP processes' connections (until cancelled), each after its HELLO."""
        loop = asyncio.get_running_loop()
        handshakes: set[asyncio.Task[None]] = set()
        try:
            while True:
                conn, _ = await loop.sock_accept(listener)
                task = loop.create_task(self._handshake(conn))
                handshakes.add(task)
                task.add_done_callback(handshakes.discard)
        finally:
            for task in handshakes:
                task.cancel()

    async def _handshake(self, conn: socket.socket) -> None:
        """Read a new connection's HELLO (mapping the arena it passes), then serve it as an ``EngineConnection``."""
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
        try:
            try:
                await asyncio.wait_for(readable, HANDSHAKE_TIMEOUT_S)
            finally:
                loop.remove_reader(conn.fileno())
            arena = shm.recv_hello(conn)
        except OSError as exc:  # no HELLO in time (TimeoutError), a bad one (HandshakeError), a failed mapping
            log.error("engine: refused a connection: %s",
                      f"no HELLO within {HANDSHAKE_TIMEOUT_S:g} s" if isinstance(exc, TimeoutError) else exc)
            conn.close()
            return
        except BaseException:  # the engine stopping
            conn.close()
            raise
        pinned = False
        if arena is not None and self.settings.ipc_shm_pinned and self._gpus():
            arena, pinned = await asyncio.to_thread(self._pin, arena)
        log.info("engine: an HTTP process connected (%s)", "tensors inline" if arena is None else
                 f"{arena.nbytes >> 20} MiB shared arena{', page-locked' if pinned else ''}")
        await loop.connect_accepted_socket(lambda: EngineConnection(self, arena, pinned), conn)

    def _gpus(self) -> bool:
        pool = self.engine.pool
        return pool is not None and any(w.is_cuda for w in pool.workers)

    @staticmethod
    def _pin(arena: memoryview) -> tuple[memoryview, bool]:
        """The arena page-locked for the GPUs (``ops.HostPin``: unlocked once the last view of it is gone), or as it
        is when the driver refuses (its tensors then go through staging memory)."""
        try:
            return HostPin(arena).view, True
        except RuntimeError as exc:
            log.warning("engine: could not page-lock a %d MiB arena (%s); its tensors go through staging memory",
                        arena.nbytes >> 20, exc)
            return arena, False

    async def _sample_gpus(self) -> None:
        while True:  # /metrics is served by the HTTP processes, which cannot read this process's GPU memory
            self.engine.metrics.sample_gpus()
            await asyncio.sleep(GPU_SAMPLE_PERIOD_S)


def main(argv: list[str] | None = None) -> None:
    """``python -m service.engine.process --socket PATH``."""
    parser = argparse.ArgumentParser(prog="python -m service.engine.process",
                                     description="The engine process of a multi-process deconv server.")
    parser.add_argument("--socket", required=True, help="Unix socket path to serve the HTTP processes on")
    args = parser.parse_args(argv)
    settings = load_settings()
    configure_logging(settings, "engine")
    try:  # the event loop uvicorn runs in the HTTP processes (uvicorn[standard]); asyncio's own otherwise
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        status = runner.run(EngineServer(settings, args.socket).run())
    sys.exit(status)


if __name__ == "__main__":
    main()
