"""``Client`` and ``AsyncClient``: the same methods, one blocking and one ``async``, as in httpx.

Each wraps one pooled :class:`httpx.Client` / :class:`httpx.AsyncClient`, so use one instance for many calls
(and as a context manager, or call ``close()``/``aclose()``). Both are safe to share: the sync client across
threads, the async one across tasks of one event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from . import _cuda_shm, _shm
from ._tensor import encode_input
from ._version import __version__
from .codec import Payload
from .errors import APIError, CodecError, NotReadyError, TransportError, error_from_response
from .layers import LayerInfo
from .retry import Retry

__all__ = ["DEFAULT_TIMEOUT", "DEFAULT_URL", "AsyncClient", "Client"]

logger = logging.getLogger("deconv_client")

DEFAULT_URL = "http://127.0.0.1:8000"
#: seconds; a large batch on a busy server can take a while, and httpx's own default (5 s) is short for it.
DEFAULT_TIMEOUT = 60.0
# Keep as many idle connections as deconv_many/bench usually run concurrently, so they are reused.
DEFAULT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=64)
DEFAULT_CONCURRENCY = 8
# A response body is read into one buffer of its Content-Length; above this we grow it instead of trusting it.
_PREALLOC_MAX = 1 << 30

TensorT = TypeVar("TensorT")
# Indirections so that tests can watch the waits between retries without waiting them out.
_sleep = time.sleep
_async_sleep = asyncio.sleep
_Timeout = float | httpx.Timeout | None


def _format_ms(ms: float) -> str:
    return f"{ms:.3f}".rstrip("0").rstrip(".")


class _Call:
    """One logical call across its attempts: the ``X-Deadline-Ms`` each attempt sends, and when to retry."""

    def __init__(self, retry: Retry, method: str, path: str, deadline_ms: float | None) -> None:
        if deadline_ms is not None and not deadline_ms > 0:
            raise ValueError(f"deadline_ms must be positive, not {deadline_ms!r}")
        self.retry = retry
        self.what = f"{method} {path}"
        self.deadline_ms = deadline_ms
        self.end = None if deadline_ms is None else time.monotonic() + deadline_ms / 1000
        self.attempt = 0

    def next_attempt_headers(self) -> dict[str, str]:
        self.attempt += 1
        if self.end is None or self.deadline_ms is None:
            return {}
        # Later attempts get what is left of the caller's deadline, not a fresh one.
        remaining = self.deadline_ms if self.attempt == 1 else (self.end - time.monotonic()) * 1000
        return {"X-Deadline-Ms": _format_ms(max(remaining, 0.001))}

    def retry_delay(self, *, error: APIError | None = None, exc: BaseException | None = None) -> float | None:
        if error is not None:
            delay = self.retry.delay(self.attempt, status=error.status_code, retry_after=error.retry_after)
        else:
            delay = self.retry.delay(self.attempt, exc=exc)
        if delay is None:
            return None
        if self.end is not None and time.monotonic() + delay >= self.end:
            return None  # the retry could not start before the caller's deadline
        logger.info(
            "%s failed (%s); retry %d/%d in %.3f s",
            self.what,
            error if error is not None else f"{type(exc).__name__}: {exc}",
            self.attempt,
            self.retry.max_attempts - 1,
            delay,
        )
        return delay


def _transport_error(exc: httpx.RequestError, call: _Call) -> TransportError:
    detail = str(exc) or type(exc).__name__
    try:
        where = f"{exc.request.method} {exc.request.url}"
    except RuntimeError:  # no request attached
        where = call.what
    return TransportError(f"{where} failed after {call.attempt} attempt(s): {detail}", cause=exc)


class _BodyBuffer:
    """Collects a response body into one writable ``bytearray`` (so decoded arrays are writable, no extra copy)."""

    def __init__(self, response: httpx.Response) -> None:
        length = response.headers.get("content-length", "")
        self.expected: int | None = None
        if length.isdigit() and "content-encoding" not in response.headers and int(length) <= _PREALLOC_MAX:
            self.expected = int(length)
        self.buf = bytearray(self.expected or 0)
        self.pos = 0

    def add(self, chunk: bytes) -> None:
        end = self.pos + len(chunk)
        if self.expected is None:
            self.buf += chunk
        elif end <= self.expected:
            self.buf[self.pos : end] = chunk
        else:
            raise TransportError(f"response body is longer than its Content-Length ({self.expected})")
        self.pos = end

    def finish(self) -> bytearray:
        if self.expected is not None and self.pos != self.expected:
            raise TransportError(f"response body ended after {self.pos} of {self.expected} bytes")
        return self.buf


def _json(body: bytes | bytearray, what: str) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CodecError(f"{what}: the server did not answer JSON ({exc})") from None


def _layers_from_json(data: Any) -> list[LayerInfo]:
    if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
        raise CodecError(f'GET /v1/layers: expected {{"layers": [...]}}, got {str(data)[:200]}')
    return [LayerInfo.from_json(item) for item in data["layers"]]


def _layer_path(name: str) -> str:
    return f"/v1/layers/{quote(name, safe='')}"


def _deconv_headers(payload: Payload, accept: str | None) -> dict[str, str]:
    # An explicit Content-Length keeps the body un-chunked although it goes out as several zero-copy views.
    return {
        "Content-Type": payload.media_type,
        "Accept": accept or payload.media_type,
        "Content-Length": str(payload.nbytes),
    }


class _AsyncBody:
    """The body's chunks as an async iterable that can be iterated again (a retry resends it)."""

    def __init__(self, chunks: tuple[bytes | memoryview, ...]) -> None:
        self._chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk  # type: ignore[misc]


class _BaseClient:
    def __init__(
        self,
        *,
        api_key: str | None,
        retry: Retry | bool,
        headers: Mapping[str, str] | None,
        shared_memory: bool = False,
        cuda_shared_memory: bool = False,
    ) -> None:
        if retry is True:
            retry = Retry()
        elif retry is False:
            retry = Retry.disabled()
        elif not isinstance(retry, Retry):
            raise TypeError(f"retry must be a Retry or a bool, not {type(retry).__name__}")
        self._retry = retry
        self._headers = {"User-Agent": f"deconv-client/{__version__}"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._headers.update(headers or {})
        self._regions = _shm.RegionPool() if shared_memory else None
        self._cuda_regions = _cuda_shm.CudaRegions() if cuda_shared_memory else None
        self._layer_infos: dict[str, LayerInfo] = {}  # for the output shapes of shared-memory calls

    @property
    def retry(self) -> Retry:
        """The retry settings used by every call."""
        return self._retry

    @property
    def shared_memory(self) -> bool:
        """Whether tensors travel through system shared memory (``shared_memory=True``)."""
        return self._regions is not None

    @property
    def cuda_shared_memory(self) -> bool:
        """Whether CUDA torch tensors stay on their GPU (``cuda_shared_memory=True``)."""
        return self._cuda_regions is not None

    def _cuda_regions_to_close(self) -> list[_cuda_shm.CudaRegion]:
        return self._cuda_regions.close() if self._cuda_regions is not None else []


class Client(_BaseClient):
    """Blocking client of the deconv service.

    Example::

        import numpy as np
        from deconv_client import Client

        with Client("http://127.0.0.1:8000") as client:
            y = client.deconv("demo", np.random.rand(1, 16, 32, 32).astype(np.float32))

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:8000"`` (a path prefix is kept).
        api_key: sent as ``Authorization: Bearer <api_key>`` when given.
        timeout: seconds (or an :class:`httpx.Timeout`) for connecting, sending and receiving; ``None``: none.
        retry: a :class:`Retry`, ``True`` for the default settings, ``False`` to never retry.
        transport: an :class:`httpx.BaseTransport` to use instead of the network (tests: ``httpx.MockTransport``).
        limits: connection pool limits.
        headers: extra headers sent with every request.
        shared_memory: send tensors through system shared memory (the KServe v2 ``systemsharedmemory`` extension)
            instead of the socket: the server must run on the same host. The client registers its regions on first
            use and unregisters them in :meth:`close`; ``wire_format`` has no effect.
        cuda_shared_memory: pass CUDA torch tensors through CUDA shared memory (the KServe v2 ``cudasharedmemory``
            extension): the server's GPU worker reads the input where it is and writes the output into a tensor
            this client allocates on the same GPU, which :meth:`deconv` returns; no tensor byte crosses the socket
            or the host. The server must run on the same machine with that GPU. The client registers each GPU
            allocation its tensors live in once (a bounded number, least recently used out) and unregisters them
            in :meth:`close`. Other tensors travel as without it.
    """

    def __init__(
        self,
        base_url: str | httpx.URL = DEFAULT_URL,
        *,
        api_key: str | None = None,
        timeout: _Timeout = DEFAULT_TIMEOUT,
        retry: Retry | bool = True,
        transport: httpx.BaseTransport | None = None,
        limits: httpx.Limits = DEFAULT_LIMITS,
        headers: Mapping[str, str] | None = None,
        shared_memory: bool = False,
        cuda_shared_memory: bool = False,
    ) -> None:
        super().__init__(api_key=api_key, retry=retry, headers=headers, shared_memory=shared_memory,
                         cuda_shared_memory=cuda_shared_memory)
        self._http = httpx.Client(
            base_url=base_url, headers=self._headers, timeout=timeout, transport=transport, limits=limits
        )

    @property
    def base_url(self) -> httpx.URL:
        """The server's base URL."""
        return self._http.base_url

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Unregister and remove the shared-memory regions, close the pooled connections. The client cannot be
        used afterwards."""
        try:
            if self._regions is not None:
                for region in self._regions.close():
                    self._retire(region)
            for cuda_region in self._cuda_regions_to_close():
                self._retire_cuda(cuda_region)
        finally:
            self._http.close()

    def deconv(
        self,
        layer: str,
        x: TensorT,
        *,
        deadline_ms: float | None = None,
        wire_format: str | None = None,
    ) -> TensorT:
        """Run ``layer`` on one tensor and return the output as the same kind of tensor.

        Args:
            layer: the layer's name (see :meth:`layers`).
            x: a ``numpy.ndarray`` or ``torch.Tensor``, ``[N, C_in, H, W]`` or ``[C_in, H, W]``, of the layer's
                dtype. A torch tensor may live on any device; bfloat16 needs torch.
            deadline_ms: if the server has not started executing the request this many milliseconds after the
                call began, it fails with :class:`DeadlineExceededError` (sent as ``X-Deadline-Ms``; retries get
                what is left of it).
            wire_format: ``"npy"`` or ``"safetensors"``; by default safetensors for bfloat16 and .npy otherwise.

        Returns:
            ``[N, C_out, H_out, W_out]`` (or ``[C_out, H_out, W_out]``), numpy for numpy and torch for torch, with
            the input's dtype, on the input's device.

        Raises:
            APIError: a subclass per server error type (:class:`UnknownLayerError`, :class:`InvalidInputError`,
                ...), after retries where :class:`Retry` allows them.
            TransportError: the server could not be reached or the connection broke.
            CodecError: the tensor cannot be sent (unsupported dtype), or the response was not a valid tensor.
        """
        if self._cuda_regions is not None and _cuda_shm.is_cuda_tensor(x):
            return self._deconv_cuda(layer, x, deadline_ms)  # type: ignore[no-any-return]
        if self._regions is not None:
            return self._deconv_shm(layer, x, deadline_ms)  # type: ignore[no-any-return]
        encoded = encode_input(x, wire_format)
        body, headers = self._post_deconv(layer, encoded.payload, deadline_ms=deadline_ms)
        return encoded.restore(body, headers.get("content-type"))

    def _layer_info(self, layer: str) -> LayerInfo:
        info = self._layer_infos.get(layer)
        if info is None:
            info = self._layer_infos[layer] = self.layer(layer)
        return info

    def _deconv_cuda(self, layer: str, x: Any, deadline_ms: float | None) -> Any:
        assert self._cuda_regions is not None
        call = _cuda_shm.CudaCall(x, self._layer_info(layer))
        try:
            for old in call.attach(self._cuda_regions):
                self._retire_cuda(old)
            for region in call.unregistered():
                with region.lock:
                    if not region.registered:
                        self._request("POST", _cuda_shm.register_path(region), json_body=region.register_body(),
                                      retry=Retry.disabled())
                        region.registered = True
            _, body = self._request("POST", f"/v2/models/{quote(layer, safe='')}/infer", json_body=call.request(),
                                    deadline_ms=deadline_ms)
            return call.result(_json(body, "CUDA shared-memory inference"))
        finally:
            call.release(self._cuda_regions)

    def _retire_cuda(self, region: _cuda_shm.CudaRegion) -> None:
        """Unregister ``region`` (best effort: the server may be gone)."""
        if region.registered:
            self._unregister(_cuda_shm.unregister_path(region), region.name)

    def _unregister(self, path: str, name: str) -> None:
        """``POST path``, an unregister of region ``name``; a failure is logged (the server may be gone)."""
        try:
            self._request("POST", path, retry=Retry.disabled())
        except (APIError, TransportError) as exc:
            logger.warning("could not unregister shared-memory region %s: %s", name, exc)

    def cuda_shared_memory_status(self) -> list[dict[str, Any]]:
        """The CUDA shared-memory regions registered on the server (``GET /v2/cudasharedmemory/status``): name,
        device_id and byte_size of each, this client's and others'."""
        return self._get_json("/v2/cudasharedmemory/status")  # type: ignore[no-any-return]

    def _deconv_shm(self, layer: str, x: Any, deadline_ms: float | None) -> Any:
        assert self._regions is not None
        t = _shm.prepare(x)
        info = self._layer_info(layer)
        out_shape, size = _shm.output_shape(info, t.shape), _shm.itemsize(t.datatype)
        region, retired = self._regions.acquire(_shm.region_bytes(t, out_shape, size))
        for old in retired:
            self._retire(old)
        try:
            if not region.registered:
                self._request("POST", _shm.register_path(region), json_body=region.register_body(),
                              retry=Retry.disabled())
                region.registered = True
            region.shm.buf[: t.raw.nbytes] = t.raw
            _, body = self._request("POST", f"/v2/models/{quote(layer, safe='')}/infer",
                                    json_body=_shm.infer_request(t, region, out_shape, size), deadline_ms=deadline_ms)
            return _shm.read_output(t, region, _json(body, "shared-memory inference"))
        finally:
            self._regions.release(region)

    def shared_memory_status(self) -> list[dict[str, Any]]:
        """The system shared-memory regions registered on the server (``GET /v2/systemsharedmemory/status``): name,
        key, offset and byte_size of each, this client's and others'."""
        return self._get_json("/v2/systemsharedmemory/status")  # type: ignore[no-any-return]

    def _retire(self, region: _shm.Region) -> None:
        """Unregister ``region`` (best effort: the server may be gone) and remove it."""
        try:
            if region.registered:
                self._unregister(_shm.unregister_path(region), region.name)
        finally:
            region.destroy()

    def deconv_many(
        self,
        layer: str,
        xs: Iterable[TensorT],
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        deadline_ms: float | None = None,
        wire_format: str | None = None,
    ) -> list[TensorT]:
        """Run ``layer`` on many tensors, at most ``concurrency`` requests at a time, results in input order.

        Requests run on a thread pool sharing this client's connection pool (the server batches them). The
        first failure is raised once the requests already running have finished; the rest are not sent.
        Arguments are as for :meth:`deconv`, with ``deadline_ms`` counted per request.
        """
        items = list(xs)
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {concurrency}")
        if len(items) <= 1 or concurrency == 1:
            return [self.deconv(layer, x, deadline_ms=deadline_ms, wire_format=wire_format) for x in items]
        with ThreadPoolExecutor(min(concurrency, len(items)), thread_name_prefix="deconv-client") as pool:
            futures = [
                pool.submit(self.deconv, layer, x, deadline_ms=deadline_ms, wire_format=wire_format) for x in items
            ]
            try:
                return [future.result() for future in futures]
            except BaseException:
                for future in futures:
                    future.cancel()
                raise

    def layers(self) -> list[LayerInfo]:
        """Describe every layer the server runs (``GET /v1/layers``)."""
        return _layers_from_json(self._get_json("/v1/layers"))

    def layer(self, name: str) -> LayerInfo:
        """Describe one layer (``GET /v1/layers/{name}``); raises :class:`UnknownLayerError` if there is none."""
        path = _layer_path(name)
        return LayerInfo.from_json(self._get_json(path))

    def ready(self) -> bool:
        """``True`` once the server is ready to serve, ``False`` while it answers 503 (starting, self-test failed,
        draining). Not retried; raises :class:`TransportError` if the server cannot be reached at all."""
        try:
            self._request("GET", "/health/ready", retry=Retry.disabled())
        except NotReadyError:
            return False
        return True

    def _get_json(self, path: str) -> Any:
        _, body = self._request("GET", path)
        return _json(body, f"GET {path}")

    def _post_deconv(
        self,
        layer: str,
        payload: Payload,
        *,
        accept: str | None = None,
        deadline_ms: float | None = None,
    ) -> tuple[bytearray, httpx.Headers]:
        response, body = self._request(
            "POST",
            "/deconv",
            params={"layer": layer},
            headers=_deconv_headers(payload, accept),
            content=list(payload.chunks),
            deadline_ms=deadline_ms,
        )
        return body, response.headers

    def _request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        content: list[bytes | memoryview] | None = None,
        json_body: Any = None,
        deadline_ms: float | None = None,
        retry: Retry | None = None,
    ) -> tuple[httpx.Response, bytearray]:
        call = _Call(retry or self._retry, method, path, deadline_ms)
        while True:
            request = self._http.build_request(
                method,
                path,
                params=params,
                headers={**(headers or {}), **call.next_attempt_headers()},
                content=content,  # type: ignore[arg-type]  # memoryview chunks are bytes-like
                json=json_body,
            )
            error: APIError | None = None
            try:
                response = self._http.send(request, stream=True)
                try:
                    if response.is_success:
                        buffer = _BodyBuffer(response)
                        for chunk in response.iter_bytes():
                            buffer.add(chunk)
                        return response, buffer.finish()
                    response.read()
                    error = error_from_response(response)
                finally:
                    response.close()
            except httpx.RequestError as exc:
                delay = call.retry_delay(exc=exc)
                if delay is None:
                    raise _transport_error(exc, call) from exc
            else:
                delay = call.retry_delay(error=error)
                if delay is None:
                    raise error  # type: ignore[misc]
            _sleep(delay)


class AsyncClient(_BaseClient):
    """``async`` client of the deconv service, with the same methods and arguments as :class:`Client`.

    Example::

        async with AsyncClient("http://127.0.0.1:8000") as client:
            ys = await client.deconv_many("demo", xs, concurrency=16)

    ``transport`` takes an :class:`httpx.AsyncBaseTransport` (tests: ``httpx.ASGITransport(app)`` or
    ``httpx.MockTransport``). Runs on asyncio.
    """

    def __init__(
        self,
        base_url: str | httpx.URL = DEFAULT_URL,
        *,
        api_key: str | None = None,
        timeout: _Timeout = DEFAULT_TIMEOUT,
        retry: Retry | bool = True,
        transport: httpx.AsyncBaseTransport | None = None,
        limits: httpx.Limits = DEFAULT_LIMITS,
        headers: Mapping[str, str] | None = None,
        shared_memory: bool = False,
        cuda_shared_memory: bool = False,
    ) -> None:
        super().__init__(api_key=api_key, retry=retry, headers=headers, shared_memory=shared_memory,
                         cuda_shared_memory=cuda_shared_memory)
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=self._headers, timeout=timeout, transport=transport, limits=limits
        )

    @property
    def base_url(self) -> httpx.URL:
        """The server's base URL."""
        return self._http.base_url

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Unregister and remove the shared-memory regions, close the pooled connections. The client cannot be
        used afterwards."""
        try:
            if self._regions is not None:
                for region in self._regions.close():
                    await self._retire(region)
            for cuda_region in self._cuda_regions_to_close():
                await self._retire_cuda(cuda_region)
        finally:
            await self._http.aclose()

    async def deconv(
        self,
        layer: str,
        x: TensorT,
        *,
        deadline_ms: float | None = None,
        wire_format: str | None = None,
    ) -> TensorT:
        """Run ``layer`` on one tensor; see :meth:`Client.deconv`."""
        if self._cuda_regions is not None and _cuda_shm.is_cuda_tensor(x):
            return await self._deconv_cuda(layer, x, deadline_ms)  # type: ignore[no-any-return]
        if self._regions is not None:
            return await self._deconv_shm(layer, x, deadline_ms)  # type: ignore[no-any-return]
        encoded = encode_input(x, wire_format)
        body, headers = await self._post_deconv(layer, encoded.payload, deadline_ms=deadline_ms)
        return encoded.restore(body, headers.get("content-type"))

    async def _layer_info(self, layer: str) -> LayerInfo:
        info = self._layer_infos.get(layer)
        if info is None:
            info = self._layer_infos[layer] = await self.layer(layer)
        return info

    async def _deconv_cuda(self, layer: str, x: Any, deadline_ms: float | None) -> Any:
        assert self._cuda_regions is not None
        call = _cuda_shm.CudaCall(x, await self._layer_info(layer))
        try:
            # Waiting for the caller's stream blocks: off the event loop.
            for old in await asyncio.to_thread(call.attach, self._cuda_regions):
                await self._retire_cuda(old)
            for region in call.unregistered():
                if region.alock is None:
                    region.alock = asyncio.Lock()
                async with region.alock:
                    if not region.registered:
                        await self._request("POST", _cuda_shm.register_path(region),
                                            json_body=region.register_body(), retry=Retry.disabled())
                        region.registered = True
            _, body = await self._request("POST", f"/v2/models/{quote(layer, safe='')}/infer",
                                          json_body=call.request(), deadline_ms=deadline_ms)
            return call.result(_json(body, "CUDA shared-memory inference"))
        finally:
            call.release(self._cuda_regions)

    async def _retire_cuda(self, region: _cuda_shm.CudaRegion) -> None:
        """Unregister ``region`` (best effort: the server may be gone)."""
        if region.registered:
            await self._unregister(_cuda_shm.unregister_path(region), region.name)

    async def _unregister(self, path: str, name: str) -> None:
        """``POST path``, an unregister of region ``name``; a failure is logged (the server may be gone)."""
        try:
            await self._request("POST", path, retry=Retry.disabled())
        except (APIError, TransportError) as exc:
            logger.warning("could not unregister shared-memory region %s: %s", name, exc)

    async def cuda_shared_memory_status(self) -> list[dict[str, Any]]:
        """The CUDA shared-memory regions registered on the server; see :meth:`Client.cuda_shared_memory_status`."""
        return await self._get_json("/v2/cudasharedmemory/status")  # type: ignore[no-any-return]

    async def _deconv_shm(self, layer: str, x: Any, deadline_ms: float | None) -> Any:
        assert self._regions is not None
        t = _shm.prepare(x)
        info = await self._layer_info(layer)
        out_shape, size = _shm.output_shape(info, t.shape), _shm.itemsize(t.datatype)
        region, retired = self._regions.acquire(_shm.region_bytes(t, out_shape, size))
        for old in retired:
            await self._retire(old)
        try:
            if not region.registered:
                await self._request("POST", _shm.register_path(region), json_body=region.register_body(),
                                    retry=Retry.disabled())
                region.registered = True
            region.shm.buf[: t.raw.nbytes] = t.raw
            _, body = await self._request("POST", f"/v2/models/{quote(layer, safe='')}/infer",
                                          json_body=_shm.infer_request(t, region, out_shape, size),
                                          deadline_ms=deadline_ms)
            return _shm.read_output(t, region, _json(body, "shared-memory inference"))
        finally:
            self._regions.release(region)

    async def shared_memory_status(self) -> list[dict[str, Any]]:
        """The system shared-memory regions registered on the server; see :meth:`Client.shared_memory_status`."""
        return await self._get_json("/v2/systemsharedmemory/status")  # type: ignore[no-any-return]

    async def _retire(self, region: _shm.Region) -> None:
        """Unregister ``region`` (best effort: the server may be gone) and remove it."""
        try:
            if region.registered:
                await self._unregister(_shm.unregister_path(region), region.name)
        finally:
            region.destroy()

    async def deconv_many(
        self,
        layer: str,
        xs: Iterable[TensorT],
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        deadline_ms: float | None = None,
        wire_format: str | None = None,
    ) -> list[TensorT]:
        """Run ``layer`` on many tensors, at most ``concurrency`` requests at a time, results in input order.

        A semaphore bounds the requests in flight. On the first failure the other requests are cancelled and
        the failure is raised. Arguments are as for :meth:`Client.deconv`.
        """
        items = list(xs)
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {concurrency}")
        semaphore = asyncio.Semaphore(concurrency)

        async def one(x: TensorT) -> TensorT:
            async with semaphore:
                return await self.deconv(layer, x, deadline_ms=deadline_ms, wire_format=wire_format)

        tasks = [asyncio.ensure_future(one(x)) for x in items]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def layers(self) -> list[LayerInfo]:
        """Describe every layer the server runs (``GET /v1/layers``)."""
        return _layers_from_json(await self._get_json("/v1/layers"))

    async def layer(self, name: str) -> LayerInfo:
        """Describe one layer (``GET /v1/layers/{name}``); raises :class:`UnknownLayerError` if there is none."""
        return LayerInfo.from_json(await self._get_json(_layer_path(name)))

    async def ready(self) -> bool:
        """``True`` once the server is ready, ``False`` while it answers 503; see :meth:`Client.ready`."""
        try:
            await self._request("GET", "/health/ready", retry=Retry.disabled())
        except NotReadyError:
            return False
        return True

    async def _get_json(self, path: str) -> Any:
        _, body = await self._request("GET", path)
        return _json(body, f"GET {path}")

    async def _post_deconv(
        self,
        layer: str,
        payload: Payload,
        *,
        accept: str | None = None,
        deadline_ms: float | None = None,
    ) -> tuple[bytearray, httpx.Headers]:
        response, body = await self._request(
            "POST",
            "/deconv",
            params={"layer": layer},
            headers=_deconv_headers(payload, accept),
            content=_AsyncBody(payload.chunks),
            deadline_ms=deadline_ms,
        )
        return body, response.headers

    async def _request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        content: _AsyncBody | None = None,
        json_body: Any = None,
        deadline_ms: float | None = None,
        retry: Retry | None = None,
    ) -> tuple[httpx.Response, bytearray]:
        call = _Call(retry or self._retry, method, path, deadline_ms)
        while True:
            request = self._http.build_request(
                method,
                path,
                params=params,
                headers={**(headers or {}), **call.next_attempt_headers()},
                content=content,
                json=json_body,
            )
            error: APIError | None = None
            try:
                response = await self._http.send(request, stream=True)
                try:
                    if response.is_success:
                        buffer = _BodyBuffer(response)
                        async for chunk in response.aiter_bytes():
                            buffer.add(chunk)
                        return response, buffer.finish()
                    await response.aread()
                    error = error_from_response(response)
                finally:
                    await response.aclose()
            except httpx.RequestError as exc:
                delay = call.retry_delay(exc=exc)
                if delay is None:
                    raise _transport_error(exc, call) from exc
            else:
                delay = call.retry_delay(error=error)
                if delay is None:
                    raise error  # type: ignore[misc]
            await _async_sleep(delay)
