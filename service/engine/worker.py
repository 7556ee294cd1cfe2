"""A worker: one device, one thread that executes batches off the event loop, and the thread's replacement when it
dies or stalls.

A batch reaches the thread through ``Worker.submit`` with its kind (``service.engine.kinds.Kind``, said by the
batcher), and the thread runs the path the worker chose for that kind when it was made (``service.engine.paths``:
host, direct or placed; ``paths_for``). Any failure fails only the requests of that batch; the worker keeps serving.
A worker thread that dies (an exception leaves its loop) or stalls (one batch past ``worker_timeout_s``, seen by the
pool's watchdog, ``service.engine.pool.WorkerPool.watch``) is replaced by a fresh thread, and every batch the old
one held fails with ``InternalError``, so that no request waits on a thread that will never answer. Nothing here
imports FastAPI. A *slot*, here as everywhere in the service, is a request's range of shared memory
(``service.codec.SlotTensor``).

Threads and locks
-----------------
A worker's state is touched from two sides: the event loop (``submit``, ``restart``, the pool) and the worker's
thread (``_serve``). Everything the loop alone uses (``inflight_batches``, ``inflight_samples``, the pool's
``_freed``) takes no lock. Two locks cover the rest, and nothing else here locks:

* ``_lock`` guards the thread's *generation*: ``_thread``, its job queue ``_jobs``, the batches it holds
  ``_held``, ``_generation`` and ``_stopping``. ``submit`` queues a batch and ``_replace`` starts a new generation
  (``restart``, the watchdog, or a thread that died) under it, so a batch is either held by the generation that will
  run it or failed by the replacement, never lost between them.
* ``_slot_lock`` makes ``_deliver``'s check "am I still the current generation?" and its writes into the
  requests' slots one step with respect to ``_replace``: once a replacement has failed a batch, its slots may
  serve other requests, and a replaced thread that comes back late must not write into them. A batch the GPU writes
  into its slots or its clients' regions itself (the direct and placed paths) is marked ``_writing`` under the same
  lock before it starts (``_writes``); a replacement leaves that one batch unanswered, to the old thread, so that its
  slots stay its requests' and no client is told its request failed while the writes go on.

``busy_since`` is written by the thread and read by the watchdog without a lock (a float, replaced whole).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import cast

import torch

from service.codec import (
    AnyTensor,
    CudaJob,
    RawTensor,
    SlotTensor,
    copy_bytes,
    tensor_bytes,
)
from service.engine import paths as paths_module
from service.engine.cuda_shm import CudaRegions
from service.engine.kinds import Kind, Output, Request
from service.engine.ops import WeightPacks
from service.engine.paths import DirectFn, ForwardFn, GatheredFn, Paths, Steps, Weights, paths_for
from service.engine.registry import Layer
from service.errors import InternalError
from service.faults import Faults
from service.metrics import Metrics

log = logging.getLogger("deconv.service")

# A batch handed to the worker thread: its future, its layer, its inputs and their kind.
_Job = tuple["Future[list[Output]]", Layer, list[Request], Kind]


def _settle(future: Future[list[Output]], result: list[Output] | None = None,
            error: BaseException | None = None) -> None:
    # A future failed by a restart may still get an answer from the abandoned thread: the first one wins.
    try:
        if result is not None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass


class Worker:
    """One device, one thread. ``_serve`` runs on that thread, and the batch's path with it (``_outputs``);
    everything else on the event loop (see the module's "Threads and locks").

    Batches reach the thread through ``submit`` (a queue; each batch owns a ``concurrent.futures.Future``).
    ``restart`` replaces the thread: the batches the old one held fail, later ones go to the new one.
    """

    def __init__(self, device: torch.device, metrics: Metrics | None = None, forward: ForwardFn | None = None,
                 faults: Faults | None = None, gathered: GatheredFn | None = None,
                 cuda: CudaRegions | None = None, name: str | None = None, direct: DirectFn | None = None,
                 paths: Paths | None = None) -> None:
        self.device = device
        self.regions = cuda  # the engine's shared-memory regions, which a batch of CudaJobs leases
        self.name = name or str(device)  # metrics and logs; "cuda:0/1" with several workers a device
        self.metrics = metrics
        self.faults = faults if faults else None
        self.steps = Steps(forward or paths_module.kernel_forward, gathered or paths_module.kernel_forward_gathered,
                           direct or paths_module.kernel_forward_direct)
        self.paths = paths or paths_for(device)  # each kind's path, chosen once
        self.stream: torch.cuda.Stream | None = None  # created in load(), off the event loop
        # The stream of batches in this GPU's CUDA shared memory, one for all its workers (WorkerPool.load; else
        # this worker's own): a batch queued there while another runs starts the moment that one ends.
        self.gpu_stream: torch.cuda.Stream | None = None
        self.weights: dict[str, Weights] = {}  # layer -> (weight, bias, packed copies of the weight on a GPU)
        self.inflight_batches = 0
        self.inflight_samples = 0
        self.busy_since: float | None = None  # time.monotonic() when the current batch started executing
        self._lock = threading.Lock()  # the thread's generation (module docstring: "Threads and locks")
        self._slot_lock = threading.Lock()  # _deliver's slot writes vs _replace (same section)
        self._stopping = False
        self._generation = 0
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._held: set[Future[list[Output]]] = set()  # batches handed to the current thread, unanswered
        # The batch whose outputs the GPU is writing into their slots or regions (``_writes``), with _slot_lock.
        self._writing: Future[list[Output]] | None = None
        self._abandoned: list[threading.Thread] = []  # replaced threads, joined at shutdown if they come back
        self._thread = self._start_thread()

    @property
    def is_cuda(self) -> bool:
        """Whether this worker runs on a GPU."""
        return self.device.type == "cuda"

    def load(self, layer: Layer) -> None:
        """Copy the layer's weights to this worker's device (once, at startup; blocking: call it off the loop)."""
        if self.is_cuda and self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        w = layer.weight.to(self.device)
        b = layer.bias.to(self.device) if layer.bias is not None else None
        if self.is_cuda:
            torch.cuda.synchronize(self.device)  # the worker's stream reads them later
        # The served weights never change: their packed copies are made once per tile layout and kept.
        self.weights[layer.name] = (w, b, WeightPacks(w) if self.is_cuda else None)

    # --- the event loop's side ------------------------------------------------------------------------------

    def submit(self, layer: Layer, inputs: Sequence[Request], kind: Kind = Kind.HOST) -> Future[list[Output]]:
        """Hand a batch of ``kind`` to the thread; the future resolves with one answer per input (or
        ``InternalError``)."""
        future: Future[list[Output]] = Future()
        with self._lock:
            if self._stopping:
                raise InternalError(f"worker {self.name} is stopped")
            held = self._held
            held.add(future)
            self._jobs.put((future, layer, list(inputs), kind))
        future.add_done_callback(held.discard)
        return future

    def restart(self, reason: str) -> bool:
        """Replace the current thread (``reason``: ``"died"`` or ``"stalled"``); False when stopped."""
        return self._replace(self._generation, reason)

    def stalled(self, timeout_s: float) -> bool:
        """Whether the current batch has been executing for longer than ``timeout_s``, or the thread is gone."""
        since = self.busy_since
        return (since is not None and time.monotonic() - since > timeout_s) or not self._thread.is_alive()

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop the thread after the batches it holds (waiting at most ``timeout_s`` for them)."""
        with self._lock:
            self._stopping = True
            self._jobs.put(None)
            thread = self._thread
        if self.faults is not None:
            self.faults.release()
        deadline = time.monotonic() + timeout_s
        for t in [*self._abandoned, thread]:  # a thread still inside torch at interpreter exit aborts the process
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.error("worker %s: thread %s still busy %.0f s after shutdown; leaving it", self.name, t.name,
                          timeout_s)

    # --- generations ------------------------------------------------------------------------------------------

    def _start_thread(self) -> threading.Thread:
        # Called with self._lock held (or from __init__): a new generation with its own queue and held set.
        self._generation += 1
        self._jobs = queue.SimpleQueue()
        self._held = set()
        self.busy_since = None
        thread = threading.Thread(target=self._serve, args=(self._jobs, self._generation), daemon=True,
                                  name=f"deconv-worker-{self.name}-{self._generation}")
        thread.start()
        return thread

    def _replace(self, generation: int, reason: str) -> bool:
        with self._lock:
            if self._stopping or generation != self._generation:
                return False  # stopped, or already replaced
            old_jobs, held = self._jobs, self._held
            self._abandoned.append(self._thread)
            with self._slot_lock:  # the old thread's outputs are in their slots now, or never will be
                self._thread = self._start_thread()
                writing = self._writing  # ... except a batch the GPU is writing: the old thread answers it
        old_jobs.put(None)  # the old thread, should it ever come back, stops at its next batch
        error = InternalError(f"worker {self.name} {reason} while holding this batch and was restarted; retry")
        failed = [f for f in held if f is not writing]  # settling one takes it out of held
        # Counted and logged before the batches are answered: whoever sees a batch fail sees the restart too.
        if self.metrics is not None:
            self.metrics.worker_restarts.labels(self.name, reason).inc()
            self.metrics.worker_busy.labels(self.name).set(0)
        log.error("worker %s: thread %s; %d batch(es) it held failed%s; started a new thread", self.name, reason,
                  len(failed), "" if writing is None else " (the one the GPU writes is answered when it ends)")
        for future in failed:
            _settle(future, error=error)
        return True

    # --- the thread -------------------------------------------------------------------------------------------

    def _serve(self, jobs: queue.SimpleQueue[_Job | None], generation: int) -> None:
        """The thread's loop: execute batches in order until told to stop or replaced."""
        try:
            while True:
                job = jobs.get()
                if job is None or generation != self._generation:
                    return
                future, layer, inputs, kind = job
                try:
                    if not future.set_running_or_notify_cancel():
                        continue  # cancelled before it started
                except RuntimeError:
                    continue  # already failed by a restart
                self.busy_since = time.monotonic()
                try:
                    outputs = self._outputs(layer, inputs, kind, _Turn(self, generation, future))
                except Exception as exc:
                    _settle(future, error=exc)
                else:
                    _settle(future, outputs)
                finally:
                    if generation == self._generation:
                        self.busy_since = None
        except BaseException:
            # Nothing above catches this (a crash, or an injected death): the thread ends here, as a thread
            # that dies would, and its replacement answers the batches it held with an error.
            if generation != self._generation or self._stopping:
                log.info("worker %s: replaced thread %d ended", self.name, generation)
                return
            log.critical("worker %s: thread %d died", self.name, generation, exc_info=True)
            self._replace(generation, "died")

    def _outputs(self, layer: Layer, inputs: list[Request], kind: Kind, turn: _Turn) -> list[Output]:
        """The batch's answers, one per request, by the path this worker chose for its kind. The batcher said the
        kind from the requests themselves (``kinds.kind_of``), so the inputs are of that kind."""
        if kind is Kind.REGIONS:
            return self.paths.regions(self, layer, cast(list[CudaJob], inputs), turn)
        if kind is Kind.SLOTS:
            return list(self.paths.slots(self, layer, cast(list[SlotTensor], inputs), turn))
        return list(self.paths.host(self, layer, cast(list[AnyTensor], inputs), turn))

    @contextlib.contextmanager
    def _writes(self, generation: int, future: Future[list[Output]]) -> Iterator[None]:
        """Around a batch whose outputs the GPU writes into memory other requests may later use (slots, clients'
        regions): it starts only if this thread is still the current one, and is marked ``_writing`` meanwhile, so
        that a replacement leaves it to this thread (module docstring, "Threads and locks")."""
        with self._slot_lock:
            if generation != self._generation:
                raise InternalError(f"worker {self.name}: replaced before the batch started")
            self._writing = future
        try:
            yield
        finally:
            with self._slot_lock:
                self._writing = None

    def _deliver(self, inputs: Sequence[AnyTensor], y: torch.Tensor, generation: int) -> list[AnyTensor]:
        """The batch's output ``y`` split per request: for an input with a slot (``SlotTensor``) its rows are
        written into the slot and returned as a ``RawTensor`` over it; other ``RawTensor`` inputs get views of
        ``y``, torch tensors get slices of it.

        Only the current thread writes into slots: a replaced thread's batches were answered with an error when it
        was replaced, their slots may already serve other requests, and its late outputs stay in ``y``.
        ``_slot_lock`` makes the check and the writes one step with respect to a replacement (``_replace``).
        One pass over the requests (a batch's cost per request is what batching does not amortize).
        """
        sizes = [int(x.shape[0]) for x in inputs]
        if not isinstance(inputs[0], RawTensor):
            return list(y.split(sizes))
        data = tensor_bytes(y)
        dtype = y.dtype
        row_shape = tuple(int(d) for d in y.shape[1:])
        row_bytes = data.nbytes // int(y.shape[0])
        outputs: list[AnyTensor] = []
        offset = 0
        with self._slot_lock:
            current = generation == self._generation
            for x, n in zip(inputs, sizes, strict=True):
                end = offset + n * row_bytes
                rows = data[offset:end]
                if current and isinstance(x, SlotTensor) and x.out.nbytes == end - offset:
                    copy_bytes(x.out, rows)
                    rows = x.out
                outputs.append(RawTensor(rows, dtype, (n, *row_shape)))
                offset = end
        return outputs


class _Turn:
    """The thread's side of one batch for its path (``paths.Turn``): its generation and future."""

    __slots__ = ("_future", "_generation", "_worker")

    def __init__(self, worker: Worker, generation: int, future: Future[list[Output]]) -> None:
        self._worker = worker
        self._generation = generation
        self._future = future

    def writes(self) -> contextlib.AbstractContextManager[None]:
        return self._worker._writes(self._generation, self._future)

    def deliver(self, inputs: Sequence[AnyTensor], y: torch.Tensor) -> list[AnyTensor]:
        return self._worker._deliver(inputs, y, self._generation)
