"""Error mapping: the server's JSON error types (and bare statuses) to the client's exception tree."""

from __future__ import annotations

import email.utils
import time

import deconv_client
import httpx
import numpy as np
import pytest
from deconv_client import errors
from deconv_client.errors import (
    APIError,
    BadRequestError,
    DeadlineExceededError,
    DeconvError,
    InvalidInputError,
    MalformedBodyError,
    NotReadyError,
    OverloadedError,
    PayloadTooLargeError,
    ServerError,
    UnauthorizedError,
    UnknownLayerError,
    UnsupportedMediaTypeError,
    error_from_response,
    parse_retry_after,
)

from .conftest import MakeClient, error_response

# The protocol's error table (docs/protocol.md): status, type, class.
PROTOCOL = [
    (400, "malformed_body", MalformedBodyError),
    (401, "unauthorized", UnauthorizedError),
    (404, "unknown_layer", UnknownLayerError),
    (413, "payload_too_large", PayloadTooLargeError),
    (415, "unsupported_media_type", UnsupportedMediaTypeError),
    (422, "invalid_input", InvalidInputError),
    (429, "overloaded", OverloadedError),
    (503, "not_ready", NotReadyError),
    (504, "deadline_exceeded", DeadlineExceededError),
    (500, "internal", ServerError),
]


@pytest.mark.parametrize(("status", "kind", "cls"), PROTOCOL)
def test_each_protocol_error_maps_to_its_class(status: int, kind: str, cls: type[APIError]) -> None:
    response = error_response(status, kind, f"the {kind} message", **{"Retry-After": "2"})
    error = error_from_response(response)
    assert type(error) is cls
    assert error.message == f"the {kind} message"
    assert error.status_code == status
    assert error.type == kind
    assert error.retry_after == 2.0
    assert error.response is response
    assert str(error) == f"the {kind} message ({status}, {kind})"
    assert isinstance(error, DeconvError)


def test_the_type_wins_over_the_status() -> None:
    error = error_from_response(error_response(400, "invalid_input"))
    assert type(error) is InvalidInputError
    assert error.status_code == 400


def test_bad_requests_share_a_parent() -> None:
    assert issubclass(MalformedBodyError, BadRequestError)
    assert issubclass(UnsupportedMediaTypeError, BadRequestError)
    assert issubclass(errors.CodecError, ValueError)
    assert issubclass(errors.TransportError, DeconvError)


@pytest.mark.parametrize(
    ("status", "body", "cls"),
    [
        (502, b"<html>Bad Gateway</html>", ServerError),
        (500, b"", ServerError),
        (503, b"upstream not ready", NotReadyError),
        (429, b"slow down", OverloadedError),
        (404, b'{"detail": "Not Found"}', APIError),  # a wrong URL is not an unknown layer
        (405, b'{"detail": "Method Not Allowed"}', APIError),
        (422, b'{"detail": [{"loc": ["query", "layer"], "msg": "Field required"}]}', InvalidInputError),
        (418, b'{"error": {"type": "teapot", "message": "short and stout"}}', APIError),
    ],
)
def test_bodies_without_a_known_type_fall_back_on_the_status(status: int, body: bytes, cls: type[APIError]) -> None:
    error = error_from_response(httpx.Response(status, content=body))
    assert type(error) is cls
    assert error.status_code == status
    assert error.message  # never empty
    if body.startswith(b"<html>"):
        assert "Bad Gateway" in error.message
    if b"teapot" in body:
        assert error.type == "teapot"
        assert error.message == "short and stout"


def test_long_bodies_are_cut() -> None:
    error = error_from_response(httpx.Response(502, content=b"x" * 10_000))
    assert len(error.message) <= 500


def test_retry_after_parsing() -> None:
    assert parse_retry_after(None) is None
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 1.5 ") == 1.5
    assert parse_retry_after("-4") == 0.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after("nan") is None
    date = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 <= parse_retry_after(date) <= 31  # type: ignore[operator]


def test_the_module_docstring_documents_every_exception() -> None:
    doc = errors.__doc__ or ""
    classes = [
        name
        for name in errors.__all__
        if isinstance(getattr(errors, name), type) and issubclass(getattr(errors, name), Exception)
    ]
    assert len(classes) == 15
    for name in classes:
        assert name in doc, name
        assert getattr(deconv_client, name) is getattr(errors, name)
    for _, kind, _ in PROTOCOL:
        assert kind in doc, kind


@pytest.mark.parametrize(("status", "kind", "cls"), PROTOCOL)
def test_clients_raise_the_mapped_error(
    make_client: MakeClient, status: int, kind: str, cls: type[APIError], sleeps: list[float]
) -> None:
    client = make_client(lambda request: error_response(status, kind, "from the server"), retry=False)
    with pytest.raises(cls) as info:
        client.deconv("up1", np.zeros((1, 2, 3, 3), np.float32))
    assert info.value.status_code == status
    assert info.value.type == kind
    assert info.value.message == "from the server"
    with pytest.raises(cls):
        client.layers()
