"""Fixtures shared by the client tests.

Every client test runs twice, through ``Client`` and through ``AsyncClient``: ``Mirror`` gives both the same
blocking interface (the async one runs on an event loop in a background thread, through an anyio portal), so
the sync and async tests are one test body and cannot drift apart.
"""

from __future__ import annotations

import functools
import inspect
import io
from collections.abc import Callable, Iterator
from typing import Any

import anyio.from_thread
import httpx
import numpy as np
import pytest
from deconv_client import AsyncClient, Client


def npy_bytes(array: np.ndarray) -> bytes:
    """An array as .npy bytes written by numpy itself (an independent encoder)."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def npy_response(array: np.ndarray, status: int = 200, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(
        status, content=npy_bytes(array), headers={"content-type": "application/x-npy", **(headers or {})}
    )


def error_response(status: int, kind: str, message: str = "nope", **headers: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"type": kind, "message": message}}, headers=headers)


class Mirror:
    """A ``Client`` as it is, or an ``AsyncClient`` whose coroutine methods are run to completion on a portal."""

    def __init__(self, client: Client | AsyncClient, portal: anyio.from_thread.BlockingPortal | None = None) -> None:
        self.client = client
        self.portal = portal
        self.is_async = isinstance(client, AsyncClient)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.client, name)
        if self.portal is None or not inspect.iscoroutinefunction(attr):
            return attr
        portal = self.portal

        def call(*args: Any, **kwargs: Any) -> Any:
            return portal.call(functools.partial(attr, *args, **kwargs))

        return call

    def close(self) -> None:
        if self.portal is not None:
            self.portal.call(self.client.aclose)  # type: ignore[union-attr]
        else:
            self.client.close()  # type: ignore[union-attr]


@pytest.fixture(scope="session")
def portal() -> Iterator[anyio.from_thread.BlockingPortal]:
    """An asyncio event loop running in a background thread for the whole session."""
    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        yield portal


@pytest.fixture(params=["sync", "async"])
def flavour(request: pytest.FixtureRequest) -> str:
    return request.param


MakeClient = Callable[..., Mirror]


@pytest.fixture
def make_client(flavour: str, portal: anyio.from_thread.BlockingPortal) -> Iterator[MakeClient]:
    """``make_client(handler, **kwargs)``: a Mirror over Client/AsyncClient answering from ``handler``.

    ``handler(request) -> httpx.Response`` is a plain function; for the async flavour it runs on the event loop.
    """
    made: list[Mirror] = []

    def make(handler: Callable[[httpx.Request], Any], base_url: str = "http://deconv.test", **kwargs: Any) -> Mirror:
        transport = httpx.MockTransport(handler)
        if flavour == "sync":
            mirror = Mirror(Client(base_url, transport=transport, **kwargs))
        else:
            mirror = Mirror(AsyncClient(base_url, transport=transport, **kwargs), portal)
        made.append(mirror)
        return mirror

    yield make
    for mirror in made:
        mirror.close()


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Records the waits between retries instead of waiting them out."""
    recorded: list[float] = []

    async def fake_async_sleep(seconds: float) -> None:
        recorded.append(seconds)

    monkeypatch.setattr("deconv_client.client._sleep", recorded.append)
    monkeypatch.setattr("deconv_client.client._async_sleep", fake_async_sleep)
    return recorded
