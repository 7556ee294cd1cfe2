"""The native API: ``POST /deconv`` (``deconv_call``, answered by ``service.http.asgi.App`` straight from ASGI), the
layers' descriptions (``GET /v1/layers``, ``GET /v1/layers/{name}``), health (``/health/live``, ``/health/ready``)
and ``GET /metrics``; the FastAPI routes on ``router``.
"""

from __future__ import annotations

from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response

from service import codec
from service.errors import UnsupportedMediaTypeError
from service.http.asgi import Call, Reply, read_body
from service.http.inference import (
    Counted,
    batch_headers,
    find_layer,
    get_engine,
    output_bytes,
    run_inference,
    validate_input,
)
from service.http.schemas import ERRORS, LayerInfo, LayerList
from service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

router = APIRouter()


async def deconv_call(call: Call) -> Reply:
    """``POST /deconv``: run layer ``layer`` on the tensor in the body; the output in the negotiated format."""
    engine, headers, name = call.engine, call.headers, call.query["layer"]
    with Counted(engine, name, "native") as counted:
        layer, batcher = find_layer(engine, name)
        media = codec.media_type_of(headers.get("content-type"))
        out_media = codec.negotiate(headers.get("accept"), media)
        if headers.get("content-encoding", "identity").strip().lower() != "identity":
            raise UnsupportedMediaTypeError("Content-Encoding is not supported on /deconv; send the tensor as is")
        engine.readiness.check_ready()
        limit = engine.settings.max_body_bytes
        x = codec.decode_raw(await read_body(call, limit), media, limit)
        x4, unbatched = validate_input(layer, x)
        if out_media == codec.NPY and layer.dtype == torch.bfloat16:
            raise UnsupportedMediaTypeError(f"bfloat16 cannot be written as .npy; accept {codec.SAFETENSORS}")
        call.held.take(output_bytes(layer, x4))
        result = await run_inference(engine, layer, batcher, x4, call, counted.received, call.deadline_ms)
        y = result.output.reshape(tuple(result.output.shape[1:])) if unbatched else result.output
        return Reply(codec.encode_parts(y, out_media), out_media, batch_headers(result))


@router.get("/v1/layers", tags=["layers"], summary="Describe every layer", response_model=LayerList)
async def list_layers(request: Request) -> dict[str, Any]:
    """Every layer: shapes, output-size formula, dtype, precision and limits."""
    engine = get_engine(request)
    layers = list(engine.registry) if engine.registry is not None else []
    return {"layers": [layer.describe() for layer in layers]}


@router.get("/v1/layers/{name}", tags=["layers"], summary="Describe one layer", response_model=LayerInfo,
            responses={404: ERRORS[404]})
async def describe_layer(request: Request, name: str) -> dict[str, Any]:
    """One layer: shapes, output-size formula, dtype, precision and limits."""
    layer, _ = find_layer(get_engine(request), name)
    return layer.describe()


# --- health and metrics ------------------------------------------------------------------------------------


@router.get("/health/live", tags=["health"], summary="Liveness")
async def live() -> dict[str, str]:
    """200 as soon as the process serves HTTP."""
    return {"status": "live"}


@router.get("/health/ready", tags=["health"], summary="Readiness", responses={503: ERRORS[503]})
async def ready(request: Request) -> dict[str, str]:
    """200 once every layer passed its self-test; 503 before, while draining, or with the failure's reason."""
    get_engine(request).readiness.check_ready()
    return {"status": "ready"}


@router.get("/metrics", tags=["health"], summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    """Prometheus text exposition format."""
    return Response(get_engine(request).metrics.render(), media_type=METRICS_CONTENT_TYPE)
