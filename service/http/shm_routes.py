"""The routes of KServe v2 shared memory, over the app's ``service.http.shm_regions.RegionTable``
(``app.state.regions``): system regions (Triton's ``systemsharedmemory`` extension) and CUDA regions
(``cudasharedmemory``), whose GPU allocations the engine maps where its GPU workers run
(``Engine.cuda_memory``, ``service.engine.cuda_shm``).

Both kinds have the same five routes (every region's status, one region's status, register, unregister,
unregister every region), declared once by ``_add_routes`` from a ``_Kind``: what differs is the register body,
the status entry, and what registering and unregistering do besides the table (a CUDA region is mapped by the
engine before its record is stored, and unmapped after its record is gone; on a GPU server a system region is
mapped and page-locked by the engine after its record is stored, and unmapped after its record is gone).

Every route needs the API key when one is configured, status included: a region is what lets a client read and
write that memory through the server.

What registering and unregistering do is one function per kind, on plain values (``register_system``,
``unregister_system``, ``register_cuda``, ``unregister_cuda``): the routes here call them once they have read the
request's body, and the gRPC front end (``service.grpc``) calls them with its messages' fields.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from service.engine.interface import CudaMemory
from service.errors import MalformedBodyError, PayloadTooLargeError, RegionError, ServiceError
from service.http.asgi import check_api_key
from service.http.bodies import LongNumberError, parse_json
from service.http.shm_regions import CUDA, SYSTEM, RegionTable

log = logging.getLogger("deconv.service")

router = APIRouter()

MAX_REGISTER_BODY = 64 * 2**10
HANDLE_BYTES = 64  # a cudaIpcMemHandle_t


class RegisterRequest(BaseModel):
    """``$system_shared_memory_register_request``."""

    key: str = Field(examples=["/input_region"], description="The POSIX shared-memory object (shm_open's name).")
    offset: int = Field(0, ge=0, description="Bytes into the object where the region starts.")
    byte_size: int = Field(gt=0, description="Bytes of the region.")


class RegionStatus(BaseModel):
    """One entry of ``$system_shared_memory_status_response``."""

    name: str
    key: str
    offset: int
    byte_size: int


class RawHandle(BaseModel):
    """A CUDA IPC handle, base64-encoded."""

    b64: str = Field(description="The 64 bytes of a cudaIpcMemHandle_t (cudaIpcGetMemHandle), base64-encoded.")


class CudaRegisterRequest(BaseModel):
    """``$cuda_shared_memory_register_request``."""

    raw_handle: RawHandle
    device_id: int = Field(ge=0, description="The GPU of the allocation (a CUDA device index of the server).")
    byte_size: int = Field(gt=0, description="Bytes of the region, from the allocation's start.")


class CudaRegionStatus(BaseModel):
    """One entry of ``$cuda_shared_memory_status_response``."""

    name: str
    device_id: int
    byte_size: int


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "invalid_shared_memory / unknown_shared_memory_region: {\"error\": ..., \"type\": ...}"},
    401: {"description": "unauthorized (API key configured)"},
}


def regions_of(request: Request) -> RegionTable:
    """The app's region table, after the API key check."""
    check_api_key(request.app.state.engine.settings.api_key, request.scope["headers"])
    return request.app.state.regions  # type: ignore[no-any-return]


def _cuda_memory(request: Request) -> CudaMemory:
    return request.app.state.engine.cuda_memory  # type: ignore[no-any-return]


async def _register_body(request: Request, fields: tuple[str, ...], shape: str) -> dict[str, Any]:
    """The register request's JSON object, with ``fields`` present (``shape``: how it looks, for the error).

    Raises:
        PayloadTooLargeError: more than ``MAX_REGISTER_BODY`` bytes.
        MalformedBodyError: not a JSON object with those fields.
    """
    body = await request.body()
    if len(body) > MAX_REGISTER_BODY:
        raise PayloadTooLargeError(f"a register request has at most {MAX_REGISTER_BODY} bytes")
    try:
        req = parse_json(body)
    except LongNumberError as exc:
        raise MalformedBodyError(f"register request: {exc}") from None
    except (ValueError, RecursionError):
        raise MalformedBodyError("register request is not valid JSON") from None
    if not isinstance(req, dict) or not all(f in req for f in fields):
        raise MalformedBodyError(f"register request must be {shape}")
    return req


# --- what each kind does besides the table ------------------------------------------------------------------


async def _register_system(request: Request, regions: RegionTable, name: str) -> None:
    req = await _register_body(request, ("key", "byte_size"), '{"key": ..., "offset": ..., "byte_size": ...}')
    await register_system(regions, _cuda_memory(request), name, req["key"], req.get("offset", 0), req["byte_size"])


async def register_system(regions: RegionTable, memory: CudaMemory, name: str, key: Any, offset: Any,
                          byte_size: Any) -> None:
    """Register system region ``name`` (every front end's way): store the record, then, on a GPU server
    (``CudaMemory.system_available``), have the engine map and page-lock the region so that its tensors go to the
    GPU with no host copy. Should the engine refuse, the region serves through copies as it would without a GPU;
    should it be unregistered meanwhile, the mapping is closed again.

    Raises:
        RegionError: as ``RegionTable.register``.
    """
    record = regions.register(name, key, offset, byte_size)
    if not memory.system_available:
        return
    try:
        await _opened(memory, record.token, memory.open_system(record.token, record.key, record.offset,
                                                               record.byte_size, record.dev, record.ino))
    except ServiceError as exc:  # the engine refused or is away: the copies serve
        log.warning("shared memory: region %r is served by copies: %s", name, exc)
        return
    if not regions.mark_mapped(record):
        await memory.close([record.token])


async def _unregister_system(request: Request, regions: RegionTable, name: str | None) -> None:
    await unregister_system(regions, _cuda_memory(request), name)


async def unregister_system(regions: RegionTable, memory: CudaMemory, name: str | None) -> None:
    """Unregister system region ``name`` (every one when None), and have the engine unmap what it mapped of them."""
    tokens = regions.unregister_all(SYSTEM) if name is None else regions.unregister(name, SYSTEM)
    if tokens:
        await memory.close(tokens)


def _raw_handle(value: Any) -> bytes:
    """The IPC handle of a register request's ``raw_handle``: ``{"b64": base64 of 64 bytes}``.

    Raises:
        RegionError: anything else.
    """
    text = value.get("b64") if isinstance(value, dict) else None
    if not isinstance(text, str):
        raise RegionError(f'raw_handle must be {{"b64": "<base64 of the {HANDLE_BYTES}-byte CUDA IPC handle>"}}, '
                          f"got {str(value)[:80]!r}")
    try:
        handle = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RegionError("raw_handle.b64 is not valid base64") from None
    if len(handle) != HANDLE_BYTES:
        raise RegionError(f"raw_handle holds {len(handle)} bytes; a CUDA IPC handle (cudaIpcMemHandle_t) has "
                          f"{HANDLE_BYTES}")
    return handle


# Closings of registrations whose caller went away while the engine mapped them (kept until done).
_late_closes: set[asyncio.Task[None]] = set()


async def _register_cuda(request: Request, regions: RegionTable, name: str) -> None:
    req = await _register_body(request, ("raw_handle", "device_id", "byte_size"),
                               '{"raw_handle": {"b64": ...}, "device_id": ..., "byte_size": ...}')
    await register_cuda(regions, _cuda_memory(request), name, _raw_handle(req["raw_handle"]), req["device_id"],
                        req["byte_size"])


async def register_cuda(regions: RegionTable, cuda: CudaMemory, name: str, handle: bytes, device_id: Any,
                        byte_size: Any) -> None:
    """Register CUDA region ``name`` (every front end's way): check the request, have the engine map the allocation
    of IPC ``handle``, then store the record (unmapped again if the name was taken meanwhile). The engine answers a
    server without a GPU with 400 (``CudaMemory.reason``).

    Raises:
        RegionError: as ``RegionTable.cuda_record`` and ``CudaMemory.open``.
    """
    if len(handle) != HANDLE_BYTES:
        raise RegionError(f"raw_handle holds {len(handle)} bytes; a CUDA IPC handle (cudaIpcMemHandle_t) has "
                          f"{HANDLE_BYTES}")
    record = regions.cuda_record(name, device_id, byte_size)
    if not cuda.available:
        raise RegionError(cuda.reason)
    await _opened(cuda, record.token, cuda.open(record.token, handle, record.device_id, record.byte_size))
    try:
        regions.add_cuda(record)
    except BaseException:
        await cuda.close([record.token])
        raise


async def _opened(cuda: CudaMemory, token: str, opening: Coroutine[Any, Any, None]) -> None:
    """Await ``opening`` (the engine mapping registration ``token``); should the caller be cancelled meanwhile,
    the mapping is closed once made."""
    task = asyncio.ensure_future(opening)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        def close_when_open(done: asyncio.Future[None]) -> None:
            if not done.cancelled() and done.exception() is None:
                closing = asyncio.ensure_future(cuda.close([token]))
                _late_closes.add(closing)
                closing.add_done_callback(_late_closes.discard)

        task.add_done_callback(close_when_open)
        raise


async def _unregister_cuda(request: Request, regions: RegionTable, name: str | None) -> None:
    await unregister_cuda(regions, _cuda_memory(request), name)


async def unregister_cuda(regions: RegionTable, cuda: CudaMemory, name: str | None) -> None:
    """Unregister CUDA region ``name`` (every one when None), and have the engine unmap their allocations."""
    tokens = regions.unregister_all(CUDA) if name is None else regions.unregister(name, CUDA)
    await cuda.close(tokens)


# --- the routes ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Kind:
    """One kind of region's routes: its table kind, path segment, title, models, and what registering and
    unregistering do."""

    kind: str
    path: str
    title: str
    register_model: type[BaseModel]
    status_model: type[BaseModel]
    register: Callable[[Request, RegionTable, str], Awaitable[None]]
    unregister: Callable[[Request, RegionTable, str | None], Awaitable[None]]
    register_doc: str


def _add_routes(k: _Kind) -> None:
    """Declare ``k``'s five routes on ``router``."""
    prefix = f"/v2/{k.path}"
    status_list = list[k.status_model]  # type: ignore[name-defined]

    @router.get(f"{prefix}/status", tags=["kserve"], summary=f"{k.title}: every region",
                response_model=status_list, responses=_ERRORS, name=f"{k.kind}_shm_status",
                description="Every registered region's status.")
    async def status(request: Request) -> list[dict[str, Any]]:
        return regions_of(request).status(kind=k.kind)

    @router.get(f"{prefix}/region/{{name}}/status", tags=["kserve"], summary=f"{k.title}: one region",
                response_model=status_list, responses=_ERRORS, name=f"{k.kind}_shm_region_status",
                description="Region ``name``'s status (400 when it is not registered).")
    async def region_status(request: Request, name: str) -> list[dict[str, Any]]:
        return regions_of(request).status(name, k.kind)

    @router.post(f"{prefix}/region/{{name}}/register", tags=["kserve"], summary=f"{k.title}: register a region",
                 response_class=Response, responses=_ERRORS, name=f"{k.kind}_shm_register",
                 description=k.register_doc, openapi_extra={"requestBody": {"required": True, "content": {
                     "application/json": {"schema": k.register_model.model_json_schema()}}}})
    async def register(request: Request, name: str) -> Response:
        await k.register(request, regions_of(request), name)
        return Response(status_code=200)

    @router.post(f"{prefix}/region/{{name}}/unregister", tags=["kserve"], summary=f"{k.title}: unregister a region",
                 response_class=Response, responses=_ERRORS, name=f"{k.kind}_shm_unregister",
                 description="Unregister region ``name`` (200 also when it was not registered).")
    async def unregister(request: Request, name: str) -> Response:
        await k.unregister(request, regions_of(request), name)
        return Response(status_code=200)

    @router.post(f"{prefix}/unregister", tags=["kserve"], summary=f"{k.title}: unregister every region",
                 response_class=Response, responses=_ERRORS, name=f"{k.kind}_shm_unregister_all",
                 description="Unregister every region of this kind.")
    async def unregister_all(request: Request) -> Response:
        await k.unregister(request, regions_of(request), None)
        return Response(status_code=200)


_add_routes(_Kind(SYSTEM, "systemsharedmemory", "System shared memory", RegisterRequest, RegionStatus,
                  _register_system, _unregister_system,
                  "Register ``byte_size`` bytes at ``offset`` of the shared-memory object ``key`` as region ``name``."))
_add_routes(_Kind(CUDA, "cudasharedmemory", "CUDA shared memory", CudaRegisterRequest, CudaRegionStatus,
                  _register_cuda, _unregister_cuda,
                  "Register the first ``byte_size`` bytes of the GPU allocation behind a CUDA IPC handle "
                  "(``raw_handle.b64``) on GPU ``device_id`` as region ``name``; the server's engine maps it on "
                  "that GPU. 400 on a server without a GPU."))
