"""The KServe v2 gRPC front end: ``inference.GRPCInferenceService``, what ``tritonclient.grpc`` speaks, on grpcio's
asyncio server (docs/protocol.md, "gRPC").

It serves beside the HTTP app of its process, on the same event loop and the same objects: the ``Engine`` (so a
gRPC request joins the same layer queue as an HTTP one, and the two batch together), the shared-memory
``RegionTable`` (a region registered over either protocol serves both) and the bytes-in-flight ``Budget``. It is
started and stopped by the app's lifespan as a ``service.http.app.Companion`` (``serving``): in a server of one
process by ``python -m service``, in each HTTP process of a multi-process server by ``service.grpc.frontend``, every
one of them on the same port (``SO_REUSEPORT``, reserved by the supervisor).

Each request takes the path of its HTTP twin: the API key (``authorization: Bearer <key>`` metadata), the model
and readiness checks, the input decoded into a ``codec.RawTensor`` over the message's bytes (or a reference to a
shared-memory region), ``service.http.inference.validate_input``, the bytes taken from the budget, then
``service.http.inference.run_inference``, which queues it and waits for the result, the deadline (the call's gRPC
deadline, or ``parameters.timeout``, whichever is earlier, bounds its time in the queue) or the request timeout.
A client that cancels or goes away cancels the handler's task (grpc.aio does), which drops the request from the
queue. Every ``ServiceError`` becomes the gRPC status of ``service.errors.grpc_code`` with its message; anything
else is logged and answered ``INTERNAL``. The layers' metadata, configuration, repository index and statistics
are the dicts of ``service.engine.kserve``, the HTTP routes' own, parsed into the messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc
import numpy as np
import torch
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from service import codec
from service.budget import Held
from service.codec import AnyTensor, DeviceTensor, RawTensor
from service.config import VERSION, inflight_limit
from service.engine.kserve import (
    KSERVE_DTYPES,
    KSERVE_INPUT,
    KSERVE_NAMES,
    KSERVE_OUTPUT,
    MODEL_VERSION,
    find_model,
    model_config,
    model_metadata,
    model_statistics,
    repository_index,
)
from service.errors import (
    InternalError,
    InvalidInputError,
    MalformedBodyError,
    RegionError,
    ServiceError,
    UnauthorizedError,
    grpc_code,
)
from service.grpc.messages import SERVICE, message, service
from service.http.inference import (
    Counted,
    engine_request,
    find_layer,
    output_bytes,
    output_place,
    region_input,
    region_output,
    run_inference,
    timeout_ms,
    validate_input,
)
from service.http.shm_regions import CUDA, SYSTEM, RegionTable, RegionWriter, TensorRef, tensor_ref
from service.http.shm_routes import register_cuda, register_system, unregister_cuda, unregister_system

if TYPE_CHECKING:
    from service.budget import Budget
    from service.http.asgi import App

log = logging.getLogger("deconv.service")

SERVER_NAME = "deconv"
# Concurrent calls one process takes at least (``grpc.aio.server``'s ``maximum_concurrent_rpcs``; more are refused
# with RESOURCE_EXHAUSTED), so that the messages held before their calls are checked stay bounded: the process's
# bytes-in-flight bound over the largest message, but never fewer than this.
MIN_CONCURRENT_RPCS = 64
# The typed contents a floating-point input may come in (the others travel as raw_input_contents).
_TYPED_CONTENTS = {"FP32": ("fp32_contents", np.float32), "FP64": ("fp64_contents", np.float64)}


class _Cancelled:
    """``run_inference``'s watch on the client: grpc.aio cancels the handler's task when the client cancels or
    goes away, which drops the request from its queue, so there is nothing else to watch."""

    @staticmethod
    def on_disconnect(callback: Callable[[], None]) -> Callable[[], None]:
        return _nothing


def _nothing() -> None:
    return None


def _parameters(params: Any) -> dict[str, Any]:
    """A map of ``InferParameter`` as plain values (what the HTTP routes read from JSON)."""
    values = {}
    for key, param in params.items():
        which = param.WhichOneof("parameter_choice")
        values[key] = getattr(param, which) if which is not None else None
    return values


class GRPCFrontEnd:
    """The gRPC server of one process, on the objects of its HTTP app (the module docstring)."""

    def __init__(self, app: App) -> None:
        self.engine = app.engine
        self.settings = self.engine.settings
        self.regions: RegionTable = app.state.regions
        self.budget: Budget = app.budget
        self.server: grpc.aio.Server | None = None
        self.port = 0
        key = self.settings.api_key
        self._key = key.get_secret_value().encode() if key is not None else None

    # --- life cycle ------------------------------------------------------------------------------------------

    async def start(self, host: str, port: int, *, reuse_port: bool) -> int:
        """Listen on ``host:port`` (``reuse_port``: beside the other HTTP processes of the server); the port.

        Raises:
            OSError: the port cannot be bound.
        """
        largest = self.settings.max_body_bytes
        server = grpc.aio.server(
            options=[
                # The request message is bounded as an HTTP body is; the answer by the layer's batch limits.
                ("grpc.max_receive_message_length", largest),
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 1 if reuse_port else 0),
            ],
            maximum_concurrent_rpcs=max(MIN_CONCURRENT_RPCS, inflight_limit(self.settings) // largest))
        server.add_generic_rpc_handlers((self._handlers(),))
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError as exc:  # grpcio raises this when the address cannot be bound
            raise OSError(f"cannot listen for gRPC on {address}: {exc}") from None
        if not bound:
            raise OSError(f"cannot listen for gRPC on {address}")
        await server.start()
        self.server, self.port = server, bound
        log.info("gRPC (KServe v2, inference.GRPCInferenceService) listening on %s:%d", host, bound)
        return bound

    async def stop(self) -> None:
        """Refuse new calls and let the calls in progress end (at most the request timeout)."""
        if self.server is not None:
            await self.server.stop(self.settings.request_timeout_s)
            self.server = None

    def _handlers(self) -> grpc.GenericRpcHandler:
        """Every method of ``inference.proto``'s service, each on its handler here (``_<method>``)."""
        methods = {}
        for method in service().methods:
            request = message(method.input_type.name)
            response = message(method.output_type.name)
            handler = getattr(self, f"_{method.name}")
            infer = method.name == "ModelInfer"
            methods[method.name] = grpc.unary_unary_rpc_method_handler(
                _answered(handler), request_deserializer=_parse_request if infer else request.FromString,
                response_serializer=_serialize_answer if infer else response.SerializeToString)
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        """When an API key is configured, demand ``authorization: Bearer <key>`` metadata (as HTTP's header)."""
        if self._key is None:
            return
        value = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), "")
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise UnauthorizedError("missing or wrong API key; send the metadata 'authorization: Bearer <key>'")

    # --- health and metadata ---------------------------------------------------------------------------------

    async def _ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return message("ServerLiveResponse")(live=True)

    async def _ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return message("ServerReadyResponse")(ready=self.engine.readiness.ready)

    async def _ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        extensions = ["model_configuration", "model_repository", "statistics"]
        if self.regions.enabled:
            extensions.append("system_shared_memory")
        if self.engine.cuda_memory.available:
            extensions.append("cuda_shared_memory")
        return message("ServerMetadataResponse")(name=SERVER_NAME, version=VERSION, extensions=extensions)

    async def _ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        find_model(self.engine, request.name, request.version or None)
        return message("ModelReadyResponse")(ready=self.engine.readiness.ready)

    async def _ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        layer = find_model(self.engine, request.name, request.version or None)
        return _parsed(model_metadata(layer), "ModelMetadataResponse")

    async def _ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        layer = find_model(self.engine, request.name, request.version or None)
        return _parsed({"config": model_config(self.engine, layer)}, "ModelConfigResponse")

    async def _ModelStatistics(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        stats = model_statistics(self.engine, request.name or None, request.version or None)
        return _parsed(stats, "ModelStatisticsResponse")

    async def _RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        models = repository_index(self.engine, ready_only=request.ready)
        return _parsed({"models": models}, "RepositoryIndexResponse")

    # --- shared memory -----------------------------------------------------------------------------------------

    async def _SystemSharedMemoryStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._authorize(context)
        regions = self.regions.status(request.name or None, SYSTEM)
        return _parsed({"regions": {r["name"]: r for r in regions}}, "SystemSharedMemoryStatusResponse")

    async def _SystemSharedMemoryRegister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._authorize(context)
        await register_system(self.regions, self.engine.cuda_memory, request.name, request.key, request.offset,
                              request.byte_size)
        return message("SystemSharedMemoryRegisterResponse")()

    async def _SystemSharedMemoryUnregister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._authorize(context)
        await unregister_system(self.regions, self.engine.cuda_memory, request.name or None)
        return message("SystemSharedMemoryUnregisterResponse")()

    async def _CudaSharedMemoryStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._authorize(context)
        regions = self.regions.status(request.name or None, CUDA)
        return _parsed({"regions": {r["name"]: r for r in regions}}, "CudaSharedMemoryStatusResponse")

    async def _CudaSharedMemoryRegister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._authorize(context)
        await register_cuda(self.regions, self.engine.cuda_memory, request.name, request.raw_handle,
                            request.device_id, request.byte_size)
        return message("CudaSharedMemoryRegisterResponse")()

    async def _CudaSharedMemoryUnregister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self._authorize(context)
        await unregister_cuda(self.regions, self.engine.cuda_memory, request.name or None)
        return message("CudaSharedMemoryUnregisterResponse")()

    # --- inference -----------------------------------------------------------------------------------------------

    async def _ModelInfer(self, parsed: _Request, context: grpc.aio.ServicerContext) -> _Answer:
        self._authorize(context)
        request = parsed.message
        engine = self.engine
        name = request.model_name
        with Counted(engine, name, "grpc") as counted, Held(self.budget) as held:
            layer, batcher = find_layer(engine, name, request.model_version or None)
            engine.readiness.check_ready()
            params = _parameters(request.parameters)
            x = self._input(request, parsed.raw, held)
            out_ref = self._output_ref(request)
            x4, unbatched = validate_input(layer, x)
            out_device = out_writer = None
            if out_ref is not None:
                out_device = output_place(self.regions, layer, x4, out_ref, held.take)
                if isinstance(out_device, RegionWriter):  # written here, into the object checked now
                    out_device, out_writer = None, out_device
            else:
                held.take(output_bytes(layer, x4))
            x4 = engine_request(x4, out_device, batcher)
            remaining = context.time_remaining()
            timeouts = [t for t in (None if remaining is None else max(0.0, remaining * 1000), timeout_ms(params))
                        if t is not None]
            result = await run_inference(engine, layer, batcher, x4, _Cancelled,  # type: ignore[arg-type]
                                         counted.received, min(timeouts) if timeouts else None)
            y = result.output.reshape(tuple(result.output.shape[1:])) if unbatched else result.output
            response = message("ModelInferResponse")(model_name=name, model_version=MODEL_VERSION, id=request.id)
            out = response.outputs.add(name=KSERVE_OUTPUT, datatype=KSERVE_NAMES[y.dtype], shape=list(y.shape))
            if out_ref is not None:
                written = region_output(y, out_writer)
                out.parameters["shared_memory_region"].string_param = out_ref.region
                out.parameters["shared_memory_byte_size"].int64_param = written
                if out_ref.offset:
                    out.parameters["shared_memory_offset"].int64_param = out_ref.offset
            raw = None if out_ref is not None else codec.bytes_of(y)
            # As HTTP's X-Deconv-Batch-Size and X-Deconv-Queue-Ms headers, with the requests of the batch too.
            response.parameters["deconv_batch_size"].int64_param = result.batch_samples
            response.parameters["deconv_batch_requests"].int64_param = result.batch_requests
            response.parameters["deconv_queue_ms"].double_param = round(1e3 * result.queue_s, 3)
            return _Answer(response, raw)

    def _input(self, request: Any, raw: Sequence[bytes | memoryview],
               held: Held) -> AnyTensor | codec.SourceTensor | DeviceTensor:
        """The request's one input, checked (as HTTP's ``_kserve_input``): its raw bytes, its typed contents, or
        its place in a shared-memory region (a reference the engine reads, or the region's bytes read when the
        request is queued); its bytes taken from the budget."""
        if len(request.inputs) != 1:
            raise MalformedBodyError(f"a request has exactly one input (named {KSERVE_INPUT!r}), got "
                                     f"{len(request.inputs)}")
        spec = request.inputs[0]
        if spec.name != KSERVE_INPUT:
            raise InvalidInputError(f"unknown input {spec.name!r}; the model takes one input named {KSERVE_INPUT!r}")
        dtype = KSERVE_DTYPES.get(spec.datatype)
        if dtype is None:
            raise InvalidInputError(f"datatype {spec.datatype!r} is not supported; use FP32, FP16, BF16 or FP64")
        shape = tuple(spec.shape)
        if any(d < 0 for d in shape):
            raise MalformedBodyError(f"input shape must be non-negative integers, got {list(shape)}")
        if len(shape) not in (3, 4):
            raise InvalidInputError(f"expected shape [N, C, H, W] or [C, H, W], got {list(shape)}")
        need = codec.check_size(shape, dtype.itemsize, "input", self.settings.max_body_bytes)
        typed = spec.HasField("contents")
        ref = tensor_ref(_parameters(spec.parameters), "input")
        if ref is not None:
            if raw or typed:
                raise MalformedBodyError("an input in shared memory carries neither contents nor raw_input_contents")
            if ref.byte_size != need:
                raise RegionError(f"input shared_memory_byte_size is {ref.byte_size}; shape {list(shape)} of "
                                  f"{spec.datatype} needs {need} bytes")
            return region_input(self.regions, ref, dtype, shape, held.take)
        if raw:
            if len(raw) != 1 or typed:
                raise MalformedBodyError("the input's bytes come as one raw_input_contents entry, or as its "
                                         "contents, not both")
            data = memoryview(raw[0])
            if data.nbytes != need:
                raise MalformedBodyError(f"raw_input_contents holds {data.nbytes} bytes; shape {list(shape)} of "
                                         f"{spec.datatype} needs {need}")
            held.take(need)
            return RawTensor(data, dtype, shape)
        if not typed:
            raise MalformedBodyError("the input needs raw_input_contents or contents")
        field, np_dtype = _TYPED_CONTENTS.get(spec.datatype, (None, None))
        if field is None:
            raise InvalidInputError(f"{spec.datatype} inputs come as raw_input_contents; contents carry FP32 "
                                    "(fp32_contents) and FP64 (fp64_contents)")
        values = getattr(spec.contents, field)
        if len(values) != need // dtype.itemsize:
            raise MalformedBodyError(f"contents.{field} holds {len(values)} values; shape {list(shape)} needs "
                                     f"{need // dtype.itemsize}")
        held.take(need)
        return torch.from_numpy(np.array(values, dtype=np_dtype).reshape(shape))

    @staticmethod
    def _output_ref(request: Any) -> TensorRef | None:
        """Where the output goes when the requested output names a shared-memory region, else None."""
        ref = None
        for out in request.outputs:
            if out.name != KSERVE_OUTPUT:
                raise InvalidInputError(f"unknown output {out.name!r}; the model has one output named "
                                        f"{KSERVE_OUTPUT!r}")
            ref = tensor_ref(_parameters(out.parameters), "output")
        return ref


class _Request(NamedTuple):
    """A ``ModelInferRequest`` and its inputs' bytes (``raw_input_contents``), read by ``_parse_request``."""

    message: Any
    raw: Sequence[bytes | memoryview]


# Requests of at least this many bytes have their raw_input_contents taken as views of the received message.
VIEW_BYTES = 64 * 2**10
# The field of ModelInferRequest.raw_input_contents.
_RAW_INPUT_FIELD = 7


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``data[pos:]`` and the position after it."""
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise DecodeError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _parse_request(data: bytes) -> _Request:
    """A received ``ModelInferRequest``. A small one is parsed as it is. In a large one the inputs' bytes are taken
    as views of ``data`` (which grpc hands over once and nobody changes) and the other top-level fields parsed: the
    parser would copy the bytes into the message, and reading them from it would copy them again, both into fresh
    memory (a page fault a page) for every request.

    Raises:
        DecodeError: not a valid message (grpc answers the call with INTERNAL).
    """
    parse = message("ModelInferRequest").FromString
    if len(data) < VIEW_BYTES:
        request = parse(data)
        return _Request(request, request.raw_input_contents)
    view = memoryview(data)
    rest, raw = [], []
    pos, end = 0, len(data)
    while pos < end:
        start = pos
        tag, pos = _varint(data, pos)
        kind = tag & 7
        if kind == 2:
            length, pos = _varint(data, pos)
            if pos + length > end:
                raise DecodeError("a field runs past the end of the message")
            if tag >> 3 == _RAW_INPUT_FIELD:
                raw.append(view[pos:pos + length])
                pos += length
                continue
            pos += length
        elif kind == 0:
            _, pos = _varint(data, pos)
        elif kind in (1, 5):
            pos += 8 if kind == 1 else 4
        else:
            raise DecodeError(f"wire type {kind} is not one of a ModelInferRequest's fields")
        rest.append(view[start:pos])
    if pos != end:
        raise DecodeError("the last field runs past the end of the message")
    return _Request(parse(b"".join(rest)), raw)


class _Answer(NamedTuple):
    """A ``ModelInferResponse`` without its output's bytes, and those bytes (None: the output went to a region)."""

    response: Any
    raw: memoryview | None


# The tag of ModelInferResponse.raw_output_contents (field 6, length-delimited).
_RAW_OUTPUT_TAG = bytes([6 << 3 | 2])


def _serialize_answer(answer: _Answer) -> bytes:
    """``answer`` on the wire: the response's serialized fields, then the output's bytes as its
    ``raw_output_contents`` entry, written with their tag and length. Protocol buffers read fields in any order,
    so this is the message with the entry appended, made with one copy of the output's bytes (appending them to the
    message first, which takes ``bytes``, and serializing it would copy them twice)."""
    head = answer.response.SerializeToString()
    if answer.raw is None:
        return head  # type: ignore[no-any-return]
    size = answer.raw.nbytes
    length = bytearray()
    while size > 0x7F:
        length.append(size & 0x7F | 0x80)
        size >>= 7
    length.append(size)
    return b"".join((head, _RAW_OUTPUT_TAG, length, answer.raw))


def _parsed(value: dict[str, Any], name: str) -> Any:
    """``value`` (a dict of ``service.engine.kserve``, in Triton's JSON shape) as message ``name``; keys the message
    does not declare are left out (``inference.proto`` declares what tritonclient reads of them)."""
    return json_format.ParseDict(value, message(name)(), ignore_unknown_fields=True)


def _answered(handler: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """``handler`` with every error answered as a gRPC status (``service.errors.grpc_code``), never a traceback.

    A call can end before its error is answered: its gRPC deadline passes in the core at the moment the handler's
    own timer for it fires, or its client leaves. Sending the status then fails (grpc.aio raises from ``abort``, and
    would log that failure with a traceback unless the core has already told it the client is gone); the call is
    over and its client has its status from the core (DEADLINE_EXCEEDED, CANCELLED), so the handler ends as a
    cancelled call does (``asyncio.CancelledError``, which grpc.aio logs at debug level only)."""

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(request, context)
        except ServiceError as exc:
            error = exc
        except Exception as exc:
            log.error("unhandled error in gRPC %s", handler.__name__.lstrip("_"), exc_info=exc)
            error = InternalError("internal server error")
        metadata = tuple((k.lower(), v) for k, v in error.headers.items())
        try:
            await context.abort(grpc.StatusCode[grpc_code(error)], error.message, metadata)
        except grpc.aio.AbortError:
            raise  # the status was sent: how grpc.aio ends an aborted handler
        except Exception as exc:
            log.debug("gRPC %s ended before its status (%s) could be sent: %s", handler.__name__.lstrip("_"),
                      grpc_code(error), exc)
            raise asyncio.CancelledError from exc

    return call


@contextlib.asynccontextmanager
async def serving(app: App, *, reuse_port: bool = False) -> AsyncIterator[None]:
    """The gRPC front end while ``app`` runs, on ``DECONV_HOST:DECONV_GRPC_PORT`` (a ``service.http.app.Companion``);
    nothing when ``DECONV_GRPC_PORT`` is unset. ``reuse_port``: the port is shared with the other HTTP processes of a
    multi-process server (``SO_REUSEPORT``; ``service.grpc.frontend``); else a port in use fails the start."""
    settings = app.engine.settings
    if settings.grpc_port is None:
        yield
        return
    front = GRPCFrontEnd(app)
    await front.start(settings.host, settings.grpc_port, reuse_port=reuse_port)
    try:
        yield
    finally:
        await front.stop()
