"""The limits on what a client can make the server hold, attacked through raw sockets against a real server
(``python -m service``, uvicorn, on 127.0.0.1): slow and huge request heads, bodies that never arrive, many large
bodies at once against the bytes-in-flight budget, KServe JSON answers too large to encode.

Each test waits for events (an answer, a closed connection, a metric reaching a value); the timeouts passed to the
drivers only bound how long a broken server is waited for.
"""

from __future__ import annotations

import asyncio

import pytest

from bench.serving.reliability.limits import (
    budget_flood,
    budget_for,
    huge_header,
    json_output_flood,
    keepalive_requests,
    slow_heads,
    stalled_bodies,
)

from .conftest import explain

pytestmark = pytest.mark.slow


def test_slow_heads_get_408_and_are_closed(start_server):
    # Before: nothing timed out a request head (200 slowloris connections stayed open for good).
    server = start_server({"DECONV_HEADER_TIMEOUT_S": "1"})
    result = asyncio.run(slow_heads(server, connections=20, header_timeout_s=1.0))
    assert result["ok"], explain(result)


def test_a_huge_header_gets_431(start_server):
    # Before: a 16 MiB header value was accepted.
    server = start_server({})
    result = asyncio.run(huge_header(server, size=4 * 2**20))
    assert result["ok"], explain(result)
    assert "headers_too_large" in result["body"]


def test_bodies_that_never_arrive_pin_no_memory_and_time_out(start_server):
    # Before: each request's buffer was allocated from its Content-Length before a byte arrived (20 x 64 MiB
    # pinned +1.28 GB) and nothing timed the body out.
    server = start_server({"DECONV_BODY_TIMEOUT_S": "2"})
    result = asyncio.run(stalled_bodies(server, connections=20, declared=64 * 2**20, sent=6, body_timeout_s=2.0))
    assert result["ok"], explain(result)


def test_concurrent_large_bodies_are_bounded_by_the_budget(start_server):
    # Two requests of 256 KiB (and their 512 KiB outputs) fill the budget; while they are held, each request of
    # 1 MiB more gets 429 with Retry-After, and afterwards the budget is empty again.
    server = start_server({"DECONV_MAX_INFLIGHT_BYTES": str(budget_for(2))})
    result = asyncio.run(budget_flood(server, admitted=2, refused=6))
    assert result["ok"], explain(result)
    assert result["late_statuses"] == {"429": 6}


def test_kserve_json_answers_beyond_the_limit_get_413_before_any_work(start_server):
    # Before: a tiny gzip request made a 1.19 GB JSON answer (peak RSS 5.4 GB, /health/live 33 s late).
    server = start_server({"DECONV_MAX_JSON_OUTPUT_BYTES": str(2**20)})
    result = asyncio.run(json_output_flood(server, requests=4, shape=(1, 16, 64, 64)))
    assert result["ok"], explain(result)


def test_many_requests_on_one_connection_are_no_large_head(start_server):
    # The head limit counts one request's head, not every request a kept-alive connection carried.
    server = start_server({"DECONV_MAX_HEADER_BYTES": "4096"})
    result = asyncio.run(keepalive_requests(server, requests=200))
    assert result["ok"], explain(result)
