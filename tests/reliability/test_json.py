"""JSON bodies against a live server: numbers of any length, and bodies too large to parse."""

from __future__ import annotations

import asyncio
import sys

import pytest

from bench.serving.reliability.attacks import json_bombs, long_integers
from service.http.bodies import MAX_JSON_INT_DIGITS, LongNumberError, parse_json

from .conftest import explain

API_KEY = "json-test-key"


@pytest.mark.slow
@pytest.mark.parametrize(("processes", "key"), [(1, None), (2, None), (1, API_KEY)], ids=["single", "multi", "api-key"])
def test_long_json_integers_are_a_4xx_and_the_connection_serves_on(start_server, processes, key):
    # Before: an integer of more than 4,300 digits anywhere in a JSON body (even an ignored id, gzip or not, the
    # register bodies) raised Python's int-conversion limit: 500 with a traceback, and with two HTTP processes the
    # connection closed, so the client's next request on it was reset.
    env = {"DECONV_HTTP_PROCESSES": str(processes), **({"DECONV_API_KEY": key} if key else {})}
    server = start_server(env)
    result = asyncio.run(long_integers(server, api_key=key))
    assert result["ok"], explain(result)


@pytest.mark.parametrize("process_limit", [0, 4300, 100_000], ids=["unlimited", "default", "higher"])
def test_json_integers_are_bounded_whatever_the_process_wide_limit(process_limit):
    # The bound is the parser's own: Python's limit is process-wide, and 0 (unlimited) would let a megabyte of
    # digits cost seconds of conversion.
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(process_limit)
    try:
        longest = "7" * MAX_JSON_INT_DIGITS
        assert parse_json(f'{{"a": [{longest}, -{longest}]}}'.encode()) == {"a": [int(longest), -int(longest)]}
        for text in ("8" * (MAX_JSON_INT_DIGITS + 1), "-" + "8" * 5000, "9" * 100_000):
            with pytest.raises(LongNumberError, match="digits"):
                parse_json(f'{{"id": {text}}}'.encode())
        assert parse_json(("[" + "9" * 5000 + ".5e-99999, 1" + "0" * 5000 + ".0]").encode()) == [0.0, float("inf")]
        assert parse_json(memoryview('{"x": 1}'.encode("utf-16"))) == {"x": 1}
    finally:
        sys.set_int_max_str_digits(before)


@pytest.mark.slow
def test_json_bombs_are_413_before_they_are_parsed(start_server):
    # Before: each gzip bomb (tens of kilobytes, ~60 MB of JSON) was parsed (~1 GB of Python objects, seconds with
    # the event loop stalled, /health/live late by up to seconds), one at a time, before its 413.
    server = start_server({})
    result = asyncio.run(json_bombs(server, bombs=4))
    assert result["ok"], explain(result)
    # (the probe's latencies are figures, not checks: this machine's load decides them)


@pytest.mark.parametrize("size", [0, 1000, 256 * 2**10, 256 * 2**10 + 1, 3 * 2**20 + 17, 4 * 2**20])
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_json_bodies_decompress_in_steps_up_to_the_limit(size, encoding):
    import gzip
    import os
    import zlib

    from service.errors import PayloadTooLargeError
    from service.http import bodies

    raw = os.urandom(size // 2) + b"a" * (size - size // 2)
    packed = gzip.compress(raw) if encoding == "gzip" else zlib.compress(raw)
    assert bytes(asyncio.run(bodies.decompress_json(bytearray(packed), encoding))) == raw
    over = gzip.compress(b"a" * (bodies.MAX_JSON_BYTES + 1)) if encoding == "gzip" else zlib.compress(
        b"a" * (bodies.MAX_JSON_BYTES + 1))
    with pytest.raises(PayloadTooLargeError, match="binary"):
        asyncio.run(bodies.decompress_json(bytearray(over), encoding))
