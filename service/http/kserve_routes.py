"""KServe v2 / Open Inference Protocol over HTTP (``/v2``): inference (``v2_infer_call``, answered by
``service.http.asgi.App`` straight from ASGI: JSON, the binary tensor extension, and tensors in shared-memory
regions), and the server's and models' metadata, health and readiness (the FastAPI routes on ``router``). Triton's
model extensions are ``service.http.model_routes``, the shared-memory routes ``service.http.shm_routes``; the layers'
metadata is ``service.engine.kserve``'s, as the gRPC front end's is.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, NamedTuple

import numpy as np
import torch
from fastapi import APIRouter, Request

from service import codec
from service.codec import AnyTensor, RawTensor
from service.config import VERSION
from service.engine.kserve import (
    KSERVE_DTYPES,
    KSERVE_INPUT,
    KSERVE_NAMES,
    KSERVE_OUTPUT,
    MODEL_VERSION,
    check_version,
    model_metadata,
)
from service.errors import InvalidInputError, MalformedBodyError, PayloadTooLargeError
from service.http.asgi import Call, Reply, declared_length, read_body
from service.http.bodies import (
    MAX_JSON_BYTES,
    LongNumberError,
    decompress,
    decompress_json,
    json_too_large,
    parse_json,
)
from service.http.inference import (
    Counted,
    batch_headers,
    engine_request,
    find_layer,
    get_engine,
    output_bytes,
    output_place,
    output_values,
    region_input,
    region_output,
    run_inference,
    timeout_ms,
    validate_input,
)
from service.http.schemas import KSERVE_ERRORS
from service.http.shm_regions import RegionError, RegionTable, RegionWriter, TensorRef, tensor_ref

router = APIRouter()

# KServe JSON replies, compact: one encoder (``json.dumps`` with arguments makes a new one each call).
_COMPACT = json.JSONEncoder(separators=(",", ":"))


@router.get("/v2", tags=["kserve"], summary="Server metadata")
async def v2_server_metadata(request: Request) -> dict[str, Any]:
    """Name, version and protocol extensions."""
    extensions = ["binary_tensor_data", "model_configuration", "model_repository", "statistics"]
    if request.app.state.regions.enabled:
        extensions.append("system_shared_memory")
    if get_engine(request).cuda_memory.available:
        extensions.append("cuda_shared_memory")
    return {"name": "deconv", "version": VERSION, "extensions": extensions}


@router.get("/v2/health/live", tags=["kserve"], summary="Server liveness")
async def v2_live() -> dict[str, bool]:
    """200 as soon as the process serves HTTP."""
    return {"live": True}


@router.get("/v2/health/ready", tags=["kserve"], summary="Server readiness", responses={503: KSERVE_ERRORS[503]})
async def v2_ready(request: Request) -> dict[str, bool]:
    """200 once every layer passed its self-test, else 503."""
    get_engine(request).readiness.check_ready()
    return {"ready": True}


@router.get("/v2/models/{name}", tags=["kserve"], summary="Model metadata", responses={404: KSERVE_ERRORS[404]})
async def v2_model_metadata(request: Request, name: str) -> dict[str, Any]:
    """Inputs and outputs of the layer called ``name`` (datatype and shape, -1 for any size)."""
    layer, _ = find_layer(get_engine(request), name)
    return model_metadata(layer)


@router.get("/v2/models/{name}/versions/{version}", tags=["kserve"], summary="Model metadata (versioned)",
            responses={404: KSERVE_ERRORS[404]})
async def v2_model_metadata_version(request: Request, name: str, version: str) -> dict[str, Any]:
    """As ``/v2/models/{name}``; the only version is ``1``."""
    layer, _ = find_layer(get_engine(request), name)
    check_version(version)
    return model_metadata(layer)


@router.get("/v2/models/{name}/ready", tags=["kserve"], summary="Model readiness",
            responses={404: KSERVE_ERRORS[404], 503: KSERVE_ERRORS[503]})
async def v2_model_ready(request: Request, name: str) -> dict[str, Any]:
    """200 when the server is ready (every layer passed its self-test), else 503."""
    engine = get_engine(request)
    find_layer(engine, name)
    engine.readiness.check_ready()
    return {"name": name, "ready": True}


@router.get("/v2/models/{name}/versions/{version}/ready", tags=["kserve"], summary="Model readiness (versioned)",
            responses={404: KSERVE_ERRORS[404], 503: KSERVE_ERRORS[503]})
async def v2_model_ready_version(request: Request, name: str, version: str) -> dict[str, Any]:
    """As ``/v2/models/{name}/ready``."""
    engine = get_engine(request)
    find_layer(engine, name)
    check_version(version)
    engine.readiness.check_ready()
    return {"name": name, "ready": True}


def _parse_kserve(body: bytearray | memoryview, header_length: str | None) -> tuple[dict[str, Any], memoryview]:
    view = memoryview(body)
    if header_length is None:
        json_part, binary = view, view[len(view):]
    else:
        try:
            n = int(header_length)
        except ValueError:
            raise MalformedBodyError(f"Inference-Header-Content-Length {header_length!r} is not a number") from None
        if not 0 < n <= len(body):
            raise MalformedBodyError(f"Inference-Header-Content-Length {n} does not fit a body of {len(body)} bytes")
        json_part, binary = view[:n], view[n:]
    try:
        request = parse_json(json_part)
    except LongNumberError as exc:
        raise MalformedBodyError(f"inference request: {exc}") from None
    except (ValueError, RecursionError):
        raise MalformedBodyError("inference request is not valid JSON (binary tensors need the "
                            "Inference-Header-Content-Length header)") from None
    if not isinstance(request, dict):
        raise MalformedBodyError("inference request must be a JSON object")
    return request, binary


# Bytes of Python objects one byte of JSON data can become while a request is parsed: a number of 3 or 4 characters
# and its comma ("1.5,", "-6,") is a float or int object (24-28 bytes), its slot in the parsed list, its cell in
# the object array and in the list taken from that (8 each): 12-17 bytes a byte, and the float64 copy after.
PARSED_BYTES_PER_JSON_BYTE = 16
# JSON parts up to this size are parsed on the event loop (well under a millisecond); larger ones in a thread.
JSON_INLINE_BYTES = 64 * 2**10


class RegionInput(NamedTuple):
    """An input that names a system shared-memory region: read on the event loop once the request is parsed."""

    ref: TensorRef
    dtype: torch.dtype
    shape: tuple[int, ...]


async def _parse_kserve_input(call: Call, body: bytearray | memoryview, header_length: str | None,
                              limit: int) -> tuple[dict[str, Any], AnyTensor | RegionInput]:
    """The KServe request in ``body`` and its input tensor.

    A JSON part is at most ``MAX_JSON_BYTES`` (413 before parsing otherwise), which bounds how long its parse holds
    the interpreter. A large one still becomes many times its size in Python objects before the output's size can be
    checked: its parsed size (``PARSED_BYTES_PER_JSON_BYTE`` a byte) is taken from the bytes-in-flight budget first
    (429 when it does not fit, before parsing) and given back once the tensor is built, and it is parsed in a
    thread, one such request at a time (parallel parses would only add their peaks together; the parse holds the
    interpreter, so the event loop waits for it all the same).
    """
    json_bytes = len(body) if header_length is None else min(len(body), _header_length(header_length))
    if json_bytes > MAX_JSON_BYTES:
        raise json_too_large(f"the request's JSON of {json_bytes} bytes")
    if json_bytes <= JSON_INLINE_BYTES:
        req, binary = _parse_kserve(body, header_length)
        return req, _kserve_input(req, binary, limit)
    parsed_bytes = PARSED_BYTES_PER_JSON_BYTE * json_bytes
    budget = call.held.budget
    budget.take(parsed_bytes)
    try:
        def parse() -> tuple[dict[str, Any], AnyTensor | RegionInput]:
            req, binary = _parse_kserve(body, header_length)
            return req, _kserve_input(req, binary, limit)

        # One at a time: parallel parses would only add their peaks together.
        async with call.scope["app"].state.json_parsing:
            return await asyncio.to_thread(parse)
    finally:
        budget.give(parsed_bytes)


def _header_length(header_length: str) -> int:
    """Inference-Header-Content-Length as a number (0 when it is not one: ``_parse_kserve`` says so)."""
    try:
        return max(0, int(header_length))
    except ValueError:
        return 0


def _kserve_input(request: dict[str, Any], binary: memoryview,
                  max_bytes: int | None = None) -> AnyTensor | RegionInput:
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise MalformedBodyError(f"'inputs' must list exactly one tensor (named {KSERVE_INPUT!r})")
    spec = inputs[0]
    name = spec.get("name")
    if name != KSERVE_INPUT:
        raise InvalidInputError(f"unknown input {name!r}; the model takes one input named {KSERVE_INPUT!r}")
    datatype = spec.get("datatype")
    dtype = KSERVE_DTYPES.get(datatype) if isinstance(datatype, str) else None
    if dtype is None:
        raise InvalidInputError(f"datatype {datatype!r} is not supported; use FP32, FP16, BF16 or FP64")
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise MalformedBodyError(f"input shape must be a list of non-negative integers, got {shape!r}")
    if len(shape) not in (3, 4):
        raise InvalidInputError(f"expected shape [N, C, H, W] or [C, H, W], got {shape}")
    itemsize = dtype.itemsize
    params = spec.get("parameters") or {}
    if not isinstance(params, dict):
        raise MalformedBodyError("input 'parameters' must be an object")
    size = params.get("binary_data_size")
    ref = tensor_ref(params, "input")
    if ref is not None:
        if size is not None or "data" in spec:
            raise MalformedBodyError("an input in shared memory carries neither 'data' nor binary_data_size")
        need = codec.check_size(shape, itemsize, "input", max_bytes)
        if ref.byte_size != need:
            raise RegionError(f"input shared_memory_byte_size is {ref.byte_size}; shape {shape} of {datatype} "
                              f"needs {need} bytes")
        return RegionInput(ref, dtype, tuple(shape))
    # 413 for a huge claim before anything is allocated (JSON data is bounded by its own length instead).
    codec.check_size(shape, itemsize, "input", max_bytes if size is not None else None)
    count = math.prod(shape)
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise MalformedBodyError(f"binary_data_size must be a non-negative integer, got {size!r}")
        if size != len(binary):
            raise MalformedBodyError(f"binary_data_size {size} does not match the {len(binary)} bytes after the JSON")
        if size != count * itemsize:
            raise MalformedBodyError(f"binary input of {size} bytes; shape {shape} of {datatype} needs "
                                f"{count * itemsize}")
        return RawTensor(binary, dtype, tuple(shape))
    if len(binary):
        raise MalformedBodyError("binary data after the JSON but no input has parameters.binary_data_size")
    data = spec.get("data")
    if not isinstance(data, list):
        raise MalformedBodyError("input needs 'data' (JSON) or parameters.binary_data_size (binary extension)")
    if data and not isinstance(data[0], list) and len(data) != count:
        raise MalformedBodyError(f"input data holds {len(data)} values; shape {shape} needs {count}")
    return torch.from_numpy(_json_numbers(data, shape, count)).to(dtype)


def _json_numbers(data: list[Any], shape: list[int], count: int) -> np.ndarray:
    """KServe JSON ``data`` (flat, or nested like ``shape``) as a float64 array of ``shape``.

    Only JSON numbers count: numpy would read null as NaN, "1.5" as 1.5 and true as 1.

    Raises:
        MalformedBodyError: anything but ``count`` numbers within float64's range, laid out flat or as ``shape``.
    """
    try:
        cells = np.asarray(data, dtype=object)  # ragged nesting: an array of lists, refused below
    except ValueError:
        raise MalformedBodyError("input data must be numbers (flat, or nested like the shape)") from None
    flat = cells.reshape(-1).tolist()
    kinds = set(map(type, flat))
    if not kinds <= {int, float}:
        names = sorted("null" if k is type(None) else k.__name__ for k in kinds - {int, float})
        raise MalformedBodyError(f"input data must be numbers (flat, or nested like the shape), not {', '.join(names)}")
    if len(flat) != count or (cells.ndim > 1 and list(cells.shape) != shape):
        raise MalformedBodyError(f"input data holds {len(flat)} values laid out as {list(cells.shape)}; shape "
                                 f"{shape} needs {count}")
    try:
        arr = np.array(flat, dtype=np.float64)
    except OverflowError:
        raise MalformedBodyError("input data holds a number beyond float64's range") from None
    return arr.reshape(shape)


def _wants_binary(request: dict[str, Any]) -> bool:
    params = request.get("parameters") or {}
    binary = bool(params.get("binary_data_output", False)) if isinstance(params, dict) else False
    outputs = request.get("outputs")
    if outputs is None:
        return binary
    if not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs):
        raise MalformedBodyError("'outputs' must be a list of objects")
    for out in outputs:
        if out.get("name") != KSERVE_OUTPUT:
            raise InvalidInputError(f"unknown output {out.get('name')!r}; the model has one output named "
                               f"{KSERVE_OUTPUT!r}")
        oparams = out.get("parameters") or {}
        if isinstance(oparams, dict) and "binary_data" in oparams:
            binary = bool(oparams["binary_data"])
    return binary


def _output_ref(request: dict[str, Any]) -> TensorRef | None:
    """Where the output goes when its parameters name a system shared-memory region, else None (``outputs``
    already checked by ``_wants_binary``)."""
    for out in request.get("outputs") or []:
        oparams = out.get("parameters") or {}
        if isinstance(oparams, dict):
            return tensor_ref(oparams, "output")
    return None


# The most bytes one output value takes in JSON: a float64's shortest repr ("-2.2250738585072014e-308") and a comma.
JSON_BYTES_PER_VALUE = 25
# Values encoded between two returns to the event loop (~20 ms of encoding on one core).
JSON_VALUES_PER_STEP = 1 << 16


async def _json_answer(response: dict[str, Any], out: dict[str, Any], y: AnyTensor) -> bytes:
    """``response`` as JSON with ``y``'s values as ``out["data"]``, flat.

    Encoded a slice at a time with the event loop let run between slices, so that a large output (bounded by
    ``max_json_output_bytes``) does not stop every other connection for the time it takes. Non-finite outputs are
    written as NaN / Infinity / -Infinity, which Python's json (tritonclient) reads; strict JSON has no spelling
    for them (binary outputs carry them exactly).
    """
    out["data"] = []
    head, _, tail = _COMPACT.encode(response).partition('"data":[]')
    flat = codec.as_tensor(y).reshape(-1)
    parts = [head.encode(), b'"data":[']
    for start in range(0, flat.numel(), JSON_VALUES_PER_STEP):
        if start:
            parts.append(b",")
            await asyncio.sleep(0)
        values = flat[start:start + JSON_VALUES_PER_STEP].double().tolist()
        parts.append(_COMPACT.encode(values)[1:-1].encode())
    parts += [b"]", tail.encode()]
    return b"".join(parts)


async def v2_infer_call(call: Call) -> Reply:
    """``POST /v2/models/{name}[/versions/{version}]/infer``."""
    name, version = call.params["name"], call.params.get("version")
    engine = call.engine
    with Counted(engine, name, "kserve") as counted:
        layer, batcher = find_layer(engine, name)
        check_version(version)
        engine.readiness.check_ready()
        limit = engine.settings.max_body_bytes
        encoding = call.headers.get("content-encoding")
        binary = call.headers.get("inference-header-content-length") is not None
        identity = (encoding or "identity").strip().lower() == "identity"
        if not binary:  # all of it JSON: refused before it is read, or decompressed past the limit of JSON
            declared = declared_length(call)
            if identity and declared is not None and declared > MAX_JSON_BYTES:
                raise json_too_large(f"a JSON body of {declared} bytes")
        raw = await read_body(call, limit, tensor_as_is=binary and identity)
        if binary:
            body = await decompress(raw, encoding, limit)
        else:
            body = await decompress_json(raw, encoding)
        if body is not raw:
            call.held.take(len(body))
        req, parsed = await _parse_kserve_input(call, body, call.headers.get("inference-header-content-length"),
                                                limit)
        regions: RegionTable = call.scope["app"].state.regions
        x = (region_input(regions, parsed.ref, parsed.dtype, parsed.shape, call.held.take)
             if isinstance(parsed, RegionInput) else parsed)
        binary_out = _wants_binary(req)
        out_ref = _output_ref(req)
        x4, unbatched = validate_input(layer, x)
        out_device = out_writer = None
        if out_ref is not None:
            out_device = output_place(regions, layer, x4, out_ref, call.held.take)
            if isinstance(out_device, RegionWriter):
                out_device, out_writer = None, out_device
        elif binary_out:
            call.held.take(output_bytes(layer, x4))
        else:
            json_bytes = JSON_BYTES_PER_VALUE * output_values(layer, x4)
            if json_bytes > engine.settings.max_json_output_bytes:
                raise PayloadTooLargeError(
                    f"the output as JSON could take {json_bytes} bytes, above the limit of "
                    f"{engine.settings.max_json_output_bytes}; ask for binary output (parameters.binary_data_output: "
                    "true, or binary_data: true in the output's parameters)")
            call.held.take(json_bytes)
        x4 = engine_request(x4, out_device, batcher)
        timeouts = [t for t in (call.deadline_ms, timeout_ms(req.get("parameters"))) if t is not None]
        result = await run_inference(engine, layer, batcher, x4, call, counted.received,
                                     min(timeouts) if timeouts else None)
        y = result.output.reshape(tuple(result.output.shape[1:])) if unbatched else result.output
        out: dict[str, Any] = {"name": KSERVE_OUTPUT, "datatype": KSERVE_NAMES[y.dtype], "shape": list(y.shape)}
        response: dict[str, Any] = {"model_name": name, "model_version": MODEL_VERSION, "outputs": [out]}
        if isinstance(req.get("id"), str):
            response["id"] = req["id"]
        headers = batch_headers(result)
        if out_ref is not None:
            written = region_output(y, out_writer)
            out["parameters"] = {"shared_memory_region": out_ref.region, "shared_memory_byte_size": written}
            if out_ref.offset:
                out["parameters"]["shared_memory_offset"] = out_ref.offset
            reply = Reply(_COMPACT.encode(response).encode(), "application/json", headers)
        elif binary_out:
            data = codec.bytes_of(y)
            out["parameters"] = {"binary_data_size": len(data)}
            head = _COMPACT.encode(response).encode()
            headers["Inference-Header-Content-Length"] = str(len(head))
            reply = Reply((head, data), "application/octet-stream", headers)
        else:
            reply = Reply(await _json_answer(response, out, y), "application/json", headers)
        return reply
