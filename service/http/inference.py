"""The steps of an inference request, shared by every front end: the native route (``service.http.native_routes``),
the KServe v2 HTTP routes (``service.http.kserve_routes``) and the KServe v2 gRPC service (``service.grpc.server``).

A request finds its layer and the layer's queue (``find_layer``), has its decoded input checked against the layer
(``validate_input``; its output's size: ``output_bytes``) and an input or output in a shared-memory region found and
checked (``region_input``, ``output_place``), is queued and waited for (``run_inference``: the result, the deadline,
the request timeout or the client leaving), and is counted in the metrics (``Counted``). Over HTTP its API key and
deadline header were checked before its route ran (``service.http.asgi.admit``); ``get_engine`` gives FastAPI's
routes the app's engine.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from service import codec
from service.codec import AnyTensor, DeviceTensor
from service.engine.interface import LayerQueue, Result, Ticket
from service.engine.kserve import find_model
from service.engine.registry import Layer
from service.errors import (
    ClientGoneError,
    DeadlineExceededError,
    InvalidInputError,
    NotReadyError,
    PayloadTooLargeError,
    RegionError,
    ServiceError,
)
from service.http.asgi import MAX_DEADLINE_MS

if TYPE_CHECKING:
    from fastapi import Request

    from service.engine.interface import Engine
    from service.http.asgi import Call
    from service.http.shm_regions import RegionTable, RegionWriter, TensorRef

# The largest KServe parameters.timeout, in us: as X-Deadline-Ms's largest (service.http.asgi).
MAX_TIMEOUT_US = MAX_DEADLINE_MS * 1000


def get_engine(request: Request) -> Engine:
    """The app's ``Engine``."""
    return request.app.state.engine  # type: ignore[no-any-return]


def find_layer(engine: Engine, name: str, version: str | None = None) -> tuple[Layer, LayerQueue]:
    """The layer called ``name`` (at ``version`` when given) and its queue.

    Raises:
        UnknownLayerError: no such layer, or no such version (404).
    """
    return find_model(engine, name, version), engine.queues[name]


def output_bytes(layer: Layer, x4: AnyTensor | DeviceTensor) -> int:
    """Bytes of the output of ``x4`` ([N, C_in, H, W], validated) in its dtype."""
    n, _, h, w = x4.shape
    return layer.output_bytes(int(n), int(h), int(w))


def output_values(layer: Layer, x4: AnyTensor) -> int:
    """Values in the output of ``x4`` ([N, C_in, H, W], validated)."""
    return output_bytes(layer, x4) // x4.element_size()


def validate_input(layer: Layer, x: AnyTensor) -> tuple[AnyTensor, bool]:
    """Check a decoded tensor against the layer; return it as ``[N, C_in, H, W]`` and whether it was 3-D.

    Raises:
        InvalidInputError: rank, dtype, channels or spatial size do not fit (422).
        PayloadTooLargeError: more samples or output bytes than one batch of this layer may hold (413).
    """
    c = layer.config
    if len(x.shape) not in (3, 4):
        raise InvalidInputError(f"expected [N, C, H, W] or [C, H, W], got shape {list(x.shape)}")
    if x.dtype != layer.dtype:
        raise InvalidInputError(f"dtype {codec.DTYPE_NAMES.get(x.dtype, str(x.dtype))} does not match layer "
                           f"{c.name!r}, which takes {c.dtype}")
    unbatched = len(x.shape) == 3
    x4 = x.reshape((1, *x.shape)) if unbatched else x
    n, ch, h, w = x4.shape
    if ch != c.in_channels:
        raise InvalidInputError(f"input has {ch} channels; layer {c.name!r} takes {c.in_channels}")
    if not (1 <= h <= c.max_height and 1 <= w <= c.max_width):
        raise InvalidInputError(f"spatial size {h} x {w} is outside layer {c.name!r}'s limits "
                           f"(1..{c.max_height} x 1..{c.max_width})")
    h_out, w_out = layer.output_hw(h, w)
    if h_out <= 0 or w_out <= 0:
        raise InvalidInputError(f"input {h} x {w} gives an empty output ({h_out} x {w_out}); "
                           f"output size: {layer.output_formula()}")
    limits = layer.limits
    if n > limits.max_batch_size:
        raise PayloadTooLargeError(f"{n} samples exceed layer {c.name!r}'s max_batch_size of {limits.max_batch_size}; "
                              "split the request")
    out_bytes = n * c.out_channels * h_out * w_out * x.element_size()
    if out_bytes > limits.max_batch_bytes:
        raise PayloadTooLargeError(f"output of {out_bytes} bytes exceeds layer {c.name!r}'s max_batch_bytes of "
                              f"{limits.max_batch_bytes}; send fewer samples or a smaller input")
    return x4, unbatched


def region_input(regions: RegionTable, ref: TensorRef, dtype: torch.dtype, shape: tuple[int, ...],
                 hold: Callable[[int], None]) -> codec.SourceTensor | DeviceTensor:
    """The input in its region (its size checked by the caller). In a region the engine maps (a CUDA region, or a
    system region it page-locked) it stays there: the request names it, and the engine's GPU worker reads it. In
    another system region its bytes are read when the request is queued, straight into the engine link's arena
    where its queue takes them there (``RemoteQueue.takes_sources``), else into a copy; they are held in the
    bytes-in-flight budget either way (``hold``). The caller queues the request with no await between this
    check and the read."""
    if regions.by_reference(ref.region):
        return regions.device_tensor(ref.region, ref.offset, ref.byte_size, dtype, shape)
    hold(ref.byte_size)
    return codec.SourceTensor(regions.reader(ref.region, ref.offset, ref.byte_size), dtype, shape)


def timeout_ms(params: object) -> float | None:
    """KServe's ``parameters.timeout`` (microseconds, as tritonclient's ``timeout`` argument sends it) in ms; None
    when absent or 0. ``params``: the request's parameters (anything but a dict holds none). It bounds the time in
    the queue, like X-Deadline-Ms; HTTP and gRPC read it alike.

    Raises:
        InvalidInputError: not a number, or outside 0..``MAX_TIMEOUT_US`` (422 over HTTP).
    """
    value = params.get("timeout") if isinstance(params, dict) else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInputError(f"parameters.timeout must be a number of microseconds, got {type(value).__name__}")
    if not 0 <= value <= MAX_TIMEOUT_US:  # NaN and infinity too; a huge integer compares without converting
        raise InvalidInputError(f"parameters.timeout must be between 0 and {MAX_TIMEOUT_US} microseconds")
    return value / 1000 if value > 0 else None


def output_place(regions: RegionTable, layer: Layer, x4: AnyTensor | DeviceTensor, ref: TensorRef,
                 hold: Callable[[int], None]) -> DeviceTensor | RegionWriter:
    """Check the output's region: large enough for the output of ``x4``, and its bytes inside it. In a region the
    engine maps: the output's place there (the engine writes it, under the registration checked now). In another
    system region: a ``RegionWriter`` that the front end writes the result through once it is back, into the object
    checked now whatever the region's name stands for by then; the output's bytes are taken with ``hold``.

    Raises:
        RegionError: the region is too small for the output, or the bytes are not all inside it.
        UnknownRegionError: no such region.
    """
    need = output_bytes(layer, x4)
    if ref.byte_size < need:
        raise RegionError(f"output shared_memory_byte_size is {ref.byte_size}; the output needs {need} bytes")
    if regions.by_reference(ref.region):
        n, _, h, w = (int(d) for d in x4.shape)
        shape = (n, layer.config.out_channels, *layer.output_hw(h, w))
        return regions.device_tensor(ref.region, ref.offset, ref.byte_size, x4.dtype, shape)
    writer = regions.writer(ref.region, ref.offset, ref.byte_size)
    hold(need)
    return writer


def engine_request(x4: AnyTensor | DeviceTensor | codec.SourceTensor, out_device: DeviceTensor | None,
                   batcher: LayerQueue) -> AnyTensor | codec.CudaJob:
    """The form in which a checked request is queued: a region input read now unless its queue reads it where the
    request is sent (``takes_sources``) and its output goes nowhere the engine maps; a ``CudaJob`` for the engine's
    GPU worker of the regions when the input or the output lies in a region it maps."""
    if isinstance(x4, codec.SourceTensor) and (out_device is not None or not getattr(batcher, "takes_sources", False)):
        x4 = x4.load()
    if isinstance(x4, DeviceTensor) or out_device is not None:
        return codec.CudaJob(x4, out_device)
    return x4  # type: ignore[return-value]


def region_output(y: AnyTensor, writer: RegionWriter | None) -> int:
    """The output's bytes in its region: written here through ``writer`` (a system region the engine does not map;
    ``output_place``), else already there (the engine wrote them)."""
    if writer is None:
        return math.prod(y.shape) * y.element_size()
    data = codec.bytes_of(y)
    writer.write(data)
    return data.nbytes


async def run_inference(
    engine: Engine, layer: Layer, batcher: LayerQueue, x4: AnyTensor, call: Call, received: float,
    deadline_ms: float | None,
) -> Result:
    """Queue ``x4`` and wait for its result, its deadline, the request timeout, or the client leaving.

    A request still queued when its client leaves or its deadline passes is dropped from the queue.
    """
    timeout_at = received + engine.settings.request_timeout_s
    deadline = received + deadline_ms / 1000 if deadline_ms is not None else None
    if x4.shape[0] == 0:  # nothing to compute: an empty batch of the right shape
        h_out, w_out = layer.output_hw(int(x4.shape[2]), int(x4.shape[3]))
        return Result(torch.empty((0, layer.config.out_channels, h_out, w_out), dtype=x4.dtype), 0, 0, 0.0, "")
    item: Ticket = batcher.submit(x4, received=received, deadline=deadline)
    # Wait for whichever comes first: the result, the client leaving, the deadline or the request timeout. One
    # future woken by callbacks: asyncio.wait would build sets, a waiter and callbacks on every call.
    loop = item.future.get_loop()  # the running loop, without asyncio.get_running_loop()'s getpid on Python 3.11
    wake = loop.create_future()

    def wake_up(_: object = None) -> None:
        if not wake.done():
            wake.set_result(None)

    item.future.add_done_callback(wake_up)
    gone = False

    def client_gone() -> None:
        nonlocal gone
        gone = True
        wake_up()

    unwatch = call.on_disconnect(client_gone)
    try:
        while True:
            limit = timeout_at if item.started or deadline is None else min(timeout_at, deadline)
            timer = loop.call_later(max(0.0, limit - time.monotonic()), wake_up)
            try:
                await wake
            finally:
                timer.cancel()
            wake = loop.create_future()
            if item.future.done():
                if item.future.cancelled():
                    raise NotReadyError("the request was cancelled by the server")
                return item.future.result()
            if gone:
                batcher.drop(item, "disconnected")
                raise ClientGoneError("client disconnected")
            now = time.monotonic()
            if now >= timeout_at:
                batcher.drop(item, "timeout")
                raise DeadlineExceededError(
                    f"no result within the request timeout of {engine.settings.request_timeout_s:g} s")
            if deadline is not None and now >= deadline and batcher.drop(item, "deadline"):
                raise DeadlineExceededError.before_execution(deadline_ms)
    finally:
        unwatch()
        if item.state == "queued":  # this task was cancelled: nobody waits for the result any more
            batcher.drop(item, "cancelled")
        if item.future.done() and not item.future.cancelled():
            item.future.exception()  # mark as retrieved


class Counted:
    """One inference request's count in the metrics, the context its handler runs in: received when it is made,
    counted when the handler ends, under its layer (``"unknown"`` for a name that is none), its ``api`` and its
    status: 200 when the handler returns, a ``ServiceError``'s own, ``ClientGoneError``'s (499) when the handler's
    task is cancelled, 500 for any other error."""

    __slots__ = ("api", "engine", "label", "received")

    def __init__(self, engine: Engine, name: str, api: str) -> None:
        self.engine = engine
        self.api = api
        self.received = time.monotonic()
        self.label = name if engine.registry is not None and engine.registry.get(name) else "unknown"

    def __enter__(self) -> Counted:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if error is None:
            status = 200
        elif isinstance(error, ServiceError):
            status = error.status
        elif isinstance(error, asyncio.CancelledError):
            status = ClientGoneError.status
        else:
            status = 500
        self.engine.metrics.count_request(self.label, self.api, status, time.monotonic() - self.received)


def batch_headers(result: Result) -> dict[str, str]:
    """The headers that tell a client about its request's batch: its samples and the time queued."""
    return {"X-Deconv-Batch-Size": str(result.batch_samples), "X-Deconv-Queue-Ms": f"{1e3 * result.queue_s:.3f}"}
