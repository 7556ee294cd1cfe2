"""Triton's HTTP extensions about the models, over ``service.engine.kserve`` (which builds every answer):
model configuration (``GET /v2/models/{name}[/versions/{version}]/config``), the repository index
(``POST /v2/repository/index``) and statistics (``GET /v2/models[/{name}[/versions/{version}]]/stats``).

Like the model metadata and ``/metrics`` they answer without the API key: they describe the layers and count
requests, and compute nothing. The app includes this router before ``service.http.kserve_routes``'s, so that
``/v2/models/stats`` is the statistics, not the metadata of a layer called ``stats``.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from service.engine import kserve
from service.errors import MalformedBodyError, PayloadTooLargeError
from service.http.inference import get_engine
from service.http.schemas import KSERVE_ERRORS

router = APIRouter()

# The repository index's body is at most {"ready": true}: anything this long is not one.
MAX_INDEX_BODY = 4096


class RepositoryIndexRequest(BaseModel):
    """``$repository_index_request`` (the body may also be empty)."""

    ready: bool = Field(False, description="Only the models ready for inference.")


class RepositoryIndexEntry(BaseModel):
    """One model of ``$repository_index_response``."""

    name: str
    version: str
    state: str = Field(description="READY, LOADING (self-tests running), UNAVAILABLE (with the reason) or UNLOADING "
                                   "(draining).")
    reason: str


@router.get("/v2/models/stats", tags=["kserve"], summary="Statistics of every model")
async def v2_statistics(request: Request) -> dict[str, Any]:
    """Triton's inference statistics of every layer (docs/protocol.md)."""
    return kserve.model_statistics(get_engine(request))


@router.get("/v2/models/{name}/stats", tags=["kserve"], summary="Model statistics",
            responses={404: KSERVE_ERRORS[404]})
async def v2_model_statistics(request: Request, name: str) -> dict[str, Any]:
    """Triton's inference statistics of the layer called ``name``: success and failure counts and times, queue and
    compute times, batches by size (docs/protocol.md)."""
    return kserve.model_statistics(get_engine(request), name)


@router.get("/v2/models/{name}/versions/{version}/stats", tags=["kserve"], summary="Model statistics (versioned)",
            responses={404: KSERVE_ERRORS[404]})
async def v2_model_statistics_version(request: Request, name: str, version: str) -> dict[str, Any]:
    """As ``/v2/models/{name}/stats``; the only version is ``1``."""
    return kserve.model_statistics(get_engine(request), name, version)


@router.get("/v2/models/{name}/config", tags=["kserve"], summary="Model configuration",
            responses={404: KSERVE_ERRORS[404]})
async def v2_model_config(request: Request, name: str) -> dict[str, Any]:
    """Triton's model configuration of the layer called ``name`` in its JSON form: max_batch_size, inputs and
    outputs with data_type and dims (-1 where a size varies, no batch dimension), dynamic_batching."""
    engine = get_engine(request)
    return kserve.model_config(engine, kserve.find_model(engine, name))


@router.get("/v2/models/{name}/versions/{version}/config", tags=["kserve"], summary="Model configuration (versioned)",
            responses={404: KSERVE_ERRORS[404]})
async def v2_model_config_version(request: Request, name: str, version: str) -> dict[str, Any]:
    """As ``/v2/models/{name}/config``; the only version is ``1``."""
    engine = get_engine(request)
    return kserve.model_config(engine, kserve.find_model(engine, name, version))


@router.post("/v2/repository/index", tags=["kserve"], summary="Model repository index",
             response_model=list[RepositoryIndexEntry], openapi_extra={"requestBody": {
                 "required": False,
                 "content": {"application/json": {"schema": RepositoryIndexRequest.model_json_schema()}}}},
             responses={400: KSERVE_ERRORS[400], 413: KSERVE_ERRORS[413]})
async def v2_repository_index(request: Request) -> list[dict[str, str]]:
    """Every layer with its version and state; with ``{"ready": true}`` only those ready."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_INDEX_BODY:
            raise PayloadTooLargeError(f"a repository index request has at most {MAX_INDEX_BODY} bytes")
    ready = False
    if body.strip():
        try:
            req = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise MalformedBodyError("repository index request is not valid JSON") from None
        if not isinstance(req, dict) or not isinstance(req.get("ready", False), bool):
            raise MalformedBodyError('repository index request must be empty or {"ready": true|false}')
        ready = req.get("ready", False)
    return kserve.repository_index(get_engine(request), ready_only=ready)
