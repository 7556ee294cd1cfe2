"""The remote engine: ``RemoteEngine`` serves an HTTP process of a multi-process server (``DECONV_HTTP_PROCESSES`` >
1) from the engine process (``service.engine.process``), one of the two ``service.engine.interface.Engine``\\ s.

Each layer's ``RemoteQueue`` sends the requests the HTTP layer decoded and validated to the engine process over its
Unix socket (``service.ipc.frames``), their tensors through this process's shared-memory arena when they fit
(``service.ipc.shm``); the engine's batcher of the layer queues them with every other HTTP process's requests, and
the answers come back the same way. The layer registry is read here too (shapes only: the engine holds the weights)
so that requests are validated and layers described without a round trip.

Readiness mirrors the engine's (its ``STATE`` frames), so ``/health/ready`` is 200 only once the engine's
self-tests passed. Drain: 503 for new requests, every request sent to the engine is still answered. If the engine
connection is lost, the requests waiting on it fail with 500 and the process reports not ready.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import socket
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from service.codec import AnyTensor, CudaJob, RawTensor, SourceTensor, bytes_of
from service.config import Settings
from service.engine.interface import LayerQueue, Readiness, Result, wait_idle
from service.engine.registry import Layer, Registry, load_registry
from service.errors import InternalError, NotReadyError
from service.faults import Faults
from service.ipc import frames, shm
from service.ipc.process import watch_parent
from service.metrics import Metrics, update_lock

log = logging.getLogger("deconv.service")

CONNECT_TIMEOUT_S = 30.0


class Slot(NamedTuple):
    """A request's place in the arena, held until the engine's last word on it: the slot to give back (``start``),
    where the output goes and its size, and the input's bytes when they lie in a slot of their own (a body read
    into the arena), kept alive so that their slot is not given back before."""

    start: int
    out_offset: int
    out_bytes: int
    held_input: memoryview | None


class RemotePending:
    """A request sent to the engine: ``queued`` until answered or given up (``dropping``: a deadline drop was
    asked for and the engine's answer, 504 or the result, is awaited; ``dropped``: nobody waits any more)."""

    __slots__ = ("future", "request_id", "state")

    def __init__(self, request_id: int, future: asyncio.Future[Result]) -> None:
        self.request_id = request_id
        self.future = future
        self.state = "queued"

    @property
    def started(self) -> bool:
        """Whether the engine will answer without a further deadline check here."""
        return self.state != "queued"


class EngineClient(frames.FrameProtocol):
    """This process's connection to the engine: requests out, results and state in."""

    def __init__(self, engine: RemoteEngine, arena: shm.Arena | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.pending: dict[int, tuple[RemotePending, torch.dtype, Any]] = {}  # id -> entry, dtype, queue histogram
        self.ids = itertools.count(1)
        self.arena = arena  # this process's shared memory, mapped by the engine too (None: tensors inline)
        # Requests holding a slot of the arena, until the engine's last word on them. A request given up on keeps
        # its slot here until then (service.ipc.shm).
        self.slots: dict[int, Slot] = {}
        self.calls: dict[int, asyncio.Future[None]] = {}  # CUDA shared-memory calls waiting for the engine's answer
        paths = engine.metrics.ipc_requests
        self.sent_shared, self.sent_inline, self.sent_cuda = paths.labels("shared"), paths.labels("inline"), \
            paths.labels("cuda")

    def frame_received(self, kind: int, body: bytearray) -> None:
        if kind == frames.RESULT:
            request_id = frames.result_id(body)
            entry = self.pending.pop(request_id, None)
            slot = self.slots.pop(request_id, None)
            try:
                if entry is not None and not entry[0].future.done():
                    out = frames.parse_result(body, entry[1], None if slot is None else self._output_view(slot))
                    y = out.y
                    if out.shared and slot is not None and self.arena is not None:
                        # The answer is the slot's bytes, which hold the slot until they are written (shm.Arena.lend).
                        y = RawTensor(self.arena.lend(slot.start, slot.out_offset, y.data.nbytes), y.dtype, y.shape)
                        slot = None
                    entry[2].observe(out.queue_s)  # the engine leaves the queue-time histogram to this process
                    entry[0].future.set_result(Result(y, out.batch_samples, out.batch_requests, out.queue_s,
                                                      out.worker))
            finally:
                self._release(slot)
        elif kind == frames.ERROR:
            request_id, error = frames.parse_error(body)
            self._release(self.slots.pop(request_id, None))
            entry = self.pending.pop(request_id, None)
            if entry is not None and not entry[0].future.done():
                entry[0].future.set_exception(error)
            call = self.calls.pop(request_id, None)
            if call is not None and not call.done():
                call.set_exception(error)
        elif kind == frames.REPLY:
            call = self.calls.pop(frames.result_id(body), None)
            if call is not None and not call.done():
                call.set_result(None)
        elif kind == frames.DONE:
            self._release(self.slots.pop(frames.result_id(body), None))
        elif kind == frames.STATE:
            self.engine.engine_state(frames.parse_state(body))
        else:
            raise frames.ProtocolError(f"unexpected frame kind {kind} from the engine")

    def _output_view(self, slot: Slot) -> memoryview:
        assert self.arena is not None
        return self.arena.view[slot.out_offset:slot.out_offset + slot.out_bytes]

    def _release(self, slot: Slot | None) -> None:
        if slot is not None and self.arena is not None:
            self.arena.free(slot.start)

    def send_input(self, request_id: int, layer: Layer, index: int, x: AnyTensor | SourceTensor | CudaJob,
                   received: float, deadline: float | None) -> None:
        """Send a ``SUBMIT``: through the arena when there is room, else with the input's bytes. An input whose
        bytes lie in the arena already (a body read into ``RemoteEngine.body_buffer``) is named where it is, with a
        slot for the output, and held until the engine's last word on the request; any other input is copied into
        a slot for it and its output. An input still at its source (``SourceTensor``) is read straight into the
        slot, or into a copy to send inline. A request in CUDA shared memory (``CudaJob``) only names its regions.

        Raises:
            ServiceError: the source could not be read (nothing is sent, the slot is given back).
        """
        arena = self.arena
        if isinstance(x, CudaJob):  # its tensors are in CUDA regions (an input from the host travels inline)
            self.send(frames.submit_frame(request_id, index, x, received, deadline))
            self.sent_cuda.inc()
            return
        if arena is not None:
            data = None if isinstance(x, SourceTensor) else bytes_of(x)
            nbytes = x.nbytes if data is None else data.nbytes
            n, _, h, w = x.shape
            out_bytes = layer.output_bytes(int(n), int(h), int(w))
            in_place = None if data is None else arena.offset_of(data)
            if in_place is not None:  # only the output needs a slot; without room for it the input goes inline
                start = arena.alloc(out_bytes)
                if start is not None:
                    self.slots[request_id] = Slot(start, start, out_bytes, data)
                    self.send(frames.submit_frame(request_id, index, x, received, deadline, (in_place, start)))
                    self.sent_shared.inc()
                    return
            else:
                in_bytes = shm.aligned(nbytes)
                start = arena.alloc(in_bytes + out_bytes)
                if start is not None:
                    try:
                        if data is None:
                            x.fill(arena.view[start:start + nbytes])
                        else:
                            arena.view[start:start + nbytes] = data
                    except BaseException:
                        arena.free(start)
                        raise
                    self.slots[request_id] = Slot(start, start + in_bytes, out_bytes, None)
                    self.send(frames.submit_frame(request_id, index, x, received, deadline,
                                                  (start, start + in_bytes)))
                    self.sent_shared.inc()
                    return
        if isinstance(x, SourceTensor):
            x = x.load()
        self.send(frames.submit_frame(request_id, index, x, received, deadline))
        self.sent_inline.inc()

    def protocol_error(self, exc: frames.ProtocolError) -> None:
        log.error("engine connection: %s", exc)
        super().protocol_error(exc)

    async def call(self, call_id: int, frame: list[bytes | memoryview]) -> None:
        """Send a CUDA shared-memory call (``call_id`` from ``self.ids``, in its frame) and wait for the engine's
        answer.

        Raises:
            ServiceError: the engine's error; ``NotReadyError`` when the engine is gone.
        """
        if self.transport is None or self.transport.is_closing():
            raise NotReadyError("the engine process is not connected", retry_after_s=5.0)
        future = self.calls[call_id] = self.loop.create_future()
        self.send(frame)
        await future

    def lost(self, exc: Exception | None) -> None:
        error = InternalError("the engine process stopped before answering; retry")
        for item, _, _ in self.pending.values():
            if not item.future.done():
                item.future.set_exception(error)
        self.pending.clear()
        for call in self.calls.values():
            if not call.done():
                call.set_exception(error)
        self.calls.clear()
        self.slots.clear()
        self.arena = None  # the engine is gone: nothing more goes through it
        self.engine.engine_lost(exc)


class RemoteQueue:
    """A layer's ``LayerQueue`` in an HTTP process: each request goes to the engine's batcher of the layer."""

    # An input may come still at its source (codec.SourceTensor): read when sent, into the arena when it fits.
    takes_sources = True

    def __init__(self, layer: Layer, index: int, client: EngineClient) -> None:
        self.layer = layer
        self.index = index  # the layer's position in the engine's list (checked against the engine's STATE)
        self.client = client
        self._queue_time = client.engine.metrics.queue_time.labels(layer.name)
        self._draining = False

    @property
    def depth(self) -> int:
        """Requests queued here: none (the queue is in the engine)."""
        return 0

    def begin_drain(self) -> None:
        """Refuse new requests from now on; those sent are still answered."""
        self._draining = True

    def submit(self, x: AnyTensor | SourceTensor, *, received: float | None = None,
               deadline: float | None = None) -> RemotePending:
        """Send ``x`` ([n, C_in, H, W], validated) to the engine; the returned entry's future gets the answer.

        Raises:
            NotReadyError: draining, or the engine connection is gone (503).
        """
        if self._draining:
            raise NotReadyError("server is shutting down")
        client = self.client
        if client.transport is None or client.transport.is_closing():
            raise NotReadyError("the engine process is not connected", retry_after_s=5.0)
        item = RemotePending(next(client.ids), client.loop.create_future())
        client.pending[item.request_id] = (item, x.dtype, self._queue_time)
        try:
            client.send_input(item.request_id, self.layer, self.index, x,
                              time.monotonic() if received is None else received, deadline)
        except BaseException:
            del client.pending[item.request_id]
            raise
        return item

    def drop(self, item: RemotePending, reason: str) -> bool:
        """Give up on a request: the engine takes it out of its queue if it has not run yet.

        Returns True when nobody waits for it any more; False for ``"deadline"``, whose outcome the engine
        decides (504 if it was still queued, else its result), and for a request already answered.
        """
        if item.state != "queued" or item.future.done():
            return False
        self.client.send(frames.drop_frame(item.request_id, reason))
        if reason == "deadline":
            item.state = "dropping"
            return False
        item.state = "dropped"
        self.client.pending.pop(item.request_id, None)
        item.future.cancel()
        return True


class RemoteCudaMemory:
    """The engine process's CUDA shared memory, from an HTTP process (``CudaMemory``): its availability from the
    engine's ``STATE`` frames, ``open``, ``open_system`` and ``close`` as ``CUDA_OPEN``, ``SYSTEM_OPEN`` and
    ``CUDA_CLOSE`` calls."""

    def __init__(self, engine: RemoteEngine) -> None:
        self._engine = engine
        self.available = False
        self.reason = "CUDA shared memory is not ready: waiting for the engine process"
        self.system_available = False

    def _client(self) -> EngineClient:
        client = self._engine.client
        if client is None:
            raise NotReadyError("the engine process is not connected", retry_after_s=5.0)
        return client

    async def open(self, token: str, handle: bytes, device: int, byte_size: int) -> None:
        """Ask the engine to map a client's allocation (``CudaMemory.open``)."""
        client = self._client()
        call_id = next(client.ids)
        await client.call(call_id, frames.cuda_open_frame(call_id, token, handle, device, byte_size))

    async def open_system(self, token: str, key: str, offset: int, byte_size: int, dev: int, ino: int) -> None:
        """Ask the engine to map and page-lock a client's system region (``CudaMemory.open_system``)."""
        client = self._client()
        call_id = next(client.ids)
        await client.call(call_id, frames.system_open_frame(call_id, token, key, offset, byte_size, dev, ino))

    async def close(self, tokens: list[str]) -> None:
        """Ask the engine to unmap these registrations' allocations (``CudaMemory.close``)."""
        if tokens:
            client = self._client()
            call_id = next(client.ids)
            await client.call(call_id, frames.cuda_close_frame(call_id, tokens))


class RemoteEngine:
    """The engine of an HTTP process: the layer repository (to validate and describe) and the engine process's link
    (the module docstring)."""

    def __init__(self, settings: Settings, engine_socket: str) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.readiness = Readiness(self.metrics, "starting: waiting for the engine process")
        self.registry: Registry | None = None
        self.backend = ""
        self.drained = False
        self.engine_socket = engine_socket
        self.client: EngineClient | None = None
        self.cuda_memory = RemoteCudaMemory(self)
        self._queues: dict[str, RemoteQueue] = {}
        self._faults = Faults.from_spec(settings.faults) if settings.test_mode else Faults()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._heard = asyncio.Event()  # the engine's first STATE came, its link was lost, or the drain began

    @property
    def queues(self) -> Mapping[str, LayerQueue]:
        """Each layer's queue, by name."""
        return self._queues

    @property
    def idle(self) -> bool:
        """Whether every request sent to the engine has been answered."""
        return self.client is None or not self.client.pending

    def body_buffer(self, nbytes: int) -> memoryview | None:
        """A slot of this process's arena, lent until its last view is gone: a tensor decoded in it goes to the
        engine by reference (``EngineClient.send_input``). None without an arena or when none is free."""
        arena = self.client.arena if self.client is not None else None
        if arena is None:
            return None
        start = arena.alloc(nbytes)
        return None if start is None else arena.lend(start, start, nbytes)

    def begin_drain(self) -> None:
        """Refuse new work (503 from now on); requests sent are still answered (``Engine.begin_drain``)."""
        if self.readiness.begin_drain():
            self._faults.begin_drain()
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._drain_now)

    def _drain_now(self) -> None:
        waiting = len(self.client.pending) if self.client is not None else 0
        log.info("draining: not ready any more; waiting for the engine to answer %d request(s)", waiting)
        for queue in self._queues.values():
            queue.begin_drain()
        self.readiness.notify()
        self._heard.set()

    async def start(self) -> None:
        """Load the repository (the same files as the engine), connect to the engine and wait for its state.

        The process serves only once it knows the engine's state: its readiness, and whether it maps CUDA and system
        shared memory (what ``/v2`` advertises). The engine sends it once it has mapped and page-locked this
        process's arena.

        Raises:
            RepositoryError: the layer repository is invalid.
            ConnectionError: the engine socket did not accept a connection, or the engine sent no state, within
                ``CONNECT_TIMEOUT_S``.
        """
        self._loop = loop = asyncio.get_running_loop()
        parent_gone = asyncio.Event()

        def on_parent_gone() -> None:
            parent_gone.set()
            _terminate()

        watch_parent(lambda: loop.call_soon_threadsafe(on_parent_gone))
        self.registry = load_registry(self.settings, weights=False)  # the engine holds the weights; shapes suffice
        arena = self._arena()
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                sock = _connect(self.engine_socket, arena)
                _, client = await loop.create_unix_connection(lambda: EngineClient(self, arena), sock=sock)
                break
            except OSError as exc:
                if self.readiness.state == "draining":  # stopped while starting (the engine died, or a SIGTERM)
                    log.info("stopped before the engine was reached: %s", exc)
                    return
                if time.monotonic() > deadline or parent_gone.is_set():
                    raise ConnectionError(f"no engine at {self.engine_socket}: {exc}") from exc
                await asyncio.sleep(0.05)
        assert isinstance(client, EngineClient)
        if arena is not None:
            arena.close()  # the engine got its own descriptor with the HELLO; mappings outlive descriptors
        self.client = client
        self._faults.hold_startup(update_lock())  # test mode only: where a SIGTERM once hung the process
        for index, layer in enumerate(self.registry):
            queue = self._queues[layer.name] = RemoteQueue(layer, index, client)
            if self.readiness.state == "draining":  # the drain began while this process was connecting
                queue.begin_drain()
        try:
            await asyncio.wait_for(self._heard.wait(), CONNECT_TIMEOUT_S)
        except TimeoutError:
            raise ConnectionError(f"the engine at {self.engine_socket} sent no state within "
                                  f"{CONNECT_TIMEOUT_S:g} s") from None

    def _arena(self) -> shm.Arena | None:
        """This process's shared memory for the engine link (``Settings.ipc_shm_bytes``), or None."""
        size = self.settings.ipc_shm_bytes // shm.ALIGN * shm.ALIGN
        if size == 0:
            log.info("engine link: tensors travel through the engine socket (DECONV_IPC_SHM_BYTES=0)")
            return None
        try:
            return shm.Arena(size)
        except OSError as exc:
            log.warning("engine link: no shared memory (%s); tensors travel through the engine socket", exc)
            return None

    def engine_state(self, state: dict[str, Any]) -> None:
        """Take over the engine's readiness (unless this process is draining, or failed on its own)."""
        assert self.registry is not None
        self._heard.set()
        self.backend = str(state["backend"])
        self.cuda_memory.available = bool(state.get("cuda_shm", False))
        self.cuda_memory.reason = str(state.get("cuda_shm_reason", ""))
        self.cuda_memory.system_available = bool(state.get("system_shm", False))
        if state["layers"] != self.registry.names():
            new, reason = "failed", (f"the engine serves layers {state['layers']}, this process "
                                     f"{self.registry.names()}: the repository changed while starting; restart")
        else:
            new, reason = str(state["state"]), str(state["reason"])
        if self.readiness.state == "failed" and new != "failed":
            return
        self.readiness.set(new, reason)

    def engine_lost(self, exc: Exception | None) -> None:
        """The engine connection closed: not ready from now on (the supervisor stops the server)."""
        self._heard.set()
        if self.readiness.state != "draining":
            log.error("the engine connection was lost%s; not ready", f": {exc}" if exc else "")
            self.readiness.set("failed", "the engine process is gone")

    async def stop(self) -> None:
        """Refuse new work and wait (bounded by the request timeout) until the engine answered what was sent."""
        self.begin_drain()
        drained = await wait_idle(self, self.settings.request_timeout_s)
        if not drained:
            log.error("draining took longer than %.0f s", self.settings.request_timeout_s)
        if self.client is not None:
            self.client.close()
        self.drained = drained
        log.info("stopped" if drained else "stopped; the drain was incomplete")


def _connect(path: str, arena: shm.Arena | None) -> socket.socket:
    """A connected, non-blocking socket to the engine at ``path`` that has sent its ``HELLO`` (with the arena).

    Raises:
        OSError: no engine listens there (yet), or it hung up.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(CONNECT_TIMEOUT_S)
        sock.connect(path)
        shm.send_hello(sock, arena)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _terminate() -> None:
    """Stop this process the way the supervisor would: SIGTERM, which uvicorn turns into a drain."""
    os.kill(os.getpid(), signal.SIGTERM)
