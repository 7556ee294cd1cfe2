"""The routes of KServe v2 system shared memory (Triton's ``systemsharedmemory`` extension), over the app's
``service.http.shm_regions.RegionTable`` (``app.state.regions``).

Every route needs the API key when one is configured, status included: a region's key is what lets a client read
and write that memory through the server.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from service.errors import MalformedBodyError, PayloadTooLargeError
from service.http.asgi import call_of
from service.http.routes import check_api_key
from service.http.shm_regions import RegionTable

router = APIRouter()

MAX_REGISTER_BODY = 64 * 2**10


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


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "invalid_shared_memory / unknown_shared_memory_region: {\"error\": ..., \"type\": ...}"},
    401: {"description": "unauthorized (API key configured)"},
}


def regions_of(request: Request) -> RegionTable:
    """The app's region table, after the API key check."""
    check_api_key(call_of(request))
    return request.app.state.regions  # type: ignore[no-any-return]


@router.get("/v2/systemsharedmemory/status", tags=["kserve"], summary="System shared memory: every region",
            response_model=list[RegionStatus], responses=_ERRORS)
async def shm_status(request: Request) -> list[dict[str, Any]]:
    """Name, key, offset and byte size of every registered region."""
    return regions_of(request).status()


@router.get("/v2/systemsharedmemory/region/{name}/status", tags=["kserve"],
            summary="System shared memory: one region", response_model=list[RegionStatus], responses=_ERRORS)
async def shm_region_status(request: Request, name: str) -> list[dict[str, Any]]:
    """Region ``name``'s status (400 when it is not registered)."""
    return regions_of(request).status(name)


@router.post("/v2/systemsharedmemory/region/{name}/register", tags=["kserve"],
             summary="System shared memory: register a region", response_class=Response, responses=_ERRORS,
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": RegisterRequest.model_json_schema()}}}})
async def shm_register(request: Request, name: str) -> Response:
    """Register ``byte_size`` bytes at ``offset`` of the shared-memory object ``key`` as region ``name``."""
    regions = regions_of(request)
    body = await request.body()
    if len(body) > MAX_REGISTER_BODY:
        raise PayloadTooLargeError(f"a register request has at most {MAX_REGISTER_BODY} bytes")
    try:
        req = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise MalformedBodyError("register request is not valid JSON") from None
    if not isinstance(req, dict) or "key" not in req or "byte_size" not in req:
        raise MalformedBodyError('register request must be {"key": ..., "offset": ..., "byte_size": ...}')
    regions.register(name, req["key"], req.get("offset", 0), req["byte_size"])
    return Response(status_code=200)


@router.post("/v2/systemsharedmemory/region/{name}/unregister", tags=["kserve"],
             summary="System shared memory: unregister a region", response_class=Response, responses=_ERRORS)
async def shm_unregister(request: Request, name: str) -> Response:
    """Unregister region ``name`` (200 also when it was not registered)."""
    regions_of(request).unregister(name)
    return Response(status_code=200)


@router.post("/v2/systemsharedmemory/unregister", tags=["kserve"],
             summary="System shared memory: unregister every region", response_class=Response, responses=_ERRORS)
async def shm_unregister_all(request: Request) -> Response:
    """Unregister every region."""
    regions_of(request).unregister_all()
    return Response(status_code=200)
