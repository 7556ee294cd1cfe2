"""Dynamic batching: one bounded queue per layer; requests with the same dtype and H x W share a kernel call.

Requests in clients' CUDA shared memory (``codec.CudaJob``) batch only with each other, per GPU (the *lane* of
``Pending.key``), and their batches go to that GPU's worker (``Executor.acquire(device)``). Each request's kind
(``service.engine.kinds.kind_of``) is known from when it is queued, and each batch goes to its worker with its kind
(``batch_kind``), which names the path the worker chose for it when it was made (``service.engine.paths``).

A batch is executed when the group of the oldest queued request holds ``max_batch_size`` samples or
``max_batch_bytes`` output bytes, or when that request has waited ``max_queue_delay_ms``, whichever comes
first, and a worker has room for another batch (while every worker is busy the queue keeps filling, so batches grow with
load). Requests are packed first come, first served.

Batches are packed late: while a layer has a batch on a worker of every device (``Executor.devices``), its next
batch is packed only when one of them leaves its worker, not as soon as a worker's queue has room, so that the
requests arriving during a batch ride in the next one instead of waiting behind a batch packed before they came
(H200, 64 clients: 11-25% more requests/s and a lower p99; docs/operations.md). Only a batch that is already full
(the oldest request's group holds ``max_batch_size`` samples or ``max_batch_bytes``) goes early, onto another worker
of a device (``Executor.parallelism``: every worker, ``DECONV_WORKERS_PER_DEVICE`` a device), since waiting could
not make it larger: then one batch's transfers and host work overlap another's kernel on the same GPU, while small
requests keep their batches whole. Batches in a GPU's CUDA shared memory have no transfers to overlap and stay one a
GPU, unless the lane's batches are long (``LONG_GPU_BATCH_S``): then a full one goes to the GPU's other worker and
queues on the GPU's stream behind the running one, so that the worker threads' host work falls within the kernels.
The oldest request of a lane with room goes first, so that a free GPU does not wait behind requests for a busy one.
The finished batch's results go out after the next batch has started. A layer whose batches hold one sample
(``max_batch_size`` 1) has nothing to gain from waiting: it fills the workers' queues, which keeps a worker busy
between batches.

Admission is decided at the door: ``submit`` raises ``OverloadedError`` (429) at once when the queue holds
``max_queue_size`` requests and ``NotReadyError`` (503) while draining; nothing waits for room. Each request owns
its future; a request dropped by its caller (client gone, deadline passed) leaves the queue before packing,
and one whose deadline passes while queued fails with ``DeadlineExceededError`` when its batch is packed. Every
accepted request's future is resolved exactly once (result, error or cancellation).

Nothing here imports FastAPI.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from service.codec import CudaJob
from service.engine.interface import Result
from service.engine.kinds import Kind, Request, batch_kind, kind_of
from service.engine.registry import Layer
from service.errors import DeadlineExceededError, InternalError, NotReadyError, OverloadedError, ServiceError
from service.metrics import Metrics

log = logging.getLogger("deconv.service")


class Executor(Protocol):
    """What the batcher needs from the workers (``service.engine.pool.WorkerPool`` is one)."""

    @property
    def parallelism(self) -> int:
        """Batches executing at the same time when every worker is busy: one per worker."""
        ...

    @property
    def devices(self) -> int:
        """Batches executing at the same time with one on each device (``parallelism`` or fewer)."""
        ...

    async def acquire(self) -> Any:
        """Wait for and reserve room for a batch on some worker (a reservation); ``acquire(device)`` on a worker of
        that GPU (a batch in its CUDA shared memory)."""
        ...

    def release(self, reservation: Any) -> None:
        """Give back an unused reservation."""
        ...

    async def run(self, reservation: Any, layer: Layer, inputs: list[Request], kind: Kind) -> list[Any]:
        """Execute one batch of ``kind`` (the path the worker takes: ``service.engine.kinds``) on the reservation
        (released when done); one output per input, or the exception of that input's request alone."""
        ...


def on_gpu(lane: int | None) -> bool:
    """Whether a batch of ``lane`` (``Pending.key``) has its tensors in a GPU's CUDA shared memory: no transfers to
    overlap, so a second worker of that GPU adds host work (H100, 4 MiB requests: 30% fewer), and takes a batch only
    when the lane's batches are long (``LONG_GPU_BATCH_S``)."""
    return lane is not None and lane >= 0


# A full batch in a GPU's CUDA shared memory goes to the GPU's other worker while one runs only when the lane's last
# batch took this long: then the kernels, not the worker's host work between two batches, are most of a batch, and
# the other worker's host work overlaps them. H100: a layer of 34 GFLOP a request, up to ~4.5 ms a batch, gains; 4 MiB
# requests of a light layer, batches of at most ~1.3 ms, would lose (bench/NOTES.md).
LONG_GPU_BATCH_S = 2e-3


class Answer:
    """What a request submitted with ``on_done`` has instead of an asyncio future (``Batcher.submit``): the same
    methods the batcher resolves a future with, which hand the outcome to ``on_done(key, outcome)`` at once, where an
    asyncio future would schedule its callbacks for the next event-loop iteration. ``outcome`` is the ``Result``, the
    exception, or None for a cancellation; a cancellation is still handed over one iteration later, so that whatever
    its caller does after ``Batcher.drop`` comes first. The engine process answers each request this way: a future,
    a callback and a scheduled call per request showed in its profile."""

    __slots__ = ("_done", "_key", "_loop", "_on_done")

    def __init__(self, on_done: Callable[[Any, Result | BaseException | None], None], key: Any,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._on_done = on_done
        self._key = key
        self._loop = loop
        self._done = False

    def done(self) -> bool:
        """Whether the outcome was handed over (or a cancellation scheduled)."""
        return self._done

    def set_result(self, result: Result) -> None:
        """Hand over the request's result."""
        self._settle(result)

    def set_exception(self, exc: BaseException) -> None:
        """Hand over the request's failure."""
        self._settle(exc)

    def cancel(self) -> bool:
        """Cancel: ``on_done(key, None)`` in the next event-loop iteration. False when already done."""
        if self._done:
            return False
        self._done = True
        self._loop.call_soon(self._call, None)
        return True

    def _settle(self, outcome: Result | BaseException) -> None:
        if self._done:
            raise asyncio.InvalidStateError("the request was answered already")
        self._done = True
        self._call(outcome)

    def _call(self, outcome: Result | BaseException | None) -> None:
        try:
            self._on_done(self._key, outcome)
        except Exception:  # one request's answer must not stop its batch's others, as with a future's callback
            log.exception("answering request %r failed", self._key)


class Pending:
    """A queued request: its input, its limits and its future (or ``Answer``). Made once per request on the engine's
    event loop (``Batcher.submit``), so a plain class with slots and positional arguments."""

    __slots__ = ("deadline", "enqueued", "future", "key", "kind", "out_bytes", "samples", "seq", "state", "x")

    def __init__(self, seq: int, x: Request, kind: Kind, key: tuple[torch.dtype, int, int, int | None], samples: int,
                 out_bytes: int, enqueued: float, deadline: float | None,
                 future: asyncio.Future[Result] | Answer) -> None:
        self.seq = seq
        self.x = x  # [n, C_in, H, W]
        self.kind = kind  # which path its batch takes (service.engine.kinds); a batch's kind is its requests'
        # (dtype, H, W, lane): requests with equal keys can share a kernel call. The lane is None for requests in host
        # memory, the GPU for requests in its CUDA shared memory (codec.CudaJob), which run on that GPU's worker.
        self.key = key
        self.samples = samples
        self.out_bytes = out_bytes
        self.enqueued = enqueued  # time.monotonic()
        self.deadline = deadline  # time.monotonic() by which execution must start
        self.future = future
        self.state = "queued"  # queued -> running | dropped

    def __repr__(self) -> str:
        return f"Pending(seq={self.seq}, key={self.key}, samples={self.samples}, state={self.state!r})"

    @property
    def started(self) -> bool:
        """Whether the request left the queue in a batch (it will get a result or an execution error)."""
        return self.state == "running"


class Batcher:
    """The queue and batching loop of one layer (its ``service.engine.interface.LayerQueue`` in a ``LocalEngine``)."""

    def __init__(self, layer: Layer, executor: Executor, metrics: Metrics | None = None,
                 observe_queue_time: bool = True) -> None:
        self.layer = layer
        self.observe_queue_time = observe_queue_time  # False: the caller observes each result's queue_s itself
        self.executor = executor
        self.metrics = metrics
        self._queue: dict[int, Pending] = {}  # insertion order = arrival order
        self._totals: dict[tuple[torch.dtype, int, int, int | None], list[int]] = {}  # key -> [samples, bytes]
        self._seq = itertools.count()
        self._changed: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        # The event loop, looked up once: on Python 3.11 every asyncio.get_running_loop() is a getpid system call.
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._executing = 0  # this layer's batches on a worker, outputs not back yet (late packing counts these)
        self._lanes: dict[int | None, int] = {}  # ... of them by lane (Pending.key)
        self._lane_batch_s: dict[int | None, float] = {}  # the last batch of each lane: start to leaving its worker
        # set whenever one of this layer's batches leaves its worker, or a request fills its group while some run
        self._finished: asyncio.Event | None = None
        self._draining = False
        self._depth_due = False  # a queue-depth update is scheduled (submit)
        if metrics is not None:  # this layer's series, looked up once (labels() per request shows in profiles)
            name = layer.name
            self._depth = metrics.queue_depth.labels(name)
            self._batch_size = metrics.batch_size.labels(name)
            self._batch_requests = metrics.batch_requests.labels(name)
            self._queue_time = metrics.queue_time.labels(name)
            self._batch_time = metrics.batch_time.labels(name)

    # --- life cycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the batching loop on the running event loop."""
        self._event_loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._finished = asyncio.Event()
        self._loop_task = asyncio.create_task(self._loop(), name=f"batcher-{self.layer.name}")

    def begin_drain(self) -> None:
        """Refuse new requests from now on and execute the queued ones without waiting for the delay."""
        self._draining = True
        self._wake()

    async def drain(self) -> None:
        """``begin_drain``, then wait until every queued request's batch has finished."""
        self.begin_drain()
        if self._loop_task is not None:
            await self._loop_task
        while self._running:
            await asyncio.gather(*list(self._running), return_exceptions=True)

    async def close(self) -> None:
        """Stop at once; queued requests fail with NotReadyError (use ``drain`` to finish them instead)."""
        self._draining = True
        if self._loop_task is not None and not self._loop_task.done():
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for item in list(self._queue.values()):
            self._remove(item, "dropped")
            if not item.future.done():
                item.future.set_exception(NotReadyError("server is shutting down"))
        self._report_depth()

    @property
    def depth(self) -> int:
        """Requests waiting in the queue."""
        return len(self._queue)

    # --- the door -----------------------------------------------------------------------------------------

    def submit(self, x: Request, *, received: float | None = None, deadline: float | None = None,
               on_done: Callable[[Any, Result | BaseException | None], None] | None = None,
               key: Any = None) -> Pending:
        """Queue ``x`` ([n, C_in, H, W], already validated against the layer) and return its pending entry.

        Args:
            x: the request's input.
            received: ``time.monotonic()`` at receipt (default: now).
            deadline: ``time.monotonic()`` by which its batch must start, or None.
            on_done: instead of an asyncio future, the entry gets an ``Answer`` that calls ``on_done(key,
                outcome)`` with the ``Result``, the exception, or None when cancelled.
            key: passed to ``on_done``.

        Raises:
            NotReadyError: draining (503).
            OverloadedError: the queue is full (429, with Retry-After).
        """
        # The engine process runs this once per request on its event loop, whose time a GPU batch waits for (the
        # worker thread needs the GIL it holds): no call here that a local name or a check can replace.
        queue = self._queue
        changed = self._changed
        if self._draining or changed is None:
            raise NotReadyError("server is shutting down" if self._draining else "batcher is not running")
        layer = self.layer
        limits = layer.limits
        if len(queue) >= limits.max_queue_size:
            retry = max(1.0, 2 * limits.max_queue_delay_ms / 1000)
            raise OverloadedError(f"layer {layer.name!r} has {len(queue)} requests queued "
                             f"(max_queue_size {limits.max_queue_size}); retry later", retry_after_s=retry)
        n, _, h, w = x.shape
        n, h, w = int(n), int(h), int(w)
        loop = self._event_loop or asyncio.get_running_loop()
        lane = x.device if isinstance(x, CudaJob) else None
        group = (x.dtype, h, w, lane)
        item = Pending(next(self._seq), x, kind_of(x), group, n, layer.output_bytes(n, h, w),
                       time.monotonic() if received is None else received, deadline,
                       loop.create_future() if on_done is None else Answer(on_done, key, loop))
        queue[item.seq] = item
        totals = self._totals.get(group)
        if totals is None:
            self._totals[group] = [n, item.out_bytes]
        else:
            totals[0] += n
            totals[1] += item.out_bytes
        # While batches run, the loop may wait for room (_wait_for_room): a request gives its group room when it
        # fills the group (a full batch may go to another worker of a busy GPU), or when its lane is a GPU's CUDA
        # shared memory with no batch running there. A request through host memory that does not fill its group
        # cannot: room there opens only when a batch ends (_left_worker).
        if self._executing and self._finished is not None and (lane is not None or self._group_full(group)) \
                and self._has_room(group):
            self._finished.set()
        if not self._depth_due and self.metrics is not None:  # the gauge follows within one loop iteration:
            self._depth_due = True  # once for a burst of requests, not once per request
            loop.call_soon(self._report_depth)
        changed.set()  # _wake
        return item

    def drop(self, item: Pending, reason: str) -> bool:
        """Take a still-queued request out (client gone: ``"disconnected"``; ``"deadline"``) and cancel it.

        Returns False when its batch already started: it will be answered.
        """
        if item.state != "queued":
            return False
        self._remove(item, "dropped")
        self._report_depth()
        if not item.future.done():
            item.future.cancel()
        if self.metrics is not None:
            self.metrics.dropped.labels(self.layer.name, reason).inc()
        self._wake()
        return True

    # --- the loop -----------------------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _wait_change(self, timeout: float | None) -> bool:
        assert self._changed is not None
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def _group_full(self, key: tuple[torch.dtype, int, int, int | None]) -> bool:
        samples, nbytes = self._totals.get(key, (0, 0))
        limits = self.layer.limits
        return samples >= limits.max_batch_size or nbytes >= limits.max_batch_bytes

    async def _loop(self) -> None:
        while True:
            try:
                if not await self._step():
                    return
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not silence the layer: log, fail nothing, go on
                log.exception("batcher of layer %s: unexpected error", self.layer.name)
                await asyncio.sleep(0.01)

    async def _step(self) -> bool:
        """Form and launch one batch; False when draining and nothing is left."""
        delay = self.layer.limits.max_queue_delay_ms / 1000
        while True:
            while not self._queue:
                if self._draining:
                    return False
                await self._wait_change(None)
            head = next(iter(self._queue.values()))
            due = head.enqueued + delay
            # Wait for the head's group to fill up or for the head's delay to run out (drop: start over).
            while head.state == "queued" and not self._draining and not self._group_full(head.key):
                remaining = due - time.monotonic()
                if remaining <= 0 or not await self._wait_change(remaining):
                    break
            if head.state != "queued":
                continue
            lane = head.key[3]
            if self.layer.limits.max_batch_size > 1:  # pack late (module docstring)
                first = await self._wait_for_room()
                if first is None:
                    continue
                lane = first.key[3]
            # Requests keep joining the queue while workers are busy. A batch in CUDA shared memory needs its GPU.
            reservation = await (self.executor.acquire() if lane is None else self.executor.acquire(lane))
            batch = self._pack(lane)
            if not batch:
                self.executor.release(reservation)
                continue
            self._executing += 1
            self._lanes[lane] = self._lanes.get(lane, 0) + 1
            task = asyncio.create_task(self._execute(reservation, batch, lane))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            return True

    def _left_worker(self, lane: int | None, seconds: float) -> None:
        self._lane_batch_s[lane] = seconds
        self._executing -= 1
        self._lanes[lane] -= 1
        if self._finished is not None:
            self._finished.set()

    async def _wait_for_room(self) -> Pending | None:
        """Wait until the oldest queued request of some lane may start a batch (``_first_with_room``) and return it;
        None when the queue is empty."""
        assert self._finished is not None
        while self._queue:
            first = self._first_with_room()
            if first is not None:
                return first
            self._finished.clear()
            await self._finished.wait()
        return None

    def _first_with_room(self) -> Pending | None:
        """The oldest queued request of a lane with room for its batch (``_has_room``); None when no lane has."""
        lanes = len({key[3] for key in self._totals})
        seen: set[int | None] = set()
        for item in self._queue.values():
            lane = item.key[3]
            if lane in seen:
                continue
            if self._has_room(item.key):
                return item
            seen.add(lane)
            if len(seen) == lanes:
                break
        return None

    def _has_room(self, key: tuple[torch.dtype, int, int, int | None]) -> bool:
        """Whether a batch of the group ``key`` may start now (module docstring): in a GPU's CUDA shared memory,
        when none of this layer's runs on that GPU, or fewer than its workers when the group fills a batch already
        and the lane's batches are long (``LONG_GPU_BATCH_S``); through host memory, while fewer of them run than
        there are devices, or workers when the group fills a batch already."""
        lane = key[3]
        if on_gpu(lane):
            running = self._lanes.get(lane, 0)
            return not running or (running * self.executor.devices < self.executor.parallelism
                                   and self._lane_batch_s.get(lane, 0.0) >= LONG_GPU_BATCH_S
                                   and self._group_full(key))
        through_host = self._executing - sum(n for lane, n in self._lanes.items() if on_gpu(lane))
        return through_host < self.executor.devices or (
            through_host < self.executor.parallelism and self._group_full(key))

    def _pack(self, lane: int | None = None) -> list[Pending]:
        """The next batch: the oldest queued request of ``lane`` (see ``Pending.key``) and the requests of its key
        after it, within the layer's limits."""
        now = time.monotonic()
        for item in list(self._queue.values()):
            if item.deadline is not None and now > item.deadline:
                self._remove(item, "dropped")
                if self.metrics is not None:
                    self.metrics.dropped.labels(self.layer.name, "deadline").inc()
                if not item.future.done():  # enqueued is the receipt time the deadline counts from
                    item.future.set_exception(DeadlineExceededError.before_execution(
                        1e3 * (item.deadline - item.enqueued)))
        key = next((item.key for item in self._queue.values() if item.key[3] == lane), None)
        if key is None:
            self._report_depth()
            return []
        limits = self.layer.limits
        batch: list[Pending] = []
        samples = nbytes = 0
        for item in self._queue.values():
            if item.key != key:
                continue
            if batch and (samples + item.samples > limits.max_batch_size
                          or nbytes + item.out_bytes > limits.max_batch_bytes):
                break
            batch.append(item)
            samples += item.samples
            nbytes += item.out_bytes
        for item in batch:
            self._remove(item, "running")
        self._report_depth()  # once per batch rather than once per request
        return batch

    def _remove(self, item: Pending, state: str) -> None:
        if self._queue.pop(item.seq, None) is not None:
            totals = self._totals[item.key]
            totals[0] -= item.samples
            totals[1] -= item.out_bytes
            if totals[0] == 0:
                del self._totals[item.key]
        item.state = state

    def _report_depth(self) -> None:
        self._depth_due = False
        if self.metrics is not None:
            self._depth.set(len(self._queue))

    async def _execute(self, reservation: Any, batch: list[Pending], lane: int | None) -> None:
        start = time.monotonic()
        samples = sum(i.samples for i in batch)
        name = self.layer.name
        if self.metrics is not None:
            self._batch_size.observe(samples)
            self._batch_requests.observe(len(batch))
            if self.observe_queue_time:
                for item in batch:
                    self._queue_time.observe(start - item.enqueued)
        try:
            try:
                outputs = await self.executor.run(reservation, self.layer, [i.x for i in batch],
                                                  batch_kind(i.kind for i in batch))
            finally:
                took = time.monotonic() - start  # the lane's batch time (_has_room) and the batch-time metric
                self._left_worker(lane, took)
            if self.metrics is not None:
                self._batch_time.observe(took)
                self.metrics.count_batch(name, samples, len(batch), took)
        except Exception as exc:
            if not isinstance(exc, ServiceError):
                log.error("batch of layer %s failed", name, exc_info=exc)
            error = exc if isinstance(exc, ServiceError) else InternalError("batch execution failed")
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(error)
            return
        # The batcher packs the next batch (already woken) before this one's results go out: one event-loop
        # iteration here instead of a batch's worth of answers between a worker's batches.
        await asyncio.sleep(0)
        worker = getattr(reservation, "name", str(reservation))
        requests = len(batch)
        for item, y in zip(batch, outputs, strict=True):
            future = item.future
            if future.done():
                continue
            if isinstance(y, BaseException):  # this request alone failed (its CUDA shared-memory region)
                future.set_exception(y)
            else:
                future.set_result(Result(y, samples, requests, start - item.enqueued, worker))
