"""Clients that hang up at random moments: no worker error, the queue drains, memory returns, later requests work."""

from __future__ import annotations

import asyncio

import pytest

from bench.serving.reliability.under_load import CANCELLATION_ENV, cancellation

from .conftest import explain

pytestmark = pytest.mark.slow


def test_random_hang_ups_leave_the_server_as_it_was(start_server):
    server = start_server(CANCELLATION_ENV)
    result = asyncio.run(cancellation(server.url, server.pid, requests=200, concurrency=16))
    assert result["ok"], explain(result)
    # The moments were spread: some left while sending, some were dropped from the queue, some were answered.
    assert result["hang_up_while_sending_body"] > 0
    assert result["dropped_while_queued"] > 0
    assert "Traceback" not in server.log()
