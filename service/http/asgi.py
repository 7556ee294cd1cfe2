"""The inference routes' own HTTP layer: ASGI in, ASGI out, without the framework's per-request machinery.

``POST /deconv`` and the KServe infer routes are the service's hot path. At thousands of requests per second per
HTTP process, FastAPI's and Starlette's middleware stack, router, ``Request`` and ``Response`` cost about as much
CPU as decoding, submitting and encoding a request together (docs/architecture.md, "Pieces we wrote where a
library exists"). ``App``, the FastAPI app that ``service.http.app.create_app`` builds, answers those routes straight
from the ASGI scope; every other request goes through FastAPI as usual.

Each such route is declared once, as a ``FastRoute`` (``service.http.routes.INFERENCE_ROUTES``): its path template,
its handler, and the pydantic models of its parameters, bodies and errors. From that table ``App`` matches a POST
(``FastRoutes.match``), leaves the other methods on those paths to FastAPI's router (``OtherMethods``: 405 with
``Allow: POST``, and the trailing-slash redirect, as for any route), and adds the routes' OpenAPI operations to the
document FastAPI generates for the rest (``FastRoutes.document``). There is no FastAPI route for these POSTs: one
path per URL.

What the connection says of a matched request is gathered once, into its ``Call``, before its handler runs: the
headers and query parameters, the app's engine, the watch on its client; ``admit`` checks the API key, the query
parameters the route requires (from its model in the table) and the deadline header, in that order. The handler
reads them as they are (no call back into this module for them), and comes back here once, for its body
(``read_body``); the walk of one request: docs/architecture.md, "A request's path".
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import parse_qsl

from fastapi import FastAPI
from fastapi.openapi.constants import REF_TEMPLATE
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match, NoMatchFound, compile_path

from service.budget import Held
from service.errors import (
    ClientGoneError,
    InternalError,
    InvalidInputError,
    MalformedBodyError,
    PayloadTooLargeError,
    RequestTimeoutError,
    ServiceError,
    UnauthorizedError,
    error_body,
)
from service.http.bodies import MIN_BYTES

if TYPE_CHECKING:
    from pydantic import SecretStr
    from starlette.datastructures import URLPath
    from starlette.types import Receive, Scope, Send

    from service.budget import Budget
    from service.engine.interface import Engine
    from service.http.bodies import BodyPool

log = logging.getLogger("deconv.service")

# Set in a request's scope by the connection (service.http.server.HTTPProtocol) when its body did not arrive in time:
# the disconnect the application then receives is a 408, already written to the client.
BODY_TIMED_OUT = "deconv.body_timed_out"
# Set in a request's scope by the connection (service.http.server.HTTPProtocol): ``await scope[BODY_INTO](scope,
# view)`` fills ``view`` with the next bytes of the body straight from the connection, and returns how many it wrote.
BODY_INTO = "deconv.body_into"
# Set in a request's scope by the connection (service.http.server.HTTPProtocol): ``scope[ON_DISCONNECT](callback)``
# calls ``callback`` on the event loop when the client goes, and returns what stops that.
ON_DISCONNECT = "deconv.on_disconnect"
# Set in a request's scope by the connection (service.http.server.HTTPProtocol): ``scope[ANSWER_NOW](scope)`` is
# True when the answer may go before the body has all come, with Connection: close (the connection then drops the
# rest of the body before it closes), False when the body is all there.
ANSWER_NOW = "deconv.answer_now"
CLOSE = (b"connection", b"close")


# The largest deadline a client may ask for, X-Deadline-Ms in ms and KServe's parameters.timeout in us (a year:
# anything longer is a mistake; the request timeout bounds every request anyway).
MAX_DEADLINE_MS = 365 * 24 * 3600 * 1000


class Call:
    """One HTTP request as the inference handlers see it, gathered once when ``App`` matched its route: the ASGI
    scope and receive channel, the headers (the first value of each, by lower-case name, as Starlette's
    ``Headers.get``), the query parameters (the last value of each, as Starlette's ``QueryParams.get``), the path
    parameters, the app's ``Engine`` and reused body buffers, the bytes the request holds of the app's budget
    (``held``, given back once its answer is written) and the watch on its client (``on_disconnect``, the
    connection's own where it has one: ``disconnect_watch``). ``admit`` adds the deadline it asks for
    (``deadline_ms``) before the route runs."""

    __slots__ = ("bodies", "body_read", "deadline_ms", "engine", "headers", "held", "on_disconnect", "params", "query",
                 "receive", "scope")

    def __init__(self, scope: Scope, receive: Receive, params: dict[str, str]) -> None:
        app = scope["app"]
        self.scope = scope
        self.receive = receive
        self.params = params
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in reversed(scope["headers"])}
        self.query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True))
        self.engine: Engine = app.engine
        self.bodies: BodyPool = app.bodies
        self.held = Held(app.budget)
        self.on_disconnect = disconnect_watch(scope, receive)
        self.deadline_ms: float | None = None
        self.body_read = False  # the request's body has been received to its end

    @property
    def path(self) -> str:
        """The path below the app's root path (what the routes match)."""
        return route_path(self.scope)


def disconnect_watch(scope: Scope, receive: Receive) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """What calls a callback on the event loop when the request's client goes (once its body is read), and returns
    what stops that: the connection's own hook where it has one (``ON_DISCONNECT``); elsewhere a task that waits for
    the ASGI disconnect, the next message after the body."""
    watch = scope.get(ON_DISCONNECT)
    return watch if watch is not None else functools.partial(_watch_receive, receive)  # type: ignore[no-any-return]


def _watch_receive(receive: Receive, callback: Callable[[], None]) -> Callable[[], None]:
    gone = asyncio.get_running_loop().create_task(disconnected(receive))
    gone.add_done_callback(lambda task: None if task.cancelled() else callback())
    return gone.cancel


def admit(call: Call, query: Sequence[str]) -> None:
    """Check what the connection says of a request before its route runs, in this order: the API key
    (``check_api_key``), the query parameters its route requires (``query``; 422 for the first one missing), the
    deadline it asks for (``X-Deadline-Ms``, kept as ``call.deadline_ms``)."""
    check_api_key(call.engine.settings.api_key, call.scope["headers"])
    for name in query:
        if name not in call.query:
            raise InvalidInputError(f"query.{name}: Field required")
    call.deadline_ms = deadline_header(call.headers.get("x-deadline-ms"))


def check_api_key(key: SecretStr | None, headers: Sequence[tuple[bytes, bytes]]) -> None:
    """When an API key (``key``) is configured, demand ``Authorization: Bearer <key>`` (401 otherwise), in exactly
    one Authorization header (400 for several: which one counts would be a guess). ``headers``: the request's, as in
    the ASGI scope."""
    if key is None:
        return
    sent = [value for name, value in headers if name == b"authorization"]
    if len(sent) > 1:
        raise MalformedBodyError("more than one Authorization header; send exactly one")
    scheme, _, token = (sent[0].decode("latin-1") if sent else "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.get_secret_value().encode()):
        raise UnauthorizedError("missing or wrong API key; send 'Authorization: Bearer <key>'")


def deadline_header(text: str | None) -> float | None:
    """``X-Deadline-Ms`` (its value ``text``) in milliseconds, None when absent (422 unless a non-negative number)."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise InvalidInputError(f"header.x-deadline-ms: Input should be a valid number, got {text!r}") from None
    if not value >= 0:  # NaN too
        raise InvalidInputError("header.x-deadline-ms: Input should be greater than or equal to 0")
    if value > MAX_DEADLINE_MS:  # infinity too
        raise InvalidInputError(f"header.x-deadline-ms: Input should be less than or equal to {MAX_DEADLINE_MS}")
    return value


class Reply(NamedTuple):
    """A complete answer: status, body, media type and extra headers. The body is bytes, or a tuple of byte
    buffers written one after the other (a header and a view of a tensor's bytes: no copy joins them)."""

    body: bytes | tuple[bytes | memoryview, ...]
    media_type: str
    headers: dict[str, str]
    status: int = 200


Handler = Callable[[Call], Awaitable[Reply]]


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
    """Write ``reply`` as one response start and one body message per part of its body (the server's transport
    writes them together, ``service.http.server.CoalescingTransport``)."""
    body = reply.body
    parts = (body,) if isinstance(body, bytes) else body
    size = sum(memoryview(part).nbytes for part in parts)
    headers = [(b"content-length", str(size).encode()), (b"content-type", reply.media_type.encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    last = len(parts) - 1
    for i, part in enumerate(parts):
        await send({"type": "http.response.body", "body": part, "more_body": i < last})


async def read_body(call: Call, limit: int, *, tensor_as_is: bool = True) -> bytearray | memoryview:
    """The request body in a writable buffer (decoded tensors share it); 413 before reading when too large.

    A body of a declared length of ``service.http.bodies.MIN_BYTES`` or more is read into memory lent for it: with
    ``tensor_as_is`` (a tensor's bytes in the body as they are, not JSON or compressed) the engine's
    (``Engine.body_buffer``: a multi-process server's shared memory, from where the tensor goes to the engine by
    reference), else a reused buffer of the app's ``BodyPool``; either comes back when the request's last view of
    it is gone. The connection writes such a body straight into that memory (``BODY_INTO``) when it can.
    Any other body goes into a buffer that grows with the bytes received, never from the declared length alone.
    The declared length is taken from the app's budget before reading (the received length, chunk by chunk, when
    none is declared).

    Raises:
        PayloadTooLargeError: the declared or the received length exceeds ``limit`` (413).
        OverloadedError: the server's bytes in flight would exceed their bound (429).
        MalformedBodyError: a Content-Length that is not a number, or a body shorter or longer than it (400).
        RequestTimeoutError: the body did not arrive within the body timeout (408, written by the connection).
        ClientGoneError: the client disconnected before the body was complete.
    """
    size = declared_length(call)
    if size is not None:
        if size > limit:
            raise PayloadTooLargeError(f"body of {size} bytes exceeds the limit of {limit} bytes")
        call.held.take(size)
    lent = _lent_buffer(call, size, tensor_as_is) if size is not None and size >= MIN_BYTES else None
    received, more = 0, True
    if lent is not None:
        into = call.scope.get(BODY_INTO)
        while more:
            chunk, more = await _body_piece(call)  # what came with the head (and 100 Continue, if asked)
            end = received + len(chunk)
            if end > len(lent):
                raise MalformedBodyError(f"body longer than its Content-Length of {size} bytes")
            lent[received:end] = chunk
            received = end
            if more and into is not None and received < len(lent):
                received += await into(call.scope, lent[received:])
        body: bytearray | memoryview = lent
    else:
        buf = bytearray()
        while more:
            chunk, more = await _body_piece(call)
            if chunk:
                if len(buf) + len(chunk) > limit:
                    raise PayloadTooLargeError(f"body exceeds the limit of {limit} bytes")
                if size is None:
                    call.held.take(len(chunk))
                buf += chunk
        body, received = buf, len(buf)
    call.body_read = True
    if size is not None and received != size:
        raise MalformedBodyError(f"body ended after {received} of {size} bytes")
    return body


def _lent_buffer(call: Call, size: int, engine_first: bool) -> memoryview | None:
    """Memory for a body of ``size`` bytes (``MIN_BYTES`` or more): the engine's when ``engine_first`` and it has
    room, else the app's pool's, else none (the caller's own)."""
    lent = call.engine.body_buffer(size) if engine_first else None
    return lent if lent is not None else call.bodies.take(size)


async def _body_piece(call: Call) -> tuple[bytes, bool]:
    """The next piece of the request's body (possibly empty), and whether more follows.

    Raises:
        RequestTimeoutError: the body did not arrive within the body timeout.
        ClientGoneError: the client disconnected before the body was complete.
    """
    message = await call.receive()
    if message["type"] == "http.disconnect":
        if call.scope.get(BODY_TIMED_OUT):
            raise RequestTimeoutError("the body did not arrive within the body timeout")
        raise ClientGoneError("client disconnected while sending the body")
    return message.get("body", b""), message.get("more_body", False)


def declared_length(call: Call) -> int | None:
    """The request's Content-Length, None when absent.

    Raises:
        MalformedBodyError: not a number, or negative (400).
    """
    declared = call.headers.get("content-length")
    if declared is None:
        return None
    try:
        size = int(declared)
    except ValueError:
        raise MalformedBodyError(f"Content-Length {declared!r} is not a number") from None
    if size < 0:
        raise MalformedBodyError(f"Content-Length {size} is negative")
    return size


async def discard_body(call: Call, limit: int) -> bool:
    """Receive and drop what is left of the request's body, at most ``limit`` bytes; whether it all came.

    An answer written before the body was read (401, 404, 429, 503 while draining...) would otherwise be followed
    by closing a socket with unread data, which the client sees as a reset instead of the answer.
    """
    if call.body_read:
        return True
    try:
        size = declared_length(call)
    except MalformedBodyError:
        return False
    if size is not None and size > limit:
        return False
    received = 0
    while True:
        message = await call.receive()
        if message["type"] == "http.disconnect":
            return False
        received += len(message.get("body", b""))
        if received > limit:
            return False
        if not message.get("more_body", False):
            call.body_read = True
            return True


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


async def serve_call(handler: Handler, query: Sequence[str], call: Call, send: Send) -> None:
    """Admit ``call`` (``admit``, with the query parameters its route requires), run ``handler`` and write its
    reply, or the error's (no traceback reaches the client).

    An error answered before the whole body came (a refusal: 401, 404, 413, 429, 503...) goes at once, with
    ``Connection: close``, where the connection can drop the rest of the body after it (``ANSWER_NOW``): a client
    whose body stalls, or that waits for ``100 Continue``, gets its refusal now. Elsewhere, or when the body is all
    there already, the rest of the body is read and dropped first (up to the body limit; past it the connection
    closes after the answer), so that the client reads the answer. An answer written once the server drains closes
    its connection too, also for a request that came in before (``App`` closes those that come in after): in an HTTP
    process of N, the engine's drain can reach this process before its own signal does.
    """
    try:
        try:
            admit(call, query)
            reply = await handler(call)
        except ServiceError as exc:
            reply = error_reply(exc, call.path)
        except Exception as exc:
            log.error("unhandled error on %s %s", call.scope["method"], call.path, exc_info=exc)
            reply = error_reply(InternalError("internal server error"), call.path)
        close = call.engine.readiness.state == "draining"
        if not call.body_read:
            answer_now = call.scope.get(ANSWER_NOW)
            if (answer_now is not None and answer_now(call.scope)) or not await discard_body(
                    call, call.engine.settings.max_body_bytes):
                close = True
        if close:
            reply = reply._replace(headers={**reply.headers, "Connection": "close"})
        await send_reply(send, reply)
    finally:
        call.held.release()


class Body(NamedTuple):
    """A request or response body in the OpenAPI document: its description and, by media type, the pydantic model
    of its JSON, or None for raw bytes (a tensor file, or KServe's JSON followed by binary tensors)."""

    description: str
    content: dict[str, type[BaseModel] | None]


class FastRoute(NamedTuple):
    """One ``POST`` route that ``App`` answers itself, and what the OpenAPI document says of it.

    ``path`` is a Starlette path template (a parameter is one path segment); ``parameters`` holds, by location
    (``path``, ``query``, ``header``, in that order), the model whose fields are the parameters there (a field's
    alias is the parameter's name); ``name`` makes the operation id, as FastAPI makes it from a function's name.
    """

    name: str
    path: str
    handler: Handler
    summary: str
    description: str
    tags: list[str]
    parameters: dict[str, type[BaseModel]]
    body: Body
    responses: dict[int, Body]


class FastRoutes:
    """The routes ``App`` answers itself: matched as Starlette matches a route, and documented from their models."""

    def __init__(self, routes: Sequence[FastRoute]) -> None:
        self.routes = tuple(routes)
        self.patterns = [(compile_path(route.path)[0], route.handler, required(route.parameters.get("query")))
                         for route in self.routes]

    def match(self, path: str) -> tuple[Handler, tuple[str, ...], dict[str, str]] | None:
        """The handler of the route at ``path`` (below the root path), the query parameters it requires and the
        path parameters, or None."""
        for pattern, handler, query in self.patterns:
            found = pattern.match(path)
            if found is not None:
                return handler, query, found.groupdict()
        return None

    def document(self, document: dict[str, Any]) -> dict[str, Any]:
        """``document`` (FastAPI's OpenAPI document of the other routes) with these routes' operations first and the
        JSON schemas of their models among its components."""
        schemas: dict[str, Any] = document.setdefault("components", {}).setdefault("schemas", {})
        paths: dict[str, Any] = {}
        for route in self.routes:
            paths.setdefault(route.path, {})["post"] = {
                "tags": route.tags,
                "summary": route.summary,
                "description": route.description,
                "operationId": re.sub(r"\W", "_", route.name + route.path) + "_post",
                "parameters": [p for where, model in route.parameters.items() for p in parameters(where, model)],
                "requestBody": {"required": True, **content(route.body, "validation", schemas)},
                "responses": {str(status): content(body, "serialization", schemas)
                              for status, body in route.responses.items()},
            }
        for path, item in document["paths"].items():
            paths.setdefault(path, {}).update(item)
        document["paths"] = paths
        return document


BINARY = {"type": "string", "format": "binary"}


def required(model: type[BaseModel] | None) -> tuple[str, ...]:
    """The parameters ``model`` declares required, by the names they are sent under (a field's alias, else its
    name)."""
    if model is None:
        return ()
    return tuple(field.alias or name for name, field in model.model_fields.items() if field.is_required())


def parameters(where: str, model: type[BaseModel]) -> list[dict[str, Any]]:
    """The OpenAPI parameters in ``where`` that ``model``'s fields declare, as FastAPI writes its own."""
    schema = model.model_json_schema(by_alias=True, ref_template=REF_TEMPLATE)
    required = set(schema.get("required", ()))
    out = []
    for name, field in schema["properties"].items():
        parameter = {"name": name, "in": where, "required": name in required, "schema": field}
        if "description" in field:
            parameter["description"] = field["description"]
        out.append(parameter)
    return out


def content(body: Body, mode: JsonSchemaMode, schemas: dict[str, Any]) -> dict[str, Any]:
    """``body`` as an OpenAPI body or response: each model as a reference to its schema, which goes into
    ``schemas`` (the document's components) with the schemas of the models it holds."""
    media: dict[str, Any] = {}
    for media_type, model in body.content.items():
        if model is None:
            media[media_type] = {"schema": BINARY}
            continue
        refs, top = models_json_schema([(model, mode)], ref_template=REF_TEMPLATE)
        for name, schema in top.get("$defs", {}).items():
            if schemas.setdefault(name, schema) != schema:
                raise ValueError(f"two different schemas named {name!r} in the OpenAPI document")
        media[media_type] = {"schema": refs[(model, mode)]}
    return {"description": body.description, "content": media}


class OtherMethods(BaseRoute):
    """The paths of ``FastRoutes`` in FastAPI's router. ``App`` answers their POSTs before the router, so a request
    that the router matches here used another method: 405 with ``Allow: POST``, as Starlette answers a route's other
    methods. A path that differs from one of them only by a trailing slash is redirected, as for any route."""

    def __init__(self, routes: FastRoutes) -> None:
        self.routes = routes

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] == "http" and self.routes.match(route_path(scope)) is not None:
            return Match.PARTIAL, {}
        return Match.NONE, {}

    def url_path_for(self, name: str, /, **path_params: Any) -> URLPath:
        raise NoMatchFound(name, path_params)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise HTTPException(405, headers={"Allow": "POST"})


class App(FastAPI):
    """The service's FastAPI app, answering ``POST`` on the paths of ``fast_routes`` by itself. What every request
    uses (its ``Engine``, the bound on bytes in flight, the reused body buffers) is both a plain attribute, read on
    the inference path (Starlette's ``app.state`` costs a lookup through ``__getattr__`` each time), and in
    ``app.state``, where FastAPI's handlers find it."""

    def __init__(self, *, fast_routes: FastRoutes, engine: Engine, budget: Budget, bodies: BodyPool,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast_routes = fast_routes
        self.router.routes.append(OtherMethods(fast_routes))
        self.engine = self.state.engine = engine
        self.budget = self.state.budget = budget
        self.bodies = self.state.bodies = bodies

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self.engine.readiness.state == "draining":  # every answer from now on closes its connection
                send = closing(send)
            if scope["method"] == "POST":
                found = self.fast_routes.match(route_path(scope))
                if found is not None:
                    scope["app"] = self
                    handler, query, params = found
                    await serve_call(handler, query, Call(scope, receive, params), send)
                    return
        await super().__call__(scope, receive, send)

    def openapi(self) -> dict[str, Any]:
        """FastAPI's document, with the operations of ``fast_routes``."""
        if not self.openapi_schema:
            self.openapi_schema = self.fast_routes.document(super().openapi())
        return self.openapi_schema


def closing(send: Send) -> Send:
    """``send`` with ``Connection: close`` added to the response's headers (the server then closes the
    connection once the response is written)."""

    async def send_closing(message: Any) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            if not any(k.lower() == b"connection" and v.lower() == b"close" for k, v in headers):
                headers.append(CLOSE)
            message = {**message, "headers": headers}
        await send(message)

    return send_closing
