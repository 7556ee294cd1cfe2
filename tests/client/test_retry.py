"""Retries: which failures, how long between attempts (full jitter, Retry-After), deadlines, and turning them off."""

from __future__ import annotations

import random

import httpx
import numpy as np
import pytest
from deconv_client import (
    DeadlineExceededError,
    InvalidInputError,
    MalformedBodyError,
    NotReadyError,
    OverloadedError,
    Retry,
    ServerError,
    TransportError,
    UnauthorizedError,
    UnknownLayerError,
)

from .conftest import MakeClient, error_response, npy_response

X = np.arange(2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4)


class _Top:
    """A random source whose uniform() always returns the upper bound."""

    def uniform(self, a: float, b: float) -> float:
        return b


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Retry(max_attempts=0)
    with pytest.raises(ValueError, match="must not be negative"):
        Retry(backoff_base=-1)
    for status in (400, 404, 408, 422):
        with pytest.raises(ValueError, match="only 429 and 5xx"):
            Retry(statuses=frozenset({429, status}))
    assert Retry(statuses={429, 502}).statuses == frozenset({429, 502})  # type: ignore[arg-type]
    assert Retry.disabled().max_attempts == 1


def test_backoff_caps_double_up_to_the_max() -> None:
    retry = Retry(backoff_base=0.1, backoff_max=1.0)
    caps = [retry.backoff(n, _Top()) for n in range(1, 7)]  # type: ignore[arg-type]
    assert caps == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def test_backoff_is_full_jitter() -> None:
    retry = Retry(backoff_base=1.0, backoff_max=8.0)
    rng = random.Random(1234)
    waits = [retry.backoff(4, rng) for _ in range(2000)]
    assert min(waits) >= 0.0
    assert max(waits) <= 8.0
    assert min(waits) < 0.5  # spread over the whole [0, cap] interval, not around the cap
    assert max(waits) > 7.5
    assert 3.5 < sum(waits) / len(waits) < 4.5


def test_which_failures_are_retried() -> None:
    retry = Retry(max_attempts=3)
    assert retry.delay(1, status=429) is not None
    assert retry.delay(1, status=503) is not None
    for status in (400, 401, 404, 413, 415, 422, 500, 504):
        assert retry.delay(1, status=status) is None, status
    request = httpx.Request("GET", "http://x")
    for exc in (httpx.ConnectError("refused"), httpx.ConnectTimeout("t"), httpx.RemoteProtocolError("closed")):
        assert retry.delay(1, exc=exc) is not None, exc
    for exc in (httpx.ReadTimeout("slow", request=request), httpx.PoolTimeout("pool"), ValueError()):
        assert retry.delay(1, exc=exc) is None, exc
    assert Retry(connection_errors=False).delay(1, exc=httpx.ConnectError("refused")) is None
    assert retry.delay(2, status=429) is not None
    assert retry.delay(3, status=429) is None  # the 3rd attempt was the last


def test_retry_after_is_waited_plus_jitter() -> None:
    retry = Retry(backoff_base=0.5, max_retry_after=10)
    assert retry.delay(1, status=429, retry_after=2.0, rng=_Top()) == pytest.approx(2.5)  # type: ignore[arg-type]
    assert 2.0 <= retry.delay(1, status=429, retry_after=2.0) <= 2.5  # type: ignore[operator]
    assert retry.delay(1, status=503, retry_after=11.0) is None  # longer than we are willing to wait
    ignoring = Retry(backoff_base=0.5, respect_retry_after=False)
    assert ignoring.delay(1, status=429, retry_after=30.0, rng=_Top()) == pytest.approx(0.5)  # type: ignore[arg-type]


class Script:
    """A MockTransport handler that answers from a list, then 200 with an npy body; records every request."""

    def __init__(self, *answers: httpx.Response | Exception) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []
        self.bodies: list[bytes] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.bodies.append(request.read())
        if self.answers:
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer
        if request.url.path.endswith("/deconv"):
            return npy_response(X * 2)
        return httpx.Response(200, json={"layers": []})


def test_429_then_200_succeeds_after_retry_after(make_client: MakeClient, sleeps: list[float]) -> None:
    script = Script(error_response(429, "overloaded", "queue full", **{"Retry-After": "1"}))
    client = make_client(script, retry=Retry(backoff_base=0.05))
    y = client.deconv("up1", X)
    np.testing.assert_array_equal(y, X * 2)
    assert len(script.requests) == 2
    assert script.bodies[0] == script.bodies[1]  # the zero-copy body is sent again, whole
    assert len(script.bodies[0]) > X.nbytes
    assert len(sleeps) == 1
    assert 1.0 <= sleeps[0] <= 1.05


def test_503_is_retried_until_the_attempts_run_out(make_client: MakeClient, sleeps: list[float]) -> None:
    script = Script(*[error_response(503, "not_ready", "starting") for _ in range(5)])
    client = make_client(script, retry=Retry(max_attempts=3, backoff_base=0.1, backoff_max=0.15))
    with pytest.raises(NotReadyError, match="starting"):
        client.deconv("up1", X)
    assert len(script.requests) == 3
    assert len(sleeps) == 2
    assert sleeps[0] <= 0.1
    assert sleeps[1] <= 0.15


def test_retries_can_be_turned_off(make_client: MakeClient, sleeps: list[float]) -> None:
    for retry in (False, Retry.disabled(), Retry(max_attempts=1)):
        script = Script(error_response(429, "overloaded", **{"Retry-After": "0"}))
        client = make_client(script, retry=retry)
        with pytest.raises(OverloadedError) as info:
            client.deconv("up1", X)
        assert info.value.retry_after == 0.0
        assert len(script.requests) == 1
    assert sleeps == []


@pytest.mark.parametrize(
    ("status", "kind", "cls"),
    [
        (404, "unknown_layer", UnknownLayerError),
        (422, "invalid_input", InvalidInputError),
        (400, "malformed_body", MalformedBodyError),
        (401, "unauthorized", UnauthorizedError),
        (500, "internal", ServerError),
        (504, "deadline_exceeded", DeadlineExceededError),
    ],
)
def test_other_errors_are_never_retried(
    make_client: MakeClient, sleeps: list[float], status: int, kind: str, cls: type[Exception]
) -> None:
    script = Script(error_response(status, kind), error_response(status, kind))
    client = make_client(script, retry=Retry(max_attempts=5))
    with pytest.raises(cls):
        client.deconv("up1", X)
    assert len(script.requests) == 1
    assert sleeps == []


def test_connection_errors_are_retried_then_raised(make_client: MakeClient, sleeps: list[float]) -> None:
    script = Script(*[httpx.ConnectError("connection refused") for _ in range(4)])
    client = make_client(script, retry=Retry(max_attempts=4))
    with pytest.raises(TransportError, match="connection refused") as info:
        client.layers()
    assert isinstance(info.value.__cause__, httpx.ConnectError)
    assert info.value.cause is info.value.__cause__
    assert len(script.requests) == 4
    assert len(sleeps) == 3

    script = Script(httpx.ConnectError("refused"), httpx.RemoteProtocolError("server closed the connection"))
    client = make_client(script)
    np.testing.assert_array_equal(client.deconv("up1", X), X * 2)
    assert len(script.requests) == 3


def test_read_timeouts_are_not_retried(make_client: MakeClient, sleeps: list[float]) -> None:
    script = Script(httpx.ReadTimeout("timed out"))
    client = make_client(script)
    with pytest.raises(TransportError, match="timed out"):
        client.deconv("up1", X)
    assert len(script.requests) == 1


def test_retries_send_what_is_left_of_the_deadline(make_client: MakeClient, sleeps: list[float]) -> None:
    script = Script(error_response(429, "overloaded"), error_response(429, "overloaded"))
    client = make_client(script)
    client.deconv("up1", X, deadline_ms=60_000)
    sent = [float(r.headers["x-deadline-ms"]) for r in script.requests]
    assert len(sent) == 3
    assert sent[0] == 60_000
    assert 59_000 < sent[2] <= sent[1] < 60_000


def test_no_retry_waits_past_the_deadline(make_client: MakeClient, sleeps: list[float]) -> None:
    script = Script(error_response(429, "overloaded", **{"Retry-After": "5"}))
    client = make_client(script)
    with pytest.raises(OverloadedError):
        client.deconv("up1", X, deadline_ms=1000)  # the retry could only start after the deadline
    assert len(script.requests) == 1
    assert sleeps == []


def test_ready_is_never_retried(make_client: MakeClient, sleeps: list[float]) -> None:
    script = Script(error_response(503, "not_ready"))
    client = make_client(script)
    assert client.ready() is False
    assert client.ready() is True
    assert len(script.requests) == 2
