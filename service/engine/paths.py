"""The batch paths: how a worker thread computes one batch, as plain functions of the worker (``Runner``), the
layer, the batch's inputs and the thread's side of the batch (``Turn``: writes into memory others may reuse, and the
answers). Each worker picks one path per kind of batch when it is made (``paths_for``: ``GPU_PATHS`` or
``CPU_PATHS``); the batcher says the kind (``service.engine.kinds``). The worker thread, its generations and locks
are ``service.engine.worker``; the pool of workers is ``service.engine.pool``.

- **host** (``host_batch``; ``Kind.HOST``, and every batch on the CPU but those in shared memory): on a GPU, the
  requests' inputs are copied, where they arrived, into pinned staging memory, uploaded on the worker's CUDA stream,
  computed, downloaded into a pinned output and the stream waited for (``kernel_forward_gathered``); on the CPU,
  PyTorch's reference (``kernel_forward``). The output is then split per request (``Turn.deliver``).
- **direct** (``direct_batch``; ``Kind.SLOTS`` on a GPU): requests in page-locked slots go between their slots and
  the GPU in one extension call that releases the GIL once (``kernel_forward_direct``): megabyte inputs are uploaded
  from their slots and their outputs downloaded into them with no host copy, tiny ones go through one page-locked
  staging buffer each way, and the outputs are in their slots when the call returns.
- **placed** (``placed_batch``; ``Kind.REGIONS`` on a GPU): requests in clients' shared memory are read where they
  are, in the regions the engine mapped (``service.engine.cuda_shm``), and the outputs written into theirs, in one
  extension call that returns when the batch's own work is done (``conv_transpose2d_placed``); a request whose region
  went fails alone. Batches in a GPU's CUDA shared memory run on one stream for the GPU, shared by its workers
  (``region_stream``), so that a second batch queues behind the running one; those in system regions the engine
  page-locked, on the worker's own stream.

The CPU has no placed path (a CPU server maps no shared memory for its workers: ``no_regions``).

Out of memory is handled here alone (section "Out of memory"): a span that does not fit runs again in halves
(``forward_span``; ``conv_transpose2d_staged`` from the batch staged whole), down to one sample; a direct batch that
does not fit takes that path instead (``direct_batch``); one sample that does not fit, or any other failure, fails
the batch with ``InternalError`` (``guarded``), and the worker keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

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
    copy_into,
    raw_view,
)
from service.engine.cuda_shm import CudaRegions
from service.engine.kinds import Output, Request
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

# (input [N, C_in, H, W], weight, bias, layer) -> output [N, C_out, H_out, W_out]; replaceable in tests.
ForwardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, Layer], torch.Tensor]
# (requests' inputs [n_i, C_in, H, W] on the host, CUDA weight, bias, layer, the weight's packs) -> pinned host output
# [N, C_out, H_out, W_out]: the GPU worker's step, which returns once the output is there.
GatheredFn = Callable[[Sequence[AnyTensor], torch.Tensor, torch.Tensor | None, Layer, WeightPacks | None],
                      torch.Tensor]
# (requests' inputs in their slots, CUDA weight, bias, layer, the weight's packs): the GPU worker's step for a batch
# of requests in page-locked slots, which takes each input from its slot, puts each output into its slot and
# returns once they are there.
DirectFn = Callable[[Sequence[SlotTensor], torch.Tensor, torch.Tensor | None, Layer, WeightPacks | None], None]
# A layer on a worker: its weight, bias and, on a GPU, the weight's packed copies.
Weights = tuple[torch.Tensor, torch.Tensor | None, WeightPacks | None]
_T = TypeVar("_T")


# --- the kernels' steps -------------------------------------------------------------------------------------------


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


def kernel_forward_gathered(inputs: Sequence[AnyTensor], weight: torch.Tensor, bias: torch.Tensor | None,
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


def kernel_forward_direct(inputs: Sequence[SlotTensor], weight: torch.Tensor, bias: torch.Tensor | None,
                          layer: Layer, packs: WeightPacks | None = None) -> None:
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


@dataclass(frozen=True)
class Steps:
    """A worker's kernel calls (each replaceable in tests; a worker takes this module's when it is made): the CPU's
    (``kernel_forward``), the GPU's for host inputs (``kernel_forward_gathered``), and the GPU's for inputs in
    page-locked slots (``kernel_forward_direct``)."""

    forward: ForwardFn
    gathered: GatheredFn
    direct: DirectFn


# --- what a path uses of its worker and its thread ----------------------------------------------------------------


class Runner(Protocol):
    """What a path uses of its worker (``service.engine.worker.Worker`` is one)."""

    name: str
    device: torch.device
    metrics: Metrics | None
    faults: Faults | None
    steps: Steps
    weights: dict[str, Weights]
    stream: torch.cuda.Stream | None  # the worker's own (GPU)
    gpu_stream: torch.cuda.Stream | None  # its GPU's, for batches in CUDA shared memory
    regions: CudaRegions | None  # the engine's shared-memory regions

    @property
    def is_cuda(self) -> bool: ...


class Turn(Protocol):
    """The worker thread's side of one batch (``service.engine.worker``: "Threads and locks")."""

    def writes(self) -> contextlib.AbstractContextManager[None]:
        """Around a call in which the GPU writes into memory other requests may later use (slots, clients' regions):
        it starts only if the thread is still the worker's current one, and a replacement leaves the batch to it.

        Raises:
            InternalError: the thread was replaced before the batch started.
        """
        ...

    def deliver(self, inputs: Sequence[AnyTensor], y: torch.Tensor) -> list[AnyTensor]:
        """The batch's output ``y`` split per request (into the slots, unless the thread was replaced)."""
        ...


# A batch path: (worker, layer, the batch's inputs, the thread's side of it) -> one answer per request.
Path = Callable[[Runner, Layer, Sequence[Request], Turn], list[Output]]


def sample_count(inputs: Sequence[Request]) -> int:
    """The samples of a batch: its inputs' first dimensions together."""
    return sum(int(x.shape[0]) for x in inputs)


def count_failure(w: Runner, kind: str) -> None:
    if w.metrics is not None:
        w.metrics.worker_failures.labels(w.name, kind).inc()


def guarded(w: Runner, layer: Layer, inputs: Sequence[Request], run: Callable[[], _T]) -> _T:
    """``run()``, the batch's execution, with the worker's metrics, fault hooks and errors around it: any failure
    becomes ``InternalError`` (out of memory: after the halving in ``forward_span`` gave up)."""
    if w.metrics is not None:
        w.metrics.worker_busy.labels(w.name).set(1)
    try:
        if w.faults is not None:
            w.faults.before_batch(layer.name, sample_count(inputs))
        return run()
    except InternalError:
        raise
    except torch.cuda.OutOfMemoryError as exc:
        count_failure(w, "oom")
        log.error("worker %s: out of memory for one sample of layer %s %s", w.name, layer.name,
                  list(inputs[0].shape[1:]))
        raise InternalError(f"out of GPU memory on {w.name} even for a single sample") from exc
    except Exception as exc:
        count_failure(w, "error")
        log.exception("worker %s: batch of layer %s failed", w.name, layer.name)
        raise InternalError(f"batch execution failed on {w.name} ({type(exc).__name__}); "
                            f"see the server log") from exc
    finally:
        if w.metrics is not None:
            w.metrics.worker_busy.labels(w.name).set(0)
            w.metrics.worker_batches.labels(w.name).inc()


@contextlib.contextmanager
def on_device(w: Runner, stream: torch.cuda.Stream | None) -> Iterator[None]:
    """The worker's device and ``stream`` current (nothing on the CPU)."""
    if not w.is_cuda:
        yield
        return
    with torch.cuda.device(w.device), torch.cuda.stream(stream):
        yield


def out_shape(layer: Layer, x: Request) -> tuple[int, int, int, int]:
    """The output's shape for input ``x``."""
    n, _, h, w = x.shape
    return (int(n), layer.config.out_channels, *layer.output_hw(int(h), int(w)))


# --- host: staged on a GPU, as they are on the CPU ----------------------------------------------------------------


def host_batch(w: Runner, layer: Layer, inputs: Sequence[AnyTensor], turn: Turn) -> list[AnyTensor]:
    """The batch's output on the host (``forward_span``), split per request (``Turn.deliver``)."""
    y = guarded(w, layer, inputs, lambda: forward_span(w, layer, inputs, None))
    return turn.deliver(inputs, y)


def gather(inputs: Sequence[AnyTensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The inputs concatenated along the batch dimension (into ``out`` when given)."""
    raw = [x for x in inputs if isinstance(x, RawTensor)]
    if len(raw) == len(inputs):  # the bytes as they arrived: one copy each into the batch
        if out is None:
            n = sum(x.shape[0] for x in raw)
            out = torch.empty((n, *raw[0].shape[1:]), dtype=raw[0].dtype)
        copy_into(out, raw)
        return out
    tensors = [as_tensor(x) for x in inputs]
    if out is not None:
        return torch.cat(tensors, out=out)
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def stage(w: Runner, layer: Layer, inputs: Sequence[AnyTensor], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch copied into pinned memory ``[N, C_in, H, W]``, and a pinned output for it."""
    _, c_in, h, wd = inputs[0].shape
    h_out, w_out = layer.output_hw(h, wd)
    with torch.cuda.device(w.device), torch.cuda.stream(w.stream):
        host_in = torch.empty((n, c_in, h, wd), dtype=layer.dtype, pin_memory=True)
        gather(inputs, out=host_in)
        host_out = torch.empty((n, layer.config.out_channels, h_out, w_out), dtype=layer.dtype, pin_memory=True)
    return host_in, host_out


def forward_once(w: Runner, layer: Layer, inputs: Sequence[AnyTensor], out: torch.Tensor | None) -> torch.Tensor:
    """One attempt of ``forward_span``, without retries."""
    weight, bias, packs = w.weights[layer.name]
    if not w.is_cuda:
        x = gather(inputs)
        with torch.inference_mode():
            return w.steps.forward(x, weight, bias, layer)
    with torch.cuda.device(w.device), torch.cuda.stream(w.stream):
        if out is None:
            return w.steps.gathered(inputs, weight, bias, layer, packs)  # [N, C_out, H_out, W_out], pinned
        x = gather(inputs)
        with torch.inference_mode():
            kernel_forward_staged(x, weight, bias, layer, out, packs)
        return out


# --- out of memory ------------------------------------------------------------------------------------------------


def forward_span(w: Runner, layer: Layer, inputs: Sequence[AnyTensor], out: torch.Tensor | None) -> torch.Tensor:
    """The layer on ``inputs`` ([n_i, C_in, H, W] each, on the host): the output [n, C_out, H_out, W_out] on the
    host. The one out-of-memory path: a span that does not fit runs again in halves, each halved again if need be; a
    single sample that does not fit raises ``torch.cuda.OutOfMemoryError`` (``guarded`` makes it ``InternalError``).

    ``out`` None: the requests' inputs as they arrived (a GPU worker reads them where they are, ``Steps.gathered``).
    Else, on a GPU, ``inputs`` is one span of the batch staged in pinned memory and ``out`` its place in the pinned
    output (``kernel_forward_staged``).
    """
    n = sample_count(inputs)
    try:
        if w.faults is not None:
            w.faults.before_forward(layer.name, n)
        return forward_once(w, layer, inputs, out)
    except torch.cuda.OutOfMemoryError:
        if n <= 1:
            raise
    # Retry outside the except block, so that the failed attempt's tensors (held by the traceback) are freed.
    out_of_memory(w, f"out of memory for {n} samples of layer {layer.name}; retrying in halves")
    if out is None and w.is_cuda:  # the first split stages the batch whole: its halves are spans of it
        x, out = stage(w, layer, inputs, n)
    else:
        x = gather(inputs)
    half = n // 2
    if out is None:
        return torch.cat([forward_span(w, layer, [x[:half]], None), forward_span(w, layer, [x[half:]], None)])
    forward_span(w, layer, [x[:half]], out[:half])
    forward_span(w, layer, [x[half:]], out[half:])
    return out


def out_of_memory(w: Runner, what: str) -> None:
    """An attempt ran out of memory and is retried another way: counted, logged, and the allocator's cache freed."""
    count_failure(w, "oom_retry")
    log.warning("worker %s: %s", w.name, what)
    if w.is_cuda:
        torch.cuda.empty_cache()


# --- direct: between page-locked slots and the GPU -----------------------------------------------------------------


def direct_batch(w: Runner, layer: Layer, inputs: Sequence[SlotTensor], turn: Turn) -> list[AnyTensor]:
    """The batch taken from its slots and each output put into its slot in one call (``Steps.direct``: megabyte ones
    by DMA with no host copy, tiny ones staged, one upload and one download a batch); each answer is a view of its
    slot.

    The GPU writes the slots while the call runs, so the rule that only the current thread writes into slots
    (``Turn.deliver``) holds another way: the call runs inside ``Turn.writes``. Out of memory (before anything is
    written): the host path's halving (``forward_span``), then ``Turn.deliver``."""
    return guarded(w, layer, inputs, lambda: _direct(w, layer, inputs, turn))


def _direct(w: Runner, layer: Layer, inputs: Sequence[SlotTensor], turn: Turn) -> list[AnyTensor]:
    weight, bias, packs = w.weights[layer.name]
    if w.faults is not None:  # before anything is written: a thread stalled here is replaced as any other
        w.faults.before_forward(layer.name, sample_count(inputs))
    try:
        with turn.writes(), on_device(w, w.stream):
            w.steps.direct(inputs, weight, bias, layer, packs)
    except torch.cuda.OutOfMemoryError:
        pass  # retried below, outside the except block, so that the failed attempt's tensors are freed
    else:
        if w.metrics is not None:
            w.metrics.worker_direct_batches.labels(w.name).inc()
        _, c_out, h_out, w_out = out_shape(layer, inputs[0])  # each x.out is exactly its output (SlotTensor)
        return [raw_view(x.out, x.dtype, (int(x.shape[0]), c_out, h_out, w_out)) for x in inputs]
    out_of_memory(w, f"out of memory for a batch of layer {layer.name} straight from its slots; staging it instead")
    return turn.deliver(inputs, forward_span(w, layer, inputs, None))


# --- placed: where clients' shared memory lies ---------------------------------------------------------------------

# (worker, regions, layer, jobs, answers, leased regions): computes a batch of requests in shared memory, setting the
# answers of host outputs and of requests that fail alone.
RegionsFn = Callable[[Runner, CudaRegions, Layer, Sequence[CudaJob], list[Output | None], list[str]], None]


def placed_batch(w: Runner, layer: Layer, jobs: Sequence[CudaJob], turn: Turn) -> list[Output]:
    """The batch computed where its requests' tensors lie (``in_regions``, ``placed``)."""
    return guarded(w, layer, jobs, lambda: in_regions(w, layer, jobs, turn, placed))


def in_regions(w: Runner, layer: Layer, jobs: Sequence[CudaJob], turn: Turn, compute: RegionsFn) -> list[Output]:
    """A batch of requests in shared memory the engine maps, computed by ``compute``: the regions held for the batch
    (``CudaRegions.place``; one unregistered meanwhile is unmapped after it) and released after it, on the batch's
    stream (``region_stream``), inside ``Turn.writes``, since the GPU writes the clients' regions: a client told its
    request failed could otherwise find a late write in a region it uses again. A request whose region went, or whose
    output does not fit, fails alone (its ``RegionError`` is its answer)."""
    regions = w.regions
    if regions is None:
        raise InternalError(f"worker {w.name} has no CUDA shared memory")
    answers: list[Output | None] = [job.out for job in jobs]  # None: a host output, set once computed
    leased: list[str] = []
    stream = region_stream(w, jobs)
    with turn.writes(), on_device(w, stream):
        try:
            compute(w, regions, layer, jobs, answers, leased)  # returns with its work done
        except BaseException:
            if stream is not None:  # copies queued before a failure read and write the regions too
                stream.synchronize()
            raise
        finally:
            for token in leased:
                regions.release(token)
    return [InternalError("no output") if a is None else a for a in answers]


def region_stream(w: Runner, jobs: Sequence[CudaJob]) -> torch.cuda.Stream | None:
    """The stream of a batch of requests in shared memory. In a GPU's CUDA shared memory (``CudaJob.device`` >= 0),
    the GPU's (``Runner.gpu_stream``): such a batch has no transfers to overlap, and a second one (the batcher sends it
    only when the lane's batches are long) queues behind the running one, so that the GPU goes from one batch to the
    next while each worker thread does its host work between its own batches. On two streams the batches' small
    device-to-device copies, which run on the GPU's cores, waited behind the other stream's kernel, so both batches
    ended together and the GPU idled while both threads got their next ones (bench/NOTES.md). In system regions, the
    worker's own: its copies over PCIe overlap the other's kernels."""
    if jobs[0].device >= 0 and w.gpu_stream is not None:
        return w.gpu_stream
    return w.stream


def placed(w: Runner, regions: CudaRegions, layer: Layer, jobs: Sequence[CudaJob], answers: list[Output | None],
           leased: list[str]) -> None:
    """On a GPU: each request's input and output as a place (``ops.Place``), then one call
    (``conv_transpose2d_placed``: a lone request in its GPU's memory is read, and its output written, in place)."""
    weight, bias, packs = w.weights[layer.name]
    parts: list[Place] = []
    outs: list[Place] = []
    held: list[object] = []  # host memory the call reads or writes, alive until it returns
    n = 0
    for i, job in enumerate(jobs):
        try:
            if job.dtype != weight.dtype:
                raise InternalError(f"a {job.dtype} request in a batch of a {weight.dtype} layer")
            part = _input_place(w, regions, job, leased, held)
            out = _output_place(w, regions, layer, job, leased)
        except ServiceError as exc:
            answers[i] = exc
            continue
        if out is None:  # the output goes to the host
            host = torch.empty(out_shape(layer, job), dtype=weight.dtype, pin_memory=True)
            answers[i] = host
            out = host.data_ptr(), host.nbytes
        parts.append(part)
        outs.append(out)
        n += int(job.shape[0])
    if parts:
        shape = (n, *(int(d) for d in jobs[0].shape[1:]))
        conv_transpose2d_placed(parts, outs, shape, weight, bias, layer.args, layer.kernel_precision,
                                serving_choice(shape, weight, bias, layer, packs), packs)


def _input_place(w: Runner, regions: CudaRegions, job: CudaJob, leased: list[str], held: list[object]) -> Place:
    """Where the job's input is: in its region (held), or host bytes (kept in ``held``)."""
    x = job.x
    if isinstance(x, DeviceTensor):
        place = regions.place(x.token, x.offset, x.nbytes, region_gpu(w, job))
        leased.append(x.token)
        return place
    data: memoryview | torch.Tensor = x.data if isinstance(x, RawTensor) else x.contiguous()
    held.append(data)
    return host_place(data)


def _output_place(w: Runner, regions: CudaRegions, layer: Layer, job: CudaJob, leased: list[str]) -> Place | None:
    """Where the job's output goes in its region (held), or None: to the host.

    Raises:
        RegionError: the region does not hold this output.
    """
    out = job.out
    if out is None:
        return None
    place = regions.place(out.token, out.offset, output_bytes(layer, job), region_gpu(w, job))
    leased.append(out.token)
    return place


def output_bytes(layer: Layer, job: CudaJob) -> int:
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


def region_gpu(w: Runner, job: CudaJob) -> int:
    """The GPU whose regions this worker reads (a CPU worker, in tests, reads any)."""
    return w.device.index if w.is_cuda and w.device.index is not None else job.device


def no_regions(w: Runner, layer: Layer, jobs: Sequence[CudaJob], turn: Turn) -> list[Output]:
    """On the CPU: none (a CPU server maps no shared memory for its workers)."""
    raise InternalError(f"worker {w.name} computes on the CPU: requests in shared memory need a GPU")


# --- each kind's path, chosen once a worker --------------------------------------------------------------------------


@dataclass(frozen=True)
class Paths:
    """A worker's path for each kind of batch (``service.engine.kinds.Kind``)."""

    host: Callable[[Runner, Layer, Sequence[AnyTensor], Turn], list[AnyTensor]]
    slots: Callable[[Runner, Layer, Sequence[SlotTensor], Turn], list[AnyTensor]]
    regions: Callable[[Runner, Layer, Sequence[CudaJob], Turn], list[Output]]


GPU_PATHS = Paths(host=host_batch, slots=direct_batch, regions=placed_batch)
CPU_PATHS = Paths(host=host_batch, slots=host_batch, regions=no_regions)


def paths_for(device: torch.device) -> Paths:
    """The paths of a worker on ``device``."""
    return GPU_PATHS if device.type == "cuda" else CPU_PATHS

