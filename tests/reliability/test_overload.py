"""Overload on a real server: far more concurrent requests than the queue holds; every response is 200 or 429."""

from __future__ import annotations

import asyncio

import pytest

from bench.serving.reliability.under_load import overload

from .conftest import explain

pytestmark = pytest.mark.slow


def test_overload_answers_200_or_429_and_loses_nothing(start_server):
    # Capacity ~100 requests/s (a 20 ms kernel call, at most 2 samples a call), far below what 128 clients offer.
    server = start_server({"DECONV_MAX_QUEUE_SIZE": "16", "DECONV_MAX_BATCH_SIZE": "2", "DECONV_TEST_MODE": "1",
                           "DECONV_FAULTS": "delay:ms=20"})
    result = asyncio.run(overload(server.url, requests=1000, concurrency=128))
    assert result["ok"], explain(result)
    assert result["accepted"] + result["refused_429"] == 1000
    assert result["client_statuses"] == result["server_statuses"]
    assert result["accepted_p99_ms"] is not None
