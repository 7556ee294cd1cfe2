"""The engine interface: what the HTTP layer (``service.http``) serves, whatever computes the layers.

An ``Engine`` holds the layers (``registry``), one ``LayerQueue`` per layer, the readiness (``Readiness``) and the
metrics, and has a life cycle: ``start``, ``begin_drain``, ``idle``, ``stop``. Two implementations, and only two:

* ``service.engine.local.LocalEngine``: the batchers and worker threads of this process. A server of one process
  serves HTTP on it; the engine process of a multi-process server (``service.engine.process``) runs one behind its
  Unix socket.
* ``service.engine.remote.RemoteEngine``: each request goes as frames over a Unix socket to the engine process,
  and readiness mirrors that engine's. Each HTTP process of a multi-process server serves HTTP on one.

The HTTP code is the same for one process and for N: only the engine it is given differs
(docs/architecture.md, "Processes and threads").
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from service.codec import AnyTensor
from service.config import Settings
from service.engine.registry import Registry
from service.errors import NotReadyError
from service.metrics import Metrics

log = logging.getLogger("deconv.service")


class Result(NamedTuple):
    """What a request gets back: its output and how it was batched (a tuple: cheaper to make than a frozen
    dataclass, and the engine process makes one per request)."""

    output: AnyTensor  # [n, C_out, H_out, W_out] (a RawTensor when the input was one)
    batch_samples: int  # samples in the kernel call this request shared
    batch_requests: int  # requests in that kernel call
    queue_s: float  # time from enqueue to the start of the batch
    worker: str


class Ticket(Protocol):
    """What ``LayerQueue.submit`` returns: the request's future and whether it left the queue."""

    future: asyncio.Future[Result]
    state: str

    @property
    def started(self) -> bool:
        """Whether the request will be answered without a further deadline check by its caller."""
        ...


class LayerQueue(Protocol):
    """One layer's door into the engine (``service.engine.batcher.Batcher``, or
    ``service.engine.remote.RemoteQueue``, which forwards to the engine process's batcher)."""

    @property
    def depth(self) -> int:
        """Requests waiting in this process's queue."""
        ...

    def submit(self, x: AnyTensor, *, received: float | None = None, deadline: float | None = None) -> Any:
        """Queue a validated input ``[n, C_in, H, W]``; returns its ``Ticket``.

        Raises:
            NotReadyError: draining, or the engine is gone (503).
            OverloadedError: the layer's queue is full (429).
        """
        ...

    def drop(self, item: Any, reason: str) -> bool:
        """Give up on a request (``"disconnected"``, ``"timeout"``, ``"deadline"``, ``"cancelled"``); whether
        nobody waits for it any more (False once its batch started: it will be answered)."""
        ...


class CudaMemory(Protocol):
    """The engine's side of KServe CUDA shared memory (and of system regions it maps for its GPUs): the clients'
    GPU allocations it maps, one per registration
    (``token``), where its GPU workers run (``service.engine.cuda_shm.CudaRegions``, or
    ``service.engine.remote.RemoteCudaMemory``, which asks the engine process). The registrations themselves (names,
    sizes, status) are the HTTP layer's (``service.http.shm_regions``)."""

    @property
    def available(self) -> bool:
        """Whether regions can be opened (a GPU engine, the extension on, the CUDA libraries found)."""
        ...

    @property
    def reason(self) -> str:
        """Why regions cannot be opened ("" when they can)."""
        ...

    async def open(self, token: str, handle: bytes, device: int, byte_size: int) -> None:
        """Map the allocation of IPC ``handle`` on GPU ``device`` for registration ``token``.

        Raises:
            RegionError: unavailable, not a GPU of this engine, a handle that does not open, an allocation smaller
                than ``byte_size``, or too many regions (400).
        """
        ...

    @property
    def system_available(self) -> bool:
        """Whether system regions are mapped and page-locked here (``open_system``): a GPU engine with
        ``Settings.system_shm_pinned``."""
        ...

    async def open_system(self, token: str, key: str, offset: int, byte_size: int, dev: int, ino: int) -> None:
        """Map and page-lock ``byte_size`` bytes at ``offset`` of the client's shared-memory object ``key`` for
        system registration ``token``, so that its tensors go between it and the GPU with no host copy (the
        object must be the one registered: device ``dev``, inode ``ino``).

        Raises:
            RegionError: not available, or the object cannot be mapped or locked (the region then serves by copies).
        """
        ...

    async def close(self, tokens: list[str]) -> None:
        """Unmap the allocations of these registrations (unknown tokens are ignored); one in use by a batch is
        unmapped when the batch is done, and no new request reaches it."""
        ...


class Engine(Protocol):
    """What the HTTP layer serves (the module docstring)."""

    settings: Settings
    metrics: Metrics
    readiness: Readiness
    cuda_memory: CudaMemory
    registry: Registry | None  # None until start() loaded it
    backend: str  # "cuda" or "cpu" ("" until known)
    drained: bool  # set by stop(): every request taken was answered in time

    @property
    def queues(self) -> Mapping[str, LayerQueue]:
        """Each layer's queue, by name (empty until started)."""
        ...

    @property
    def idle(self) -> bool:
        """Whether every request taken has been answered."""
        ...

    def body_buffer(self, nbytes: int) -> memoryview | None:
        """Writable memory of ``nbytes`` bytes for a request body, from where a tensor decoded in it reaches the
        engine with no copy (given back once the last view of it is gone); None when the engine has none to lend
        (the HTTP layer reads the body into memory of its own)."""
        ...

    async def start(self) -> None:
        """Load the layer repository and start serving; readiness follows as the layers are checked.

        Raises:
            RepositoryError: the layer repository is invalid (the server must not start).
        """
        ...

    def begin_drain(self) -> None:
        """Refuse new work (503 from now on); requests taken are still answered. Never from a signal handler: it
        writes a metric, whose lock the interrupted code may hold (``service.http.server.DrainingServer``)."""
        ...

    async def stop(self) -> None:
        """``begin_drain``, answer everything taken (bounded by the request timeout), then release the engine."""
        ...


class Readiness:
    """An engine's state, the same for both: ``starting`` -> ``ready`` | ``failed``; then ``draining`` for good.

    The ``deconv_ready`` gauge follows it. ``listeners`` are called after every change (on the event loop), and
    with ``freeze_gc`` set (the process that serves: see ``freeze_heap``) the heap is frozen when it first turns
    ready.
    """

    def __init__(self, metrics: Metrics, reason: str) -> None:
        self.state = "starting"
        self.reason = reason
        self.freeze_gc = False
        self.listeners: list[Callable[[], None]] = []
        self._gauge = metrics.ready
        self._frozen = False

    @property
    def ready(self) -> bool:
        """Whether inference requests are accepted."""
        return self.state == "ready"

    def check_ready(self) -> None:
        """Raise ``NotReadyError`` (503) unless ready."""
        if self.state != "ready":
            raise NotReadyError(self.reason, retry_after_s=1.0 if self.state == "starting" else 5.0)

    def set(self, state: str, reason: str) -> None:
        """Turn ``starting``, ``ready`` or ``failed`` with ``reason``; nothing changes once draining."""
        if self.state == "draining":
            return
        if state == "ready" and self.freeze_gc and not self._frozen:
            self._frozen = True
            freeze_heap()
        self.state, self.reason = state, reason
        self._gauge.set(1 if state == "ready" else 0)
        self.notify()

    def begin_drain(self) -> bool:
        """Turn ``draining``; whether this call did (False when it was already). Listeners are not called here (it
        may run off the event loop): the engine calls ``notify`` from its loop."""
        if self.state == "draining":
            return False
        self.state, self.reason = "draining", "draining: the server is shutting down"
        self._gauge.set(0)
        return True

    def notify(self) -> None:
        """Call the listeners."""
        for listener in self.listeners:
            listener()


async def wait_idle(engine: Engine, timeout_s: float) -> bool:
    """Wait (at most ``timeout_s``) until ``engine.idle``; whether it is."""
    deadline = time.monotonic() + timeout_s
    while not engine.idle and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return engine.idle


def freeze_heap() -> None:
    """Move every object alive now into the garbage collector's permanent generation (``gc.freeze``).

    Once ready the heap holds millions of long-lived objects (torch, FastAPI, pydantic, the layers). Without this,
    every full collection walks all of them again: about 100 ms with the event loop stopped, several times a second
    under load, which is about 50 us per request and the p99 latency. Frozen objects are still freed by reference
    counting; only reference cycles among them are never collected, which is why only a server's processes do it,
    once, after a full collection.
    """
    gc.collect()
    gc.freeze()
    log.info("garbage collector: %d start-up objects frozen", gc.get_freeze_count())
