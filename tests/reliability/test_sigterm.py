"""SIGTERM under load: every accepted request is answered, later ones are refused, the process exits 0."""

from __future__ import annotations

import asyncio

import pytest

from .conftest import explain

pytestmark = pytest.mark.slow


def test_sigterm_under_load_answers_every_accepted_request_and_exits_0(rel, start_server):
    # Every batch after the probe's three waits for the drain (test-mode fault "hold"), so that the signal always
    # comes while all 200 requests are queued or executing: before, on a fast run they could all be answered first.
    server = start_server({**rel.SIGTERM_ENV, "DECONV_MAX_QUEUE_SIZE": "400"})
    result = asyncio.run(rel.sigterm(server, requests=200, after=20))
    assert result["ok"], explain(result)
    assert result["exit_status"] == 0
    assert result["answered_before_signal"] == 0
    assert "draining: not ready any more" in server.log()


@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_closes_kept_alive_connections_and_answers_a_request_still_arriving(rel, start_server, processes):
    # Before: kept-alive connections were answered without Connection: close after SIGTERM (with several HTTP
    # processes they could be kept, 503 after 503, until the graceful timeout), and a request whose 1 MiB body
    # came during the drain could see its connection reset instead of the 503.
    server = start_server({"DECONV_HTTP_PROCESSES": str(processes), "DECONV_LOG_LEVEL": "info"})
    result = asyncio.run(rel.drain_keepalive(server, idle=8))
    assert result["ok"], explain(result)
