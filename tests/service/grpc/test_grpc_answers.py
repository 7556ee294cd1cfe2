"""``service/grpc/server.py``'s error answers (``_answered``): a ``ServiceError`` becomes its gRPC status, anything
else is logged and answered INTERNAL, and a call that ended before its status could be sent (its deadline passed in
the core at the moment the handler's own timer fired, or its client left) ends as a cancelled call does, with nothing
logged as an error. Driven with a stand-in for grpc.aio's servicer context, so that the order of the two is given,
not raced."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import pytest

from service.errors import DeadlineExceededError, InvalidInputError
from service.grpc.server import _answered


class Context:
    """What ``_answered`` uses of ``grpc.aio.ServicerContext``: ``abort``, which sends the status and raises
    ``AbortError``, or, once the call is over, fails with ``fails`` (what grpc.aio raises when the core refuses the
    status of a call that has ended)."""

    def __init__(self, fails: Exception | None = None) -> None:
        self.fails = fails
        self.aborted: list[tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]] = []

    async def abort(self, code: grpc.StatusCode, details: str, metadata: tuple[tuple[str, str], ...]) -> None:
        self.aborted.append((code, details, metadata))
        if self.fails is not None:
            raise self.fails
        raise grpc.aio.AbortError("Locally aborted.")


def answer(handler: Any, context: Context) -> Any:
    return asyncio.run(_answered(handler)(object(), context))


async def _model_infer(request: object, context: object) -> None:
    raise DeadlineExceededError("the request's deadline passed before execution")


def test_a_service_error_is_answered_with_its_status() -> None:
    async def _bad_input(request: object, context: object) -> None:
        raise InvalidInputError("input 'x': wrong shape")

    context = Context()
    with pytest.raises(grpc.aio.AbortError):
        answer(_bad_input, context)
    assert context.aborted == [(grpc.StatusCode.INVALID_ARGUMENT, "input 'x': wrong shape", ())]
    context = Context()
    with pytest.raises(grpc.aio.AbortError):
        answer(_model_infer, context)
    assert [code for code, _, _ in context.aborted] == [grpc.StatusCode.DEADLINE_EXCEEDED]


def test_an_unexpected_error_is_logged_and_answered_internal(caplog: pytest.LogCaptureFixture) -> None:
    async def _broken(request: object, context: object) -> None:
        raise RuntimeError("a bug")

    context = Context()
    with caplog.at_level(logging.ERROR, logger="deconv.service"), pytest.raises(grpc.aio.AbortError):
        answer(_broken, context)
    assert [code for code, _, _ in context.aborted] == [grpc.StatusCode.INTERNAL]
    assert any("unhandled error in gRPC broken" in r.getMessage() for r in caplog.records)


def test_a_call_that_ended_before_its_status_ends_as_cancelled(caplog: pytest.LogCaptureFixture) -> None:
    context = Context(fails=RuntimeError('Failed "execute_batch"'))
    with caplog.at_level(logging.DEBUG, logger="deconv.service"), pytest.raises(asyncio.CancelledError):
        answer(_model_infer, context)
    assert [code for code, _, _ in context.aborted] == [grpc.StatusCode.DEADLINE_EXCEEDED]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("ended before its status" in r.getMessage() for r in caplog.records)
