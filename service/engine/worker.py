"""Workers: one per device, each executing batches on a dedicated thread, off the event loop.

A GPU worker runs a batch in one extension call that releases the GIL once. A batch of requests in page-locked
slots (the engine process locks each HTTP process's arena) goes between its slots and the GPU
(``conv_transpose2d_direct``, ``Worker._direct_batch``): megabyte inputs are uploaded from their slots and their
outputs downloaded into them with no host copy, tiny ones go through one page-locked staging buffer each way (one
upload and one download a batch), and the outputs are in their slots when the call returns, so the thread's work
after it is only the answers. Any other batch (``conv_transpose2d_gathered``): copy the requests' inputs, where they
arrived, into pinned staging memory, upload on the worker's CUDA stream, run the kernels, download into a pinned
output and wait for the stream; then split the output back per request. The worker thread shares the GIL with
the event loop, which holds it most of the time under load, so every operation that releases and re-takes it (each
torch call does) costs the batch a wait. Out of memory (one path, ``Worker._forward_span``): the batch is staged
whole and split in halves, each half retried (``conv_transpose2d_staged``) and halved again, down to one sample.
Any failure fails only the requests of that batch; the worker keeps serving. A worker thread that dies (an
exception leaves its loop) or stalls (one batch past ``worker_timeout_s``) is replaced by a fresh thread, and every
batch the old one held fails with ``InternalError``, so that no request waits on a thread that will never answer.

The CPU worker (no GPU visible, or ``devices="cpu"``) runs the same path on CPU tensors, which
``kernels.conv_transpose2d`` sends to PyTorch's reference implementation.

A batch of requests in clients' CUDA shared memory (``codec.CudaJob``; the batcher keeps them in batches of their
own, on their GPU's worker) takes the device path instead (``Worker._device_batch``): the inputs are read where
they are, in the regions the engine mapped (``service.engine.cuda_shm``), and the outputs written into theirs, in
one extension call that releases the GIL once and returns when the batch's own work is done
(``conv_transpose2d_placed``); a request whose region went fails alone. Such batches run on one stream a GPU,
shared by its workers (``Worker._stream_for``), so that a second batch queues behind the running one.
Requests in system regions the engine mapped and page-locked take the same path on any GPU, on the worker's own
stream: their bytes go between region and GPU by the copy engines, with no host copy.

``WorkerPool`` hands each batch to the least busy worker (fewest samples in flight) that has room for another
batch (a *reservation*: ``acquire``, given back when the batch is done). Nothing here imports FastAPI. A *slot*,
here as everywhere in the service, is a request's range of shared memory (``service.codec.SlotTensor``).

Threads and locks
-----------------
A worker's state is touched from two sides: the event loop (``submit``, ``restart``, ``WorkerPool``) and the
worker's thread (``_serve``). Everything the loop alone uses (``inflight_batches``, ``inflight_samples``,
``WorkerPool._freed``) takes no lock. Two locks cover the rest, and nothing else here locks:

* ``_lock`` guards the thread's *generation*: ``_thread``, its job queue ``_jobs``, the batches it holds
  ``_held``, ``_generation`` and ``_stopping``. ``submit`` queues a batch and ``_replace`` starts a new generation
  (``restart``, the watchdog's ``WorkerPool.watch``, or a thread that died) under it, so a batch is either held by
  the generation that will run it or failed by the replacement, never lost between them.
* ``_slot_lock`` makes ``_deliver``'s check "am I still the current generation?" and its writes into the
  requests' slots one step with respect to ``_replace``: once a replacement has failed a batch, its slots may
  serve other requests, and a replaced thread that comes back late must not write into them. A batch the GPU writes
  into its slots or its clients' regions itself (``_direct_batch``, ``_device_batch``) is marked ``_writing`` under
  the same lock before it starts (``_writes``); a replacement leaves that one batch unanswered, to the old thread,
  so that its slots stay its requests' and no client is told its request failed while the writes go on.

``busy_since`` is written by the thread and read by the watchdog without a lock (a float, replaced whole).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError
from typing import TypeVar

import torch
import torch.nn.functional as F

from kernels import conv_transpose2d
from kernels.functional import resolve_precision
from kernels.tuning import DEFAULT, TUNER, KernelChoice, bucket
from service.codec import (
    AnyTensor,
    CudaJob,
    DeviceTensor,
    RawTensor,
    SlotTensor,
    as_tensor,
    copy_bytes,
    copy_into,
    tensor_bytes,
)
from service.engine.cuda_shm import CudaRegions
from service.engine.ops import (
    HostPart,
    Place,
    WeightPacks,
    conv_transpose2d_direct,
    conv_transpose2d_gathered,
    conv_transpose2d_placed,
    conv_transpose2d_staged,
    host_place,
)
from service.engine.registry import Layer
from service.errors import InternalError, RegionError, ServiceError
from service.faults import Faults
from service.metrics import Metrics

log = logging.getLogger("deconv.service")

# Batches one worker holds at once: one executing and one waiting in its thread's queue, so that the thread need
# not idle for an event-loop round trip between batches. A layer's batcher packs late (service.engine.batcher) and keeps
# at most one of its batches per worker; the second place serves other layers and layers of one-sample batches.
MAX_INFLIGHT_BATCHES = 2

# Default longest execution of one batch before its worker thread counts as stalled (Settings.worker_timeout_s).
WORKER_TIMEOUT_S = 120.0

# (input [N, C_in, H, W], weight, bias, layer) -> output [N, C_out, H_out, W_out]; replaceable in tests.
ForwardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, Layer], torch.Tensor]
# (requests' inputs [n_i, C_in, H, W] on the host, CUDA weight, bias, layer, the weight's packs) -> pinned host output
# [N, C_out, H_out, W_out]: the GPU worker's step, which returns once the output is there.
GatheredFn = Callable[[list[AnyTensor], torch.Tensor, torch.Tensor | None, Layer, WeightPacks | None], torch.Tensor]
# A batch handed to the worker thread: its future, its layer and its inputs.
_Job = tuple["Future[list[AnyTensor]]", Layer, list[AnyTensor]]
# A request's answer from a worker: its output (host tensor, or where in CUDA shared memory it was written), or the
# error of that request alone.
_Output = AnyTensor | DeviceTensor | ServiceError
_T = TypeVar("_T")
# (requests' inputs in their slots, CUDA weight, bias, layer, the weight's packs): the GPU worker's step for a batch
# of requests in page-locked slots, which takes each input from its slot, puts each output into its slot and
# returns once they are there.
DirectFn = Callable[[list[SlotTensor], torch.Tensor, torch.Tensor | None, Layer, WeightPacks | None], None]


def kernel_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: Layer) -> torch.Tensor:
    """The layer on ``x`` with this project's kernels (PyTorch's reference on CPU tensors)."""
    c = layer.config
    return conv_transpose2d(x, weight, bias, c.stride, c.padding, c.output_padding, c.groups, c.dilation,
                            precision=layer.kernel_precision)


def serving_choice(shape: tuple[int, ...], weight: torch.Tensor, bias: torch.Tensor | None,
                   layer: Layer, packs: WeightPacks | None = None) -> KernelChoice:
    """The kernel for a batch of ``shape`` [N, C_in, H, W]: the dispatcher's default, or with measured choice on
    (kernels.tuning, Settings.tune) the fastest measured at N's batch-size bucket (the next power of two, at most
    the layer's max batch), measured first if this is the bucket's first batch (on the current stream)."""
    if not TUNER.enabled:
        return DEFAULT
    n = min(bucket(shape[0]), max(shape[0], layer.limits.max_batch_size))
    mode = resolve_precision(weight.dtype, layer.kernel_precision)
    return TUNER.choose((n, *shape[1:]), weight, bias, layer.args, mode, packs=packs)


def batch_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes ``serving_choice`` measures at: powers of two below the max batch, and the max batch."""
    out = [1 << i for i in range(max_batch_size.bit_length()) if 1 << i < max_batch_size]
    return [*out, max_batch_size]


def kernel_forward_gathered(inputs: list[AnyTensor], weight: torch.Tensor, bias: torch.Tensor | None,
                            layer: Layer, packs: WeightPacks | None = None) -> torch.Tensor:
    """``kernel_forward`` of the requests' host inputs together, into pinned host memory, on the current stream
    (``packs``: the weight's packed copies, kept with the worker's weights)."""
    parts: list[HostPart] = []
    n = 0
    for x in inputs:  # one pass: a batch's cost per request is what batching does not amortize
        parts.append(x.data if isinstance(x, RawTensor) else x.contiguous())
        n += int(x.shape[0])
    shape = (n, *(int(d) for d in inputs[0].shape[1:]))
    return conv_transpose2d_gathered(parts, shape, weight, bias, layer.args, layer.kernel_precision,
                                     serving_choice(shape, weight, bias, layer, packs), packs)


def kernel_forward_direct(inputs: list[SlotTensor], weight: torch.Tensor, bias: torch.Tensor | None, layer: Layer,
                          packs: WeightPacks | None = None) -> None:
    """``kernel_forward`` of the requests' inputs in page-locked slots, each output into its slot (``x.out``), on
    the current stream, waiting for it."""
    parts: list[HostPart] = []
    outs: list[memoryview] = []
    n = 0
    for x in inputs:  # one pass: a batch's cost per request is what batching does not amortize
        parts.append(x.data)
        outs.append(x.out)
        n += int(x.shape[0])
    shape = (n, *(int(d) for d in inputs[0].shape[1:]))
    conv_transpose2d_direct(parts, outs, shape, weight, bias, layer.args, layer.kernel_precision,
                            serving_choice(shape, weight, bias, layer, packs), packs)


def kernel_forward_staged(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: Layer,
                          out: torch.Tensor, packs: WeightPacks | None = None) -> None:
    """``kernel_forward`` from pinned host memory into pinned host ``out`` on the current stream, waiting for it."""
    conv_transpose2d_staged(x, weight, bias, layer.args, layer.kernel_precision, out,
                            serving_choice(tuple(x.shape), weight, bias, layer, packs), packs)


def relative_error(y: torch.Tensor, y_ref: torch.Tensor) -> float:
    """Norm-wise relative error ``||y - y_ref|| / ||y_ref||`` in float64."""
    y, y_ref = y.double().cpu(), y_ref.double().cpu()
    denom = float(torch.linalg.vector_norm(y_ref))
    diff = float(torch.linalg.vector_norm(y - y_ref))
    return diff / denom if denom > 0 else diff


def _settle(future: Future[list[AnyTensor]], result: list[AnyTensor] | None = None,
            error: BaseException | None = None) -> None:
    # A future failed by a restart may still get an answer from the abandoned thread: the first one wins.
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]
    except InvalidStateError:
        pass


class Worker:
    """One device, one thread. ``_serve`` (``_batch_output``, then ``_deliver``) runs on that thread; everything
    else on the event loop (see the module's "Threads and locks").

    Batches reach the thread through ``submit`` (a queue; each batch owns a ``concurrent.futures.Future``).
    ``restart`` replaces the thread: the batches the old one held fail, later ones go to the new one.
    """

    def __init__(self, device: torch.device, metrics: Metrics | None = None, forward: ForwardFn | None = None,
                 faults: Faults | None = None, gathered: GatheredFn | None = None,
                 cuda: CudaRegions | None = None, name: str | None = None, direct: DirectFn | None = None) -> None:
        self.device = device
        self._cuda = cuda  # the engine's CUDA shared-memory regions, which a batch of CudaJobs leases
        self.name = name or str(device)  # metrics and logs; "cuda:0/1" with several workers a device
        self.metrics = metrics
        self.faults = faults if faults else None
        self._forward = forward or kernel_forward  # the CPU worker's step
        self._gathered = gathered or kernel_forward_gathered  # the GPU worker's step
        self._direct = direct or kernel_forward_direct  # ... for requests in page-locked slots
        self._stream: torch.cuda.Stream | None = None  # created in load(), off the event loop
        # The stream of batches in this GPU's CUDA shared memory, one for all its workers (WorkerPool.load; else
        # this worker's own): a batch queued there while another runs starts the moment that one ends.
        self.gpu_stream: torch.cuda.Stream | None = None
        # layer -> (weight, bias, packed copies of the weight on a GPU worker)
        self._weights: dict[str, tuple[torch.Tensor, torch.Tensor | None, WeightPacks | None]] = {}
        self.inflight_batches = 0
        self.inflight_samples = 0
        self.busy_since: float | None = None  # time.monotonic() when the current batch started executing
        self._lock = threading.Lock()  # the thread's generation (module docstring: "Threads and locks")
        self._slot_lock = threading.Lock()  # _deliver's slot writes vs _replace (same section)
        self._stopping = False
        self._generation = 0
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._held: set[Future[list[AnyTensor]]] = set()  # batches handed to the current thread, unanswered
        # The batch whose outputs the GPU is writing into their slots (``_direct_batch``), with _slot_lock.
        self._writing: Future[list[AnyTensor]] | None = None
        self._abandoned: list[threading.Thread] = []  # replaced threads, joined at shutdown if they come back
        self._thread = self._start_thread()

    # --- the thread -----------------------------------------------------------------------------------------

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

    def _serve(self, jobs: queue.SimpleQueue[_Job | None], generation: int) -> None:
        """The thread's loop: execute batches in order until told to stop or replaced."""
        try:
            while True:
                job = jobs.get()
                if job is None or generation != self._generation:
                    return
                future, layer, inputs = job
                try:
                    if not future.set_running_or_notify_cancel():
                        continue  # cancelled before it started
                except RuntimeError:
                    continue  # already failed by a restart
                self.busy_since = time.monotonic()
                try:
                    outputs = self._outputs(layer, inputs, generation, future)
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

    def _outputs(self, layer: Layer, inputs: list[AnyTensor], generation: int,
                 future: Future[list[AnyTensor]]) -> list[_Output]:
        """The batch's answers, one per request: a batch of requests in CUDA shared memory (``codec.CudaJob``;
        the batcher never mixes them with others) on the device path, requests in page-locked slots between slots
        and GPU with their outputs put into the slots in the call, every other batch through staging memory and
        split here."""
        if isinstance(inputs[0], CudaJob):
            jobs: list[CudaJob] = inputs  # type: ignore[assignment]
            return self._guarded(layer, inputs, lambda: self._device_batch(layer, jobs, generation, future))
        if self._direct_slots(inputs):
            slots: list[SlotTensor] = inputs  # type: ignore[assignment]
            return self._guarded(layer, inputs,  # type: ignore[return-value]
                                 lambda: self._direct_batch(layer, slots, generation, future))
        return self._deliver(inputs, self._batch_output(layer, inputs), generation)  # type: ignore[return-value]

    @contextlib.contextmanager
    def _writes(self, generation: int, future: Future[list[AnyTensor]]) -> Iterator[None]:
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

    def _direct_slots(self, inputs: list[AnyTensor]) -> bool:
        """Whether a batch goes between its slots and the GPU with its outputs written into them in the call: on a
        GPU, every request in a page-locked slot (``SlotTensor.pinned``)."""
        return self.is_cuda and all(type(x) is SlotTensor and x.pinned for x in inputs)

    def _direct_batch(self, layer: Layer, inputs: list[SlotTensor], generation: int,
                      future: Future[list[AnyTensor]]) -> list[AnyTensor]:
        """The batch taken from its slots and each output put into its slot in one call (``kernel_forward_direct``:
        megabyte ones by DMA with no host copy, tiny ones staged, one upload and one download a batch); each answer is
        a view of its slot.

        The GPU writes the slots while the call runs, so the rule that only the current thread writes into slots
        (``_deliver``) holds another way: the call starts only if this thread is still the current one, and a
        replacement meanwhile leaves this batch to it (``_replace`` skips ``_writing``), so that the slots stay the
        requests' until the writes are over and the batch is answered, late, by this thread. Out of memory (before
        anything is written): the staged path, which splits the batch in halves."""
        weight, bias, packs = self._weights[layer.name]
        if self.faults is not None:  # before anything is written: a thread stalled here is replaced as any other
            self.faults.before_forward(layer.name, sum(int(x.shape[0]) for x in inputs))
        try:
            with self._writes(generation, future), contextlib.ExitStack() as stack:
                if self.is_cuda:
                    stack.enter_context(torch.cuda.device(self.device))
                    stack.enter_context(torch.cuda.stream(self._stream))
                self._direct(inputs, weight, bias, layer, packs)
        except torch.cuda.OutOfMemoryError:
            pass  # retried below, outside the except block, so that the failed attempt's tensors are freed
        else:
            if self.metrics is not None:
                self.metrics.worker_direct_batches.labels(self.name).inc()
            _, c_out, h_out, w_out = self._out_shape(layer, inputs[0])
            return [RawTensor(x.out, x.dtype, (int(x.shape[0]), c_out, h_out, w_out)) for x in inputs]
        self._count_failure("oom_retry")
        log.warning("worker %s: out of memory for a batch of layer %s straight from its slots; staging it instead",
                    self.name, layer.name)
        if self.is_cuda:
            torch.cuda.empty_cache()
        return self._deliver(inputs, self._forward_span(layer, inputs, None),  # type: ignore[arg-type]
                             generation)

    @staticmethod
    def _out_shape(layer: Layer, x: AnyTensor) -> tuple[int, int, int, int]:
        n, _, h, w = x.shape
        return (int(n), layer.config.out_channels, *layer.output_hw(int(h), int(w)))

    def _deliver(self, inputs: list[AnyTensor], y: torch.Tensor, generation: int) -> list[AnyTensor]:
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

    def submit(self, layer: Layer, inputs: list[AnyTensor]) -> Future[list[AnyTensor]]:
        """Hand a batch to the thread; the future resolves with one output per input (or ``InternalError``)."""
        future: Future[list[AnyTensor]] = Future()
        with self._lock:
            if self._stopping:
                raise InternalError(f"worker {self.name} is stopped")
            held = self._held
            held.add(future)
            self._jobs.put((future, layer, inputs))
        future.add_done_callback(held.discard)
        return future

    def restart(self, reason: str) -> bool:
        """Replace the current thread (``reason``: ``"died"`` or ``"stalled"``); False when stopped."""
        return self._replace(self._generation, reason)

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
        for future in failed:
            _settle(future, error=error)
        if self.metrics is not None:
            self.metrics.worker_restarts.labels(self.name, reason).inc()
            self.metrics.worker_busy.labels(self.name).set(0)
        log.error("worker %s: thread %s; %d batch(es) it held failed%s; started a new thread", self.name, reason,
                  len(failed), "" if writing is None else " (the one the GPU writes is answered when it ends)")
        return True

    def stalled(self, timeout_s: float) -> bool:
        """Whether the current batch has been executing for longer than ``timeout_s``, or the thread is gone."""
        since = self.busy_since
        return (since is not None and time.monotonic() - since > timeout_s) or not self._thread.is_alive()

    @property
    def is_cuda(self) -> bool:
        """Whether this worker runs on a GPU."""
        return self.device.type == "cuda"

    def load(self, layer: Layer) -> None:
        """Copy the layer's weights to this worker's device (once, at startup; blocking: call it off the loop)."""
        if self.is_cuda and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        w = layer.weight.to(self.device)
        b = layer.bias.to(self.device) if layer.bias is not None else None
        if self.is_cuda:
            torch.cuda.synchronize(self.device)  # the worker's stream reads them later
        # The served weights never change: their packed copies are made once per tile layout and kept.
        self._weights[layer.name] = (w, b, WeightPacks(w) if self.is_cuda else None)

    def _batch_output(self, layer: Layer, inputs: list[AnyTensor]) -> torch.Tensor:
        """The whole batch's output ``[N, C_out, H_out, W_out]`` on the host (``_deliver`` splits it)."""
        return self._guarded(layer, inputs, lambda: self._forward_span(layer, inputs, None))

    def _guarded(self, layer: Layer, inputs: list[AnyTensor], run: Callable[[], _T]) -> _T:
        """``run()``, the batch's execution, with the worker's metrics, fault hooks and errors around it: any
        failure becomes ``InternalError`` (out of memory: after the halving in ``_forward_span`` gave up)."""
        if self.metrics is not None:
            self.metrics.worker_busy.labels(self.name).set(1)
        try:
            if self.faults is not None:
                self.faults.before_batch(layer.name, sum(int(x.shape[0]) for x in inputs))
            return run()
        except InternalError:
            raise
        except torch.cuda.OutOfMemoryError as exc:
            self._count_failure("oom")
            log.error("worker %s: out of memory for one sample of layer %s %s", self.name, layer.name,
                      list(inputs[0].shape[1:]))
            raise InternalError(f"out of GPU memory on {self.name} even for a single sample") from exc
        except Exception as exc:
            self._count_failure("error")
            log.exception("worker %s: batch of layer %s failed", self.name, layer.name)
            raise InternalError(f"batch execution failed on {self.name} ({type(exc).__name__}); "
                                f"see the server log") from exc
        finally:
            if self.metrics is not None:
                self.metrics.worker_busy.labels(self.name).set(0)
                self.metrics.worker_batches.labels(self.name).inc()

    def _forward_span(self, layer: Layer, inputs: list[AnyTensor], out: torch.Tensor | None) -> torch.Tensor:
        """The layer on ``inputs`` ([n_i, C_in, H, W] each, on the host): the output [n, C_out, H_out, W_out] on
        the host. The worker's one out-of-memory path: a span that does not fit runs again in halves, each halved
        again if need be; a single sample that does not fit raises ``torch.cuda.OutOfMemoryError``.

        ``out`` None: the requests' inputs as they arrived (a GPU worker reads them where they are, ``_gathered``).
        Else, on a GPU, ``inputs`` is one span of the batch staged in pinned memory and ``out`` its place in the
        pinned output (``kernel_forward_staged``).
        """
        n = sum(int(x.shape[0]) for x in inputs)
        try:
            if self.faults is not None:
                self.faults.before_forward(layer.name, n)
            return self._forward_once(layer, inputs, out)
        except torch.cuda.OutOfMemoryError:
            if n <= 1:
                raise
        # Retry outside the except block, so that the failed attempt's tensors (held by the traceback) are freed.
        self._count_failure("oom_retry")
        log.warning("worker %s: out of memory for %d samples of layer %s; retrying in halves", self.name, n,
                    layer.name)
        if self.is_cuda:
            torch.cuda.empty_cache()
        if out is None and self.is_cuda:  # the first split stages the batch whole: its halves are spans of it
            x, out = self._stage(layer, inputs, n)
        else:
            x = _gather(inputs)
        half = n // 2
        if out is None:
            return torch.cat([self._forward_span(layer, [x[:half]], None),
                              self._forward_span(layer, [x[half:]], None)])
        self._forward_span(layer, [x[:half]], out[:half])
        self._forward_span(layer, [x[half:]], out[half:])
        return out

    def _forward_once(self, layer: Layer, inputs: list[AnyTensor], out: torch.Tensor | None) -> torch.Tensor:
        """One attempt of ``_forward_span``, without retries."""
        weight, bias, packs = self._weights[layer.name]
        if not self.is_cuda:
            with torch.inference_mode():
                return self._forward(_gather(inputs), weight, bias, layer)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            if out is None:
                return self._gathered(inputs, weight, bias, layer, packs)  # [N, C_out, H_out, W_out], pinned
            with torch.inference_mode():
                kernel_forward_staged(_gather(inputs), weight, bias, layer, out, packs)
            return out

    # --- requests in CUDA shared memory -----------------------------------------------------------------

    def _device_batch(self, layer: Layer, jobs: list[CudaJob], generation: int,
                      future: Future[list[AnyTensor]]) -> list[_Output]:
        """A batch of requests with tensors in shared memory the engine maps, on this worker's GPU (its stream:
        ``_stream_for``): each input read where it is (its CUDA region, or a system region's page-locked bytes, which
        the copy engines read; host bytes are uploaded), the batch computed, each output written where it goes (its
        region; else into page-locked host memory), and that work waited for, in one extension call that releases
        the GIL once (``conv_transpose2d_placed``: a lone request in its GPU's memory is read, and its output
        written, in place).
        Regions are held for the batch (``CudaRegions.place``): one unregistered meanwhile is unmapped after it. A
        request whose region went, or whose output does not fit, fails alone (its ``RegionError`` is its answer).
        The GPU writes the clients' regions, so the batch is one that a replacement leaves to this thread
        (``_writes``): a client told its request failed could otherwise find a late write in a region it uses again.
        A CPU worker (in tests) computes the batch from tensors over the same bytes (``_tensor_batch``)."""
        regions = self._cuda
        if regions is None:
            raise InternalError(f"worker {self.name} has no CUDA shared memory")
        answers: list[_Output | None] = [job.out for job in jobs]  # None: a host output, set once computed
        leased: list[str] = []
        stream = self._stream_for(jobs)
        with self._writes(generation, future), contextlib.ExitStack() as stack:
            if self.is_cuda:
                stack.enter_context(torch.cuda.device(self.device))
                stack.enter_context(torch.cuda.stream(stream))
            try:
                if self.is_cuda:
                    self._placed_batch(regions, layer, jobs, answers, leased)  # returns with its work done
                else:
                    self._tensor_batch(regions, layer, jobs, answers, leased)
            except BaseException:
                if stream is not None:  # copies queued before a failure read and write the regions too
                    stream.synchronize()
                raise
            finally:
                for token in leased:
                    regions.release(token)
        return [InternalError("no output") if a is None else a for a in answers]

    def _stream_for(self, jobs: list[CudaJob]) -> torch.cuda.Stream | None:
        """The stream of a batch of requests in shared memory. In a GPU's CUDA shared memory (``CudaJob.device``
        >= 0), the GPU's (``gpu_stream``): such a batch has no transfers to overlap, and a second one (the batcher
        sends it only when the lane's batches are long) queues behind the running one, so that the GPU goes from
        one batch to the next while each worker thread does its host work between its own batches. On two streams
        the batches' small device-to-device copies, which run on the GPU's cores, waited behind the other stream's
        kernel, so both batches ended together and the GPU idled while both threads got their next ones
        (bench/NOTES.md). In system regions, this worker's own: its copies over PCIe overlap the other's kernels."""
        if jobs[0].device >= 0 and self.gpu_stream is not None:
            return self.gpu_stream
        return self._stream

    def _placed_batch(self, regions: CudaRegions, layer: Layer, jobs: list[CudaJob], answers: list[_Output | None],
                      leased: list[str]) -> None:
        """``_device_batch`` on a GPU: each request's input and output as a place (``ops.Place``), then one call."""
        weight, bias, packs = self._weights[layer.name]
        parts: list[Place] = []
        outs: list[Place] = []
        held: list[object] = []  # host memory the call reads or writes, alive until it returns
        n = 0
        for i, job in enumerate(jobs):
            try:
                if job.dtype != weight.dtype:
                    raise InternalError(f"a {job.dtype} request in a batch of a {weight.dtype} layer")
                part = self._input_place(regions, job, leased, held)
                out = self._output_place(regions, layer, job, leased)
            except ServiceError as exc:
                answers[i] = exc
                continue
            if out is None:  # the output goes to the host
                host = torch.empty(self._out_shape(layer, job), dtype=weight.dtype, pin_memory=True)
                answers[i] = host
                out = host.data_ptr(), host.nbytes
            parts.append(part)
            outs.append(out)
            n += int(job.shape[0])
        if parts:
            shape = (n, *(int(d) for d in jobs[0].shape[1:]))
            conv_transpose2d_placed(parts, outs, shape, weight, bias, layer.args, layer.kernel_precision,
                                    serving_choice(shape, weight, bias, layer, packs), packs)

    def _input_place(self, regions: CudaRegions, job: CudaJob, leased: list[str], held: list[object]) -> Place:
        """Where the job's input is: in its region (held), or host bytes (kept in ``held``)."""
        x = job.x
        if isinstance(x, DeviceTensor):
            place = regions.place(x.token, x.offset, x.nbytes, self._gpu(job))
            leased.append(x.token)
            return place
        data: memoryview | torch.Tensor = x.data if isinstance(x, RawTensor) else x.contiguous()
        held.append(data)
        return host_place(data)

    def _output_place(self, regions: CudaRegions, layer: Layer, job: CudaJob, leased: list[str]) -> Place | None:
        """Where the job's output goes in its region (held), or None: to the host.

        Raises:
            RegionError: the region does not hold this output.
        """
        out = job.out
        if out is None:
            return None
        place = regions.place(out.token, out.offset, self._output_bytes(layer, job), self._gpu(job))
        leased.append(out.token)
        return place

    @staticmethod
    def _output_bytes(layer: Layer, job: CudaJob) -> int:
        """The bytes of the job's output, which its output region holds exactly.

        Raises:
            RegionError: it does not.
        """
        n, _, h, w = job.shape
        need = layer.output_bytes(n, h, w)
        assert job.out is not None
        if job.out.nbytes != need:
            raise RegionError(f"the output region holds {job.out.nbytes} bytes for an output of {need}")
        return need

    def _gpu(self, job: CudaJob) -> int:
        """The GPU whose regions this worker reads (a CPU worker, in tests, reads any)."""
        return self.device.index if self.is_cuda and self.device.index is not None else job.device

    def _tensor_batch(self, regions: CudaRegions, layer: Layer, jobs: list[CudaJob], answers: list[_Output | None],
                      leased: list[str]) -> None:
        """``_device_batch`` on the CPU worker (tests): tensors over the regions' bytes (``CudaRegions.lease``),
        the batch computed by the worker's step, each request's rows copied into its region."""
        weight, bias, _ = self._weights[layer.name]
        runs: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []  # (request, input, output region's bytes)
        for i, job in enumerate(jobs):
            try:
                x = job.x
                if isinstance(x, DeviceTensor):
                    raw = regions.lease(x.token, x.offset, x.nbytes, self._gpu(job))
                    leased.append(x.token)
                    xt = raw.view(x.dtype).view(x.shape)
                else:
                    xt = as_tensor(x)
                out = None
                if job.out is not None:
                    out = regions.lease(job.out.token, job.out.offset, self._output_bytes(layer, job), self._gpu(job))
                    leased.append(job.out.token)
            except ServiceError as exc:
                answers[i] = exc
                continue
            runs.append((i, xt, out))
        if not runs:
            return
        with torch.inference_mode():
            y = self._forward(torch.cat([r[1] for r in runs]), weight, bias, layer)
        start = 0
        for i, xi, out in runs:
            rows = y[start:start + xi.shape[0]]
            start += xi.shape[0]
            if out is None:
                answers[i] = rows.clone()
            else:
                out.copy_(rows.contiguous().reshape(-1).view(torch.uint8))

    def _stage(self, layer: Layer, inputs: list[AnyTensor], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch copied into pinned memory ``[N, C_in, H, W]``, and a pinned output for it."""
        _, c_in, h, w = inputs[0].shape
        h_out, w_out = layer.output_hw(h, w)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            host_in = torch.empty((n, c_in, h, w), dtype=layer.dtype, pin_memory=True)
            _gather(inputs, out=host_in)
            host_out = torch.empty((n, layer.config.out_channels, h_out, w_out), dtype=layer.dtype, pin_memory=True)
        return host_in, host_out

    def _count_failure(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.worker_failures.labels(self.name, kind).inc()

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


def _gather(inputs: list[AnyTensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The inputs concatenated along the batch dimension (into ``out`` when given)."""
    if isinstance(inputs[0], RawTensor):
        raw: list[RawTensor] = inputs  # type: ignore[assignment]
        if out is None:
            n = sum(x.shape[0] for x in raw)
            out = torch.empty((n, *raw[0].shape[1:]), dtype=raw[0].dtype)
        copy_into(out, raw)
        return out
    tensors: list[torch.Tensor] = inputs  # type: ignore[assignment]
    if out is not None:
        return torch.cat(tensors, out=out)
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


class WorkerPool:
    """The workers, and which of them gets the next batch."""

    def __init__(self, workers: list[Worker], metrics: Metrics | None = None,
                 max_inflight_batches: int = MAX_INFLIGHT_BATCHES, worker_timeout_s: float = WORKER_TIMEOUT_S) -> None:
        if not workers:
            raise ValueError("a worker pool needs at least one worker")
        self.workers = workers
        self.metrics = metrics
        self.max_inflight_batches = max_inflight_batches
        self.worker_timeout_s = worker_timeout_s
        self._freed: asyncio.Event | None = None

    @property
    def parallelism(self) -> int:
        """Batches executing at once when every worker is busy: one per worker."""
        return len(self.workers)

    @property
    def devices(self) -> int:
        """Batches executing at once with one on each device: the devices the workers run on."""
        return len({w.device for w in self.workers})

    def load(self, layer: Layer) -> None:
        """Put the layer's weights on every worker (blocking: call it off the loop). The first call gives the workers
        of each GPU one stream for the batches in its CUDA shared memory (``Worker.gpu_stream``)."""
        streams: dict[torch.device, torch.cuda.Stream] = {}
        for w in self.workers:
            if w.is_cuda and w.gpu_stream is None:
                if w.device not in streams:
                    streams[w.device] = torch.cuda.Stream(w.device)
                w.gpu_stream = streams[w.device]
        for w in self.workers:
            w.load(layer)

    async def acquire(self, device: int | None = None) -> Worker:
        """Wait for a worker with room for another batch and reserve it: on the device with the fewest samples in
        flight, the worker there with the fewest (with ``device``, among the workers of that GPU: a batch in its CUDA
        shared memory)."""
        if self._freed is None:
            self._freed = asyncio.Event()
        candidates = self.workers
        if device is not None:
            candidates = [w for w in self.workers if w.is_cuda and w.device.index == device] or self.workers
        while True:
            free = [w for w in candidates if w.inflight_batches < self.max_inflight_batches]
            if free:
                on_device: dict[torch.device, int] = {}
                for w in self.workers:
                    on_device[w.device] = on_device.get(w.device, 0) + w.inflight_samples
                worker = min(free, key=lambda w: (on_device[w.device], w.inflight_samples, w.inflight_batches))
                worker.inflight_batches += 1
                return worker
            self._freed.clear()
            await self._freed.wait()

    def release(self, worker: Worker) -> None:
        """Give back a reservation made with ``acquire`` (after its batch finished, or when it was not used)."""
        worker.inflight_batches -= 1
        if self._freed is not None:
            self._freed.set()

    async def run(self, worker: Worker, layer: Layer, inputs: list[AnyTensor]) -> list[AnyTensor]:
        """Execute a batch on ``worker`` (reserved with ``acquire``; released here) off the event loop."""
        n = sum(int(x.shape[0]) for x in inputs)
        worker.inflight_samples += n
        self._report(worker)
        try:
            return await asyncio.wrap_future(worker.submit(layer, inputs))
        finally:
            worker.inflight_samples -= n
            self._report(worker)
            self.release(worker)

    def _report(self, worker: Worker) -> None:
        if self.metrics is not None:
            self.metrics.worker_inflight.labels(worker.name).set(worker.inflight_samples)

    async def self_test(self, layer: Layer, seed: int = 0) -> list[str]:
        """Run ``layer`` on a small random input on every worker; compare with float64 on the CPU.

        Returns one problem line per worker whose norm-wise relative error exceeds the layer's tolerance.
        """
        c = layer.config
        g = torch.Generator().manual_seed(seed)
        h, w = min(7, c.max_height), min(5, c.max_width)
        x = torch.randn(2, c.in_channels, h, w, generator=g, dtype=torch.float64).to(layer.dtype)
        y_ref = F.conv_transpose2d(x.double(), layer.weight.double(),
                                   None if layer.bias is None else layer.bias.double(),
                                   c.stride, c.padding, c.output_padding, c.groups, c.dilation)
        problems = []
        for worker in self.workers:
            t0 = time.perf_counter()
            reserved = await self.acquire_specific(worker)
            try:
                (y,) = await self.run(reserved, layer, [x])
            except InternalError as exc:
                problems.append(f"layer {layer.name!r} on {worker.name}: {exc.message}")
                continue
            err = relative_error(y, y_ref)
            ok = bool(torch.isfinite(y).all()) and err <= layer.tolerance
            log.info("self-test %s on %s: relative error %.2e (tolerance %.0e) %s in %.0f ms", layer.name,
                     worker.name, err, layer.tolerance, "ok" if ok else "FAILED", 1e3 * (time.perf_counter() - t0))
            if not ok:
                problems.append(f"layer {layer.name!r} on {worker.name}: relative error {err:.2e} exceeds "
                                f"{layer.tolerance:.0e} ({c.dtype}, precision {c.precision})")
        return problems

    async def warm_up(self, layer: Layer, seed: int = 1) -> int:
        """Run random batches of each of the layer's ``warm_shapes`` at every batch-size bucket (``batch_buckets``)
        on every worker, so that the kernels are loaded and, with measured choice on, measured before the first
        request of that size. Buckets whose output would pass twice the layer's max batch bytes (the batcher never
        builds them) are skipped. Returns the batches run.

        Raises:
            InternalError: a batch failed (the server log has the details).
        """
        c = layer.config
        g = torch.Generator().manual_seed(seed)
        runs = 0
        for h, w in c.warm_shapes:
            h_out, w_out = layer.output_hw(h, w)
            sample_bytes = c.out_channels * h_out * w_out * layer.dtype.itemsize
            for n in batch_buckets(layer.limits.max_batch_size):
                if n > 1 and n * sample_bytes > 2 * layer.limits.max_batch_bytes:
                    break
                x = torch.randn(n, c.in_channels, h, w, generator=g).to(layer.dtype)
                for worker in self.workers:
                    reserved = await self.acquire_specific(worker)
                    await self.run(reserved, layer, [x])
                    runs += 1
        return runs

    async def acquire_specific(self, worker: Worker) -> Worker:
        """Reserve room for a batch on this particular worker (self-tests check every device)."""
        if self._freed is None:
            self._freed = asyncio.Event()
        while worker.inflight_batches >= self.max_inflight_batches:
            self._freed.clear()
            await self._freed.wait()
        worker.inflight_batches += 1
        return worker

    async def watch(self, period_s: float | None = None) -> None:
        """Restart every worker whose batch runs past ``worker_timeout_s`` or whose thread is gone (run as a task).

        A thread that dies restarts itself at once; this catches the ones that hang.
        """
        period = period_s if period_s is not None else min(1.0, self.worker_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            for worker in self.workers:
                if worker.stalled(self.worker_timeout_s):
                    worker.restart("stalled")

    def shutdown(self) -> None:
        """Stop every worker thread."""
        for w in self.workers:
            w.shutdown()


def select_devices(spec: str | list[int]) -> tuple[list[torch.device], str]:
    """Devices for ``Settings.devices`` (already parsed) and a sentence saying which backend runs and why.

    Raises:
        RuntimeError: GPUs were asked for ("all" or indices) but are not visible.
    """
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec == "cpu":
        return [torch.device("cpu")], "devices=cpu: serving on CPU with the PyTorch reference"
    if spec == "auto":
        if available == 0:
            return [torch.device("cpu")], "no CUDA device visible: serving on CPU with the PyTorch reference"
        devs = [torch.device("cuda", i) for i in range(available)]
        return devs, f"serving on {available} GPU(s) with the deconv CUDA kernels: {_names(devs)}"
    if available == 0:
        raise RuntimeError(f"devices={spec!r} asks for GPUs but no CUDA device is visible "
                           "(set DECONV_DEVICES=auto or cpu to serve on the CPU)")
    indices = list(range(available)) if spec == "all" else list(spec)
    missing = [i for i in indices if i >= available]
    if missing:
        raise RuntimeError(f"devices asks for GPU(s) {missing} but only {available} are visible")
    devs = [torch.device("cuda", i) for i in indices]
    return devs, f"serving on {len(devs)} GPU(s) with the deconv CUDA kernels: {_names(devs)}"


def _names(devs: list[torch.device]) -> str:
    return ", ".join(f"{d} ({torch.cuda.get_device_name(d)})" for d in devs)
