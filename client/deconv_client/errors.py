"""The client's exception tree: one class per error type of the service, plus transport and codec errors.

Everything the client raises on purpose derives from :class:`DeconvError`::

    DeconvError
    ├── TransportError                 no usable HTTP response: connection refused/reset, timeout, protocol error
    ├── CodecError (also ValueError)   a tensor could not be encoded, or a response body could not be decoded
    └── APIError                       the server answered with an error status
        ├── BadRequestError            400/415: the request itself is wrong
        │   ├── MalformedBodyError         400 malformed_body: not a valid .npy/safetensors payload
        │   └── UnsupportedMediaTypeError  415 unsupported_media_type: Content-Type/Accept not supported
        ├── UnauthorizedError          401 unauthorized: API key missing or wrong
        ├── UnknownLayerError          404 unknown_layer: no layer of that name
        ├── PayloadTooLargeError       413 payload_too_large: body, batch or sample over the limits
        ├── InvalidInputError          422 invalid_input: wrong rank, channels, dtype or spatial size
        ├── OverloadedError            429 overloaded: the layer's queue is full (retried by default)
        ├── NotReadyError              503 not_ready: starting, self-test failed or draining (retried by default)
        ├── DeadlineExceededError      504 deadline_exceeded: ``X-Deadline-Ms`` passed before execution
        └── ServerError                500 internal, and any other 5xx

An :class:`APIError` carries the server's ``message``, the HTTP ``status_code``, the server's error ``type``
(the stable string from the protocol, e.g. ``"unknown_layer"``), the ``Retry-After`` delay when one was sent
and the :class:`httpx.Response`. The class is chosen from the ``type`` field of the JSON error body
``{"error": {"type": ..., "message": ...}}``; a body without a known type (a proxy's HTML page, say) falls back
to the status code. Which errors are retried is decided by :class:`deconv_client.Retry`, never by the class alone:
429, 503 and connection errors by default, no other 4xx ever.
"""

from __future__ import annotations

import email.utils
import json
import time

import httpx

__all__ = [
    "APIError",
    "BadRequestError",
    "CodecError",
    "DeadlineExceededError",
    "DeconvError",
    "InvalidInputError",
    "MalformedBodyError",
    "NotReadyError",
    "OverloadedError",
    "PayloadTooLargeError",
    "ServerError",
    "TransportError",
    "UnauthorizedError",
    "UnknownLayerError",
    "UnsupportedMediaTypeError",
    "error_from_response",
    "parse_retry_after",
]


class DeconvError(Exception):
    """Base class of every exception the client raises on purpose."""


class TransportError(DeconvError):
    """No usable HTTP response: the connection failed, timed out or broke mid-exchange.

    The underlying :class:`httpx.TransportError` is available as ``__cause__`` and as :attr:`cause`.
    """

    def __init__(self, message: str, *, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.cause = cause


class CodecError(DeconvError, ValueError):
    """A tensor could not be encoded for the wire, or a payload could not be decoded (never unpickled)."""


class APIError(DeconvError):
    """The server answered with an error status.

    Attributes:
        message: the server's message (or the start of the body when it was not the protocol's JSON).
        status_code: the HTTP status, or ``None`` when the error was raised by the client itself.
        type: the server's stable error type (``"unknown_layer"``, ``"overloaded"``, ...), or ``None``.
        retry_after: seconds from the ``Retry-After`` header, or ``None``.
        response: the :class:`httpx.Response`, or ``None``.
    """

    #: the protocol's error type this class stands for (``None`` for the catch-all classes).
    error_type: str | None = None
    #: the status this class stands for when the body names no type.
    default_status: int | None = None

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        type: str | None = None,
        retry_after: float | None = None,
        response: httpx.Response | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.retry_after = retry_after
        self.response = response

    def __str__(self) -> str:
        parts = [str(p) for p in (self.status_code, self.type) if p is not None]
        return f"{self.message} ({', '.join(parts)})" if parts else self.message


class BadRequestError(APIError):
    """The request itself is wrong (400/415); sending it again cannot help."""

    default_status = 400


class MalformedBodyError(BadRequestError):
    """400 ``malformed_body``: the body is not a valid .npy/safetensors payload, or holds several tensors."""

    error_type = "malformed_body"
    default_status = 400


class UnsupportedMediaTypeError(BadRequestError):
    """415 ``unsupported_media_type``: Content-Type or Accept is not one of the two tensor formats."""

    error_type = "unsupported_media_type"
    default_status = 415


class UnauthorizedError(APIError):
    """401 ``unauthorized``: the server has an API key and the request's was missing or wrong."""

    error_type = "unauthorized"
    default_status = 401


class UnknownLayerError(APIError):
    """404 ``unknown_layer``: the server has no layer of that name."""

    error_type = "unknown_layer"
    default_status = 404


class PayloadTooLargeError(APIError):
    """413 ``payload_too_large``: the body, batch or sample is over the server's or the layer's limits."""

    error_type = "payload_too_large"
    default_status = 413


class InvalidInputError(APIError):
    """422 ``invalid_input``: wrong rank, channel count, dtype, or spatial size out of the layer's limits."""

    error_type = "invalid_input"
    default_status = 422


class OverloadedError(APIError):
    """429 ``overloaded``: the layer's queue is full; :attr:`retry_after` says when to come back."""

    error_type = "overloaded"
    default_status = 429


class NotReadyError(APIError):
    """503 ``not_ready``: the server is starting, failed its self-test, or is draining."""

    error_type = "not_ready"
    default_status = 503


class DeadlineExceededError(APIError):
    """504 ``deadline_exceeded``: the request's ``X-Deadline-Ms`` passed before it started executing."""

    error_type = "deadline_exceeded"
    default_status = 504


class ServerError(APIError):
    """500 ``internal`` (a kernel failure, say), and any other 5xx without a more specific type."""

    error_type = "internal"
    default_status = 500


_BY_TYPE: dict[str, type[APIError]] = {
    cls.error_type: cls
    for cls in (
        MalformedBodyError,
        UnsupportedMediaTypeError,
        UnauthorizedError,
        UnknownLayerError,
        PayloadTooLargeError,
        InvalidInputError,
        OverloadedError,
        NotReadyError,
        DeadlineExceededError,
        ServerError,
    )
    if cls.error_type is not None
}

# Fallback when the body names no known type. 404 is left out on purpose: a wrong base URL also answers 404,
# and calling that an unknown layer would mislead.
_BY_STATUS: dict[int, type[APIError]] = {
    400: MalformedBodyError,
    401: UnauthorizedError,
    413: PayloadTooLargeError,
    415: UnsupportedMediaTypeError,
    422: InvalidInputError,
    429: OverloadedError,
    503: NotReadyError,
    504: DeadlineExceededError,
}

_MAX_MESSAGE_CHARS = 500


def parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date); ``None`` if absent/invalid."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - time.time()
    if seconds != seconds:  # NaN
        return None
    return max(0.0, seconds)


def error_from_response(response: httpx.Response) -> APIError:
    """Build the :class:`APIError` subclass that matches an error response (its body must have been read)."""
    status = response.status_code
    kind: str | None = None
    message: str | None = None
    try:
        payload = json.loads(response.content)
    except (ValueError, UnicodeDecodeError):
        payload = None
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict):
            kind = error.get("type") if isinstance(error.get("type"), str) else None
            message = error.get("message") if isinstance(error.get("message"), str) else None
        elif isinstance(error, str):  # KServe v2 routes: {"error": message, "type": type}
            message = error
            kind = payload.get("type") if isinstance(payload.get("type"), str) else None
        elif "detail" in payload:  # a framework-level error that bypassed the service's handler
            message = str(payload["detail"])
    if message is None:
        text = response.content[:_MAX_MESSAGE_CHARS].decode("utf-8", "replace").strip()
        message = text or response.reason_phrase or f"HTTP {status}"

    cls = _BY_TYPE.get(kind) if kind else None
    if cls is None:
        cls = _BY_STATUS.get(status)
    if cls is None:
        cls = ServerError if status >= 500 else APIError
    return cls(
        message,
        status_code=status,
        type=kind,
        retry_after=parse_retry_after(response.headers.get("retry-after")),
        response=response,
    )
