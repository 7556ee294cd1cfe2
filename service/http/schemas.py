"""The pydantic models of the HTTP API: the native and KServe v2 request and response bodies, the inference routes'
parameters, and the error bodies. They validate small JSON bodies and describe every route in the OpenAPI document;
the inference routes parse their bodies themselves (``service.http.native_routes``, ``service.http.kserve_routes``)
and take these models only for their documentation (``service.http.routes.INFERENCE_ROUTES``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from service.engine.kserve import KSERVE_INPUT, KSERVE_OUTPUT, MODEL_VERSION
from service.http.asgi import MAX_DEADLINE_MS


class ErrorDetail(BaseModel):
    """One error: a stable type and a human-readable message."""

    type: str = Field(examples=["invalid_input"])
    message: str = Field(examples=["input has 3 channels; layer 'demo' takes 16"])


class ErrorBody(BaseModel):
    """Every native error response."""

    error: ErrorDetail


class KServeError(BaseModel):
    """Every ``/v2`` error response (Open Inference Protocol shape, with the stable type beside it)."""

    error: str
    type: str


class LayerInfo(BaseModel):
    """What a layer takes and returns (docs/protocol.md)."""

    name: str
    in_channels: int
    out_channels: int
    kernel_size: list[int]
    stride: list[int]
    padding: list[int]
    output_padding: list[int]
    dilation: list[int]
    groups: int
    bias: bool
    dtype: str
    precision: str
    max_batch_size: int
    max_batch_bytes: int
    max_queue_delay_ms: float
    max_queue_size: int
    max_height: int
    max_width: int
    input_shape: list[int]
    output_shape: list[int]
    output_size: str
    description: str = ""


class LayerList(BaseModel):
    """``GET /v1/layers``."""

    layers: list[LayerInfo]


class KServeTensor(BaseModel):
    """A KServe v2 request input (``data`` in JSON, or ``parameters.binary_data_size`` bytes after the JSON)."""

    name: str = Field(examples=[KSERVE_INPUT])
    shape: list[int] = Field(examples=[[1, 16, 16, 16]])
    datatype: str = Field(examples=["FP32"])
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class KServeRequestedOutput(BaseModel):
    """A requested output; ``parameters.binary_data: true`` returns it as bytes after the JSON."""

    name: str = Field(examples=[KSERVE_OUTPUT])
    parameters: dict[str, Any] | None = None


class KServeInferRequest(BaseModel):
    """A KServe v2 inference request (one input named ``input``)."""

    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[KServeTensor]
    outputs: list[KServeRequestedOutput] | None = None


class KServeOutput(BaseModel):
    """The output: its values as ``data`` (JSON, flat), or ``parameters.binary_data_size`` bytes after the JSON, or
    written to the system shared-memory region that ``parameters.shared_memory_region`` names."""

    name: str = Field(examples=[KSERVE_OUTPUT])
    datatype: str = Field(examples=["FP32"])
    shape: list[int] = Field(examples=[[1, 8, 32, 32]])
    parameters: dict[str, Any] | None = None
    data: list[float] | None = None


class KServeInferResponse(BaseModel):
    """A KServe v2 inference response (one output named ``output``)."""

    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[KServeOutput]


class LayerQuery(BaseModel):
    """``POST /deconv``'s query parameter."""

    layer: str = Field(description="Layer name (see GET /v1/layers).", examples=["demo"])


class ModelPath(BaseModel):
    """The path parameter of the KServe inference route."""

    name: str = Field(description="Layer name (see GET /v1/layers).")


class VersionedModelPath(ModelPath):
    """The path parameters of the versioned KServe inference route."""

    version: str = Field(description=f"Model version; the only one is {MODEL_VERSION!r}.")


class DeadlineHeader(BaseModel):
    """The header of an inference request that bounds its wait (read by ``service.http.asgi.deadline_header``)."""

    x_deadline_ms: float | None = Field(
        None, alias="x-deadline-ms", ge=0, le=MAX_DEADLINE_MS,
        description="Fail with 504 if execution has not started this many ms after receipt (on the KServe routes "
                    "the earlier of this and parameters.timeout counts).")


# The error statuses of the API, each described by its error type.
ERROR_TYPES = {
    400: "malformed_body",
    401: "unauthorized (API key configured)",
    404: "unknown_layer",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_input",
    429: "overloaded (Retry-After)",
    500: "internal",
    503: "not_ready (Retry-After)",
    504: "deadline_exceeded",
}
# As FastAPI's routes declare their error responses.
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody, "description": d}
                                           for code, d in ERROR_TYPES.items()}
KSERVE_ERRORS = {code: {"model": KServeError, "description": d} for code, d in ERROR_TYPES.items()}
