"""The inference routes' own HTTP layer: ASGI in, ASGI out, without the framework's per-request machinery.

``POST /deconv`` and the KServe infer routes are the service's hot path. At thousands of requests per second per
HTTP process, FastAPI's and Starlette's middleware stack, router, ``Request`` and ``Response`` cost about as much
CPU as decoding, submitting and encoding a request together (docs/operations.md, "Throughput"). ``App``, the
FastAPI app that ``service.app.create_app`` builds, answers those routes straight from the ASGI scope; every
other request, and any other method on those paths, goes through FastAPI as usual.

The inference handlers take a ``Call`` and return a ``Reply`` (or raise a ``ServiceError``) whichever way the
request came: FastAPI's routes for the same paths, which document them in OpenAPI, adapt ``Request`` and
``Response`` to them (``call_of`` / ``response_of``). Both ways give the same answers, errors included.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import parse_qsl

from fastapi import FastAPI, Request, Response

from service.errors import (
    ClientGoneError,
    InternalError,
    MalformedBodyError,
    PayloadTooLargeError,
    ServiceError,
    error_body,
)

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from service.app import Service

log = logging.getLogger("deconv.service")


class Call:
    """One HTTP request as the inference handlers see it: the ASGI scope and receive channel, the headers (the
    first value of each, by lower-case name, as Starlette's ``Headers.get``) and the path parameters."""

    __slots__ = ("headers", "params", "receive", "scope")

    def __init__(self, scope: Scope, receive: Receive, params: dict[str, str]) -> None:
        self.scope = scope
        self.receive = receive
        self.params = params
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in reversed(scope["headers"])}

    @property
    def service(self) -> Service:
        """The app's ``Service``."""
        return self.scope["app"].state.service  # type: ignore[no-any-return]

    @property
    def path(self) -> str:
        """The path below the app's root path (what the routes match)."""
        return route_path(self.scope)

    def query(self, name: str) -> str | None:
        """The last value of query parameter ``name`` (as Starlette's ``QueryParams.get``), None when absent."""
        value = None
        for key, item in parse_qsl(self.scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True):
            if key == name:
                value = item
        return value


class Reply(NamedTuple):
    """A complete answer: status, body, media type and extra headers."""

    body: bytes
    media_type: str
    headers: dict[str, str]
    status: int = 200


Handler = Callable[[Call], Awaitable[Reply]]
Matcher = Callable[[str], tuple[Handler, dict[str, str]] | None]


def route_path(scope: Scope) -> str:
    """``scope["path"]`` without the root path, as Starlette's router matches it."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and len(path) > len(root) and path[len(root)] == "/":
        return path[len(root):]
    return path


def error_reply(error: ServiceError, path: str) -> Reply:
    """The answer to ``error`` on ``path``: the body ``service.errors.error_response`` writes, byte for byte."""
    body = json.dumps(error_body(error, path), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return Reply(body.encode(), "application/json", error.headers, error.status)


async def send_reply(send: Send, reply: Reply) -> None:
    """Write ``reply`` as one response start and one body message."""
    headers = [(b"content-length", str(len(reply.body)).encode()), (b"content-type", reply.media_type.encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})


def call_of(request: Request) -> Call:
    """The ``Call`` of a request that came through FastAPI."""
    return Call(request.scope, request.receive, dict(request.path_params))


def response_of(reply: Reply) -> Response:
    """``reply`` as a FastAPI response."""
    return Response(reply.body, status_code=reply.status, media_type=reply.media_type, headers=reply.headers)


async def read_body(call: Call, limit: int) -> bytearray:
    """The request body in a writable buffer (decoded tensors share it); 413 before reading when too large.

    Raises:
        PayloadTooLargeError: the declared or the received length exceeds ``limit`` (413).
        MalformedBodyError: a Content-Length that is not a number, or a body shorter than it (400).
        ClientGoneError: the client disconnected before the body was complete.
    """
    declared = call.headers.get("content-length")
    size: int | None = None
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise MalformedBodyError(f"Content-Length {declared!r} is not a number") from None
        if size < 0:
            raise MalformedBodyError(f"Content-Length {size} is negative")
        if size > limit:
            raise PayloadTooLargeError(f"body of {size} bytes exceeds the limit of {limit} bytes")
    buf = bytearray(size) if size is not None else bytearray()
    filled = 0
    while True:
        message = await call.receive()
        if message["type"] == "http.disconnect":
            raise ClientGoneError("client disconnected while sending the body")
        chunk = message.get("body", b"")
        if chunk:
            end = filled + len(chunk)
            if end > limit:
                raise PayloadTooLargeError(f"body exceeds the limit of {limit} bytes")
            if size is not None and end <= size:
                buf[filled:end] = chunk
            else:
                del buf[filled:]
                buf += chunk
            filled = end
        if not message.get("more_body", False):
            break
    if filled != len(buf):
        raise MalformedBodyError(f"body ended after {filled} of {len(buf)} bytes")
    return buf


async def disconnected(receive: Receive) -> None:
    """Return when the client has gone: after the body, the next ASGI message is the disconnect (or it comes after
    the response)."""
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
    except Exception:  # a server that raises instead of sending the message: the client is gone all the same
        return


async def serve_call(handler: Handler, call: Call, send: Send) -> None:
    """Run ``handler`` and write its reply, or the error's (no traceback reaches the client)."""
    try:
        reply = await handler(call)
    except ServiceError as exc:
        reply = error_reply(exc, call.path)
    except Exception as exc:
        log.error("unhandled error on %s %s", call.scope["method"], call.path, exc_info=exc)
        reply = error_reply(InternalError("internal server error"), call.path)
    await send_reply(send, reply)


class App(FastAPI):
    """The service's FastAPI app, answering ``POST`` on the paths that ``fast_routes`` matches by itself."""

    def __init__(self, *, fast_routes: Matcher, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast_routes = fast_routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            found = self.fast_routes(route_path(scope))
            if found is not None:
                scope["app"] = self
                await serve_call(found[0], Call(scope, receive, found[1]), send)
                return
        await super().__call__(scope, receive, send)
