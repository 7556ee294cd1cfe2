"""The service on a Ray cluster with Ray Serve (optional extra ``deconv[ray]``).

Two deployments make one Serve application::

    HTTP -> Ray proxy -> Gateway (CPU)  --DeploymentHandle-->  DeconvServer replicas (one GPU each)
                         maps Ray's errors                       @serve.ingress over create_app(): the same
                         to our JSON shape                       FastAPI app, lifespan, batcher and workers

``DeconvServer`` is a ``@serve.ingress`` deployment over the FastAPI app that ``service.http.app.create_app`` builds on
each replica (with the replica's own ``Settings``), so the routes, the batcher, the self-test and the error map are
exactly those of ``python -m service``. Ray runs the app's lifespan when a replica starts; the replica only counts
as started once every layer passed its self-test, so Ray never routes to a replica that would answer 503.

Why a gateway: Ray's own backpressure (a replica at ``max_ongoing_requests`` and more than ``max_queued_requests``
waiting in the caller) is raised as ``BackPressureError`` where the request is routed. Behind Ray's HTTP proxy
that becomes a plain-text answer; behind the gateway, which calls the replicas through a ``DeploymentHandle``, it
becomes our ``429 {"error": {"type": "overloaded", ...}}`` with ``Retry-After``, and an unavailable deployment or
a replica that died becomes ``503 not_ready`` with ``Retry-After`` (KServe's shape under ``/v2``), through the
one map in ``service.errors``. The price is one more hop inside the cluster; ``gateway: false`` deploys
``DeconvServer`` alone as the HTTP ingress (Ray's proxy still answers 429 + Retry-After, with a text body).

Configuration: ``RayServeConfig`` (arguments of ``app_builder``, or ``DECONV_RAY_*`` environment variables).
Run it with ``serve run service.ray_serve:app_builder num_gpus=1 max_replicas=4`` or from a RayService manifest
(deploy/kuberay/rayservice.yaml); docs/deploy.md has the commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from ray import serve
from ray.exceptions import RayActorError
from ray.serve import Application
from ray.serve.config import BackpressureConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message

from service.config import Settings
from service.errors import (
    InternalError,
    NotReadyError,
    OverloadedError,
    PayloadTooLargeError,
    ServiceError,
    error_response,
)
from service.http.app import create_app

log = logging.getLogger("deconv.ray")

REPLICA_HEADER = "x-deconv-replica"


class RayServeConfig(BaseSettings):
    """How the service is laid out on a Ray cluster. Environment: ``DECONV_RAY_<FIELD>``; arguments win.

    ``settings`` holds ``service.config.Settings`` fields (names without the ``DECONV_`` prefix) for every
    replica, on top of the ``DECONV_*`` environment of the node the replica runs on.
    """

    model_config = SettingsConfigDict(env_prefix="DECONV_RAY_", extra="forbid")

    num_gpus: float = Field(1.0, ge=0.0, description="GPUs per replica; 0 runs CPU replicas; 0.5 puts two on a GPU.")
    num_cpus: float = Field(1.0, ge=0.0, description="CPUs per replica (Ray's scheduling unit, not a limit).")
    min_replicas: int = Field(1, ge=0, description="Fewest replicas (autoscaling); equal to max: a fixed count.")
    max_replicas: int = Field(4, ge=1, description="Most replicas (autoscaling).")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at deploy time (default min_replicas).")
    target_ongoing_requests: float = Field(
        32.0, gt=0.0, description="Autoscaling target of requests in flight per replica.")
    upscale_delay_s: float = Field(10.0, ge=0.0, description="Sustained load this long before adding a replica.")
    downscale_delay_s: float = Field(120.0, ge=0.0, description="Sustained idleness before removing a replica.")
    max_ongoing_requests: int = Field(
        128, ge=1, description="Requests one replica holds at once (its batcher needs several: >= max_batch_size).")
    max_queued_requests: int = Field(
        256, ge=-1, description="Requests waiting in each gateway replica for a free replica; then 429. -1: no limit.")
    retry_after_s: float = Field(1.0, ge=0.0, description="Retry-After of the 429/503 answers the gateway makes.")
    graceful_shutdown_timeout_s: float = Field(
        40.0, ge=0.0, description="How long a stopping replica may take to drain (>= the request timeout).")
    ready_timeout_s: float = Field(
        900.0, gt=0.0, description="Longest start of a replica (kernel build + self-tests) before it counts as failed.")
    gateway: bool = Field(True, description="Put the gateway in front (our error JSON for Ray's backpressure).")
    gateway_replicas: int = Field(1, ge=1, description="Gateway replicas (CPU).")
    gateway_num_cpus: float = Field(0.5, ge=0.0, description="CPUs per gateway replica.")
    gateway_max_ongoing_requests: int = Field(4096, ge=1, description="Requests one gateway replica holds at once.")
    settings: dict[str, Any] = Field(default_factory=dict, description="Settings fields for every replica.")

    @field_validator("settings")
    @classmethod
    def _known_settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Settings ignores unknown names (extra="ignore", for the environment); a typo here must not pass silently.
        unknown = sorted(set(value) - set(Settings.model_fields))
        if unknown:
            raise ValueError(f"unknown service settings {unknown}; known: {sorted(Settings.model_fields)}")
        return value

    @model_validator(mode="after")
    def _check_replicas(self) -> RayServeConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        initial = self.initial_replicas
        if initial is not None and not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(f"initial_replicas ({initial}) is outside [min_replicas, max_replicas]")
        return self

    def service_settings(self) -> dict[str, Any]:
        """The ``Settings`` overrides for a replica: CPU replicas (``num_gpus == 0``) default to ``devices="cpu"``."""
        overrides = dict(self.settings)
        if self.num_gpus == 0:
            overrides.setdefault("devices", "cpu")
        return overrides

    def scaling_options(self) -> dict[str, Any]:
        """``num_replicas`` for a fixed count, else Ray Serve's ``autoscaling_config``."""
        if self.min_replicas == self.max_replicas:
            return {"num_replicas": self.max_replicas}
        autoscaling: dict[str, Any] = {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
        }
        if self.initial_replicas is not None:
            autoscaling["initial_replicas"] = self.initial_replicas
        return {"autoscaling_config": autoscaling}


# --- one HTTP request, carried through a DeploymentHandle ------------------------------------------------------


@dataclass(frozen=True)
class ForwardedRequest:
    """What the gateway read of one HTTP request: enough to replay it into the replica's ASGI app."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    scheme: str = "http"
    client: tuple[str, int] | None = None


@dataclass(frozen=True)
class ForwardedResponse:
    """The replica app's complete answer."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    replica: str = ""


async def call_asgi(app: ASGIApp, request: ForwardedRequest) -> ForwardedResponse:
    """Run ``request`` through ``app`` in this process and collect the whole response.

    The body arrives in one message; after it, ``receive`` waits until the response is complete and then reports
    a disconnect, as a server does for a client that stays connected (the routes watch for disconnects).
    """
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": request.scheme,
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query_string,
        "headers": list(request.headers),
        "client": request.client,
        "server": ("127.0.0.1", 80),
    }
    body_sent = False
    finished = asyncio.Event()
    status: int | None = None
    headers: list[tuple[bytes, bytes]] = []
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = int(message["status"])
            headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                finished.set()

    try:
        await app(scope, receive, send)
    except Exception:
        if status is None:  # nothing was sent: the caller answers 500
            raise
        log.exception("the app failed after it started its response")
    finally:
        finished.set()
    if status is None:
        raise RuntimeError("the app returned without sending a response")
    return ForwardedResponse(status, headers, b"".join(chunks))


# --- the replicas ---------------------------------------------------------------------------------------------


def replica_settings(settings: dict[str, Any]) -> Settings:
    """A replica's ``Settings``: the node's ``DECONV_*`` environment and ``settings``, serving HTTP in one process
    (the replica itself: ``http_processes`` 1, whatever the node's environment says, so that the bytes-in-flight
    budget is not split between processes that do not exist)."""
    return Settings(**{**settings, "http_processes": 1})


async def wait_until_ready(app: FastAPI, timeout_s: float) -> None:
    """Wait until the app's engine passed its self-tests.

    Raises:
        RuntimeError: the warm-up failed (kernel build or self-test), the engine began draining, or it took
            longer than ``timeout_s``; the message says why.
    """
    readiness = app.state.engine.readiness
    deadline = time.monotonic() + timeout_s
    while readiness.state == "starting":
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the service was not ready after {timeout_s:g} s: {readiness.reason}")
        await asyncio.sleep(0.05)
    if readiness.state != "ready":
        raise RuntimeError(f"the service did not become ready: {readiness.reason}")


def build_replica_app(settings: Settings, ready_timeout_s: float) -> FastAPI:
    """``create_app(settings)`` whose lifespan start also waits for readiness (so Ray starts routing only then)."""
    app = create_app(settings)
    service_lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(application: FastAPI) -> AsyncIterator[None]:
        async with service_lifespan(application):
            await wait_until_ready(application, ready_timeout_s)
            yield

    app.router.lifespan_context = lifespan
    return app


@serve.deployment(name="DeconvServer")
@serve.ingress()
class DeconvServer:
    """One replica: the service's FastAPI app on the GPU (or CPU) Ray gave it.

    Ray sets ``CUDA_VISIBLE_DEVICES`` to the replica's GPU, so ``devices="auto"`` picks exactly that one.
    """

    def __init__(self, settings: dict[str, Any], ready_timeout_s: float = 900.0) -> None:
        # Built here, on the replica, so that the node's DECONV_* environment applies.
        self._settings = replica_settings(settings)
        self._ready_timeout_s = ready_timeout_s
        self._replica = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Called by Ray Serve after ``__init__``: the app this replica serves (its lifespan is run by Ray)."""
        return build_replica_app(self._settings, self._ready_timeout_s)

    async def forward(self, request: ForwardedRequest) -> ForwardedResponse:
        """Serve one request that the gateway forwarded, through the same app as the HTTP ingress."""
        response = await call_asgi(self.app, request)  # type: ignore[attr-defined]  # set by serve.ingress
        return ForwardedResponse(response.status, response.headers, response.body, self._replica)


# --- the gateway ----------------------------------------------------------------------------------------------


def ray_error_response(exc: BaseException, path: str, retry_after_s: float) -> Response:
    """Our error answer for a Ray Serve failure to route or run a request (``service.errors``'s one map).

    ``BackPressureError`` (every replica busy and the queue full) -> 429 overloaded; a deployment that is not
    available or a replica that died -> 503 not_ready; both with ``Retry-After``. Anything else -> 500.
    """
    error: ServiceError
    if isinstance(exc, BackPressureError):
        retry = exc.retry_after_s if exc.retry_after_s is not None else retry_after_s
        error = OverloadedError(f"every replica is busy and the queue is full: {exc.message}", retry_after_s=retry)
    elif isinstance(exc, DeploymentUnavailableError | ReplicaUnavailableError | RayActorError):
        error = NotReadyError("no replica is available right now; retry shortly", retry_after_s=retry_after_s)
    else:
        log.error("request to %s failed in Ray Serve", path, exc_info=exc)
        error = InternalError("internal server error")
    return error_response(error, path)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


@serve.deployment(name="Gateway")
class Gateway:
    """HTTP ingress on CPU: forwards every request to ``DeconvServer`` and answers Ray's failures in our shape.

    A plain deployment whose ``__call__`` takes the HTTP request (Ray Serve allows one ``@serve.ingress``
    deployment per application, and that is ``DeconvServer``, over the service's own app).
    """

    def __init__(self, server: DeploymentHandle, settings: dict[str, Any], retry_after_s: float = 1.0) -> None:
        self._server = server
        self._max_body_bytes = replica_settings(settings).max_body_bytes
        self._retry_after_s = retry_after_s

    async def __call__(self, request: Request) -> Response:
        """Forward ``request`` to a replica; answer 413/429/503/500 here when it cannot get there."""
        # Under a route prefix other than "/", Ray passes it as root_path; the app's routes start below it.
        path, root = request.scope["path"], request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        try:
            body = await _read_body(request, self._max_body_bytes)
        except ServiceError as exc:
            return error_response(exc, path)
        client = request.scope.get("client")
        forwarded = ForwardedRequest(
            method=request.method,
            path=path,
            query_string=request.scope.get("query_string", b""),
            headers=list(request.scope["headers"]),
            body=body,
            scheme=request.url.scheme,
            client=(str(client[0]), int(client[1])) if client else None,
        )
        try:
            result: ForwardedResponse = await self._server.forward.remote(forwarded)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return ray_error_response(exc, path, self._retry_after_s)
        response = Response(result.body, status_code=result.status)
        # The app's own headers as they are (content-type, content-length, Retry-After, X-Deconv-*).
        response.raw_headers = [*result.headers, (REPLICA_HEADER.encode(), result.replica.encode())]
        return response


# --- the application ------------------------------------------------------------------------------------------


def server_options(config: RayServeConfig) -> dict[str, Any]:
    """``DeconvServer.options(...)`` for ``config``: resources, Ray's backpressure limits, scaling."""
    return {
        "ray_actor_options": {"num_gpus": config.num_gpus, "num_cpus": config.num_cpus},
        "max_ongoing_requests": config.max_ongoing_requests,
        "max_queued_requests": config.max_queued_requests,
        # Only reached without the gateway (Ray's proxy answers): still 429 + Retry-After, with a text body.
        "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=config.retry_after_s),
        "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
        **config.scaling_options(),
    }


def gateway_options(config: RayServeConfig) -> dict[str, Any]:
    """``Gateway.options(...)`` for ``config``."""
    return {
        "num_replicas": config.gateway_replicas,
        "ray_actor_options": {"num_cpus": config.gateway_num_cpus},
        "max_ongoing_requests": config.gateway_max_ongoing_requests,
    }


def build_application(config: RayServeConfig) -> Application:
    """The Serve application ``config`` describes (pass it to ``serve.run``)."""
    settings = config.service_settings()
    server = DeconvServer.options(**server_options(config)).bind(settings, config.ready_timeout_s)
    if not config.gateway:
        return server
    return Gateway.options(**gateway_options(config)).bind(server, settings, config.retry_after_s)


def app_builder(args: dict[str, Any]) -> Application:
    """Application builder for ``serve run service.ray_serve:app_builder key=value ...`` and RayService's
    ``import_path``: ``args`` are ``RayServeConfig`` fields (they win over ``DECONV_RAY_*``)."""
    return build_application(RayServeConfig(**args))
