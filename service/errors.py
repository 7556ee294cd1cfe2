"""Domain errors and the one map from an error to an HTTP status and JSON body, or to a gRPC status code
(docs/protocol.md, "Errors").

Native routes answer ``{"error": {"type": TYPE, "message": TEXT}}``. KServe v2 routes (``/v2/...``) answer the
Open Inference Protocol's ``{"error": TEXT}`` (what ``tritonclient`` reads) with the same ``type`` beside it.
No traceback ever reaches a client: unexpected exceptions become ``internal`` with a fixed message and are logged.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # FastAPI is imported where the handlers are installed, so that the batcher and the worker
    # (which raise these errors) do not pull in the web framework.
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("deconv.service")


class ServiceError(Exception):
    """Base of every error a client can see: an HTTP status, a stable ``type`` and a message."""

    status: int = 500
    type: str = "internal"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = dict(headers or {})


class MalformedBodyError(ServiceError):
    """The body is not a valid .npy / safetensors / KServe payload."""

    status, type = 400, "malformed_body"


class RegionError(ServiceError):
    """A shared-memory region request, or a tensor in a region, that cannot be honoured (400, as Triton answers):
    KServe system and CUDA shared memory (``service.http.shm_regions``, ``service.engine.cuda_shm``)."""

    status, type = 400, "invalid_shared_memory"


class UnknownRegionError(RegionError):
    """No region of that name is registered (or it was unregistered while a request used it)."""

    type = "unknown_shared_memory_region"


class UnauthorizedError(ServiceError):
    """An API key is configured and the request did not carry it."""

    status, type = 401, "unauthorized"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class NotFoundError(ServiceError):
    """No route at this path."""

    status, type = 404, "not_found"


class UnknownLayerError(ServiceError):
    """No layer (KServe: model) of that name."""

    status, type = 404, "unknown_layer"


class MethodNotAllowedError(ServiceError):
    """The route exists but not for this method."""

    status, type = 405, "method_not_allowed"


class RequestTimeoutError(ServiceError):
    """The client took too long to send the request's headers or body; the connection closes."""

    status, type = 408, "request_timeout"


class HeadersTooLargeError(ServiceError):
    """The request line and headers exceed the limit; the connection closes."""

    status, type = 431, "headers_too_large"


class PayloadTooLargeError(ServiceError):
    """Body over the size limit, or a request over the layer's batch limits."""

    status, type = 413, "payload_too_large"


class UnsupportedMediaTypeError(ServiceError):
    """Content-Type, Content-Encoding or Accept names a format the service does not speak."""

    status, type = 415, "unsupported_media_type"


class InvalidInputError(ServiceError):
    """Well-formed tensor that does not fit the layer: rank, channels, dtype, spatial size."""

    status, type = 422, "invalid_input"


class OverloadedError(ServiceError):
    """The layer's queue is full, or the server's bytes in flight are at their bound. Carries ``Retry-After``."""

    status, type = 429, "overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


class NotReadyError(ServiceError):
    """Self-tests have not passed (yet), one failed, or the server is draining. Carries ``Retry-After``."""

    status, type = 503, "not_ready"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


class DeadlineExceededError(ServiceError):
    """``X-Deadline-Ms`` passed before execution, or the request outlived the request timeout."""

    status, type = 504, "deadline_exceeded"

    @classmethod
    def before_execution(cls, deadline_ms: float) -> DeadlineExceededError:
        """The one answer for a passed ``X-Deadline-Ms``, whichever of the route's timer, the batcher or the engine
        notices it first."""
        return cls(f"X-Deadline-Ms of {deadline_ms:g} ms passed before execution")


class ClientGoneError(ServiceError):
    """The client went away; nothing is sent (status 499 is for the metrics only)."""

    status, type = 499, "client_closed_request"


class InternalError(ServiceError):
    """The kernel (or anything else on the server) failed; the message never holds a traceback."""

    status, type = 500, "internal"


# The gRPC status code of each HTTP status a ServiceError has (grpc.StatusCode's names; this module does not import
# grpc). 429 and 503 are UNAVAILABLE, which clients retry, as Triton answers a full queue.
GRPC_CODES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    408: "DEADLINE_EXCEEDED",
    413: "RESOURCE_EXHAUSTED",
    415: "INVALID_ARGUMENT",
    422: "INVALID_ARGUMENT",
    429: "UNAVAILABLE",
    431: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def grpc_code(error: ServiceError) -> str:
    """The name of ``error``'s gRPC status code (``grpc.StatusCode[name]``): ``GRPC_CODES`` by its HTTP status."""
    return GRPC_CODES.get(error.status, "INTERNAL" if error.status >= 500 else "INVALID_ARGUMENT")


def error_body(error: ServiceError, path: str) -> dict[str, object]:
    """The JSON body for ``error`` on ``path``: KServe's shape under ``/v2``, the native shape elsewhere."""
    if path == "/v2" or path.startswith("/v2/"):
        return {"error": error.message, "type": error.type}
    return {"error": {"type": error.type, "message": error.message}}


def error_response(error: ServiceError, path: str) -> JSONResponse:
    """The response for ``error``: its status, headers and JSON body."""
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(error, path), status_code=error.status, headers=error.headers)


def _from_http_exception(exc: StarletteHTTPException) -> ServiceError:
    if exc.status_code == 404:
        return NotFoundError("no such route")
    if exc.status_code == 405:
        return MethodNotAllowedError("method not allowed on this route")
    err = ServiceError(str(exc.detail) if exc.detail else "request failed")
    err.status = exc.status_code
    err.type = {400: "malformed_body", 401: "unauthorized", 413: "payload_too_large",
                415: "unsupported_media_type", 422: "invalid_input", 429: "overloaded", 503: "not_ready",
                504: "deadline_exceeded"}.get(exc.status_code, "internal")
    return err


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors():
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "request"
        parts.append(f"{loc}: {e.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    """Route every error (domain, validation, 404/405, unexpected) through the one map above."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    async def on_service_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ServiceError)
        return error_response(exc, request.url.path)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(InvalidInputError(_validation_message(exc)), request.url.path)

    async def on_http_exception(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        response = error_response(_from_http_exception(exc), request.url.path)
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(InternalError("internal server error"), request.url.path)

    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(Exception, on_unexpected)
