"""SIGTERM under load: every accepted request is answered, later ones are refused, the process exits 0."""

from __future__ import annotations

import asyncio

import pytest

from .conftest import explain

pytestmark = pytest.mark.slow


def test_sigterm_under_load_answers_every_accepted_request_and_exits_0(rel, start_server):
    server = start_server({"DECONV_MAX_QUEUE_SIZE": "400", "DECONV_MAX_BATCH_SIZE": "8", "DECONV_LOG_LEVEL": "info"})
    result = asyncio.run(rel.sigterm(server, requests=200, after=20))
    assert result["ok"], explain(result)
    assert result["exit_status"] == 0
    assert result["answered_before_signal"] < 200  # the signal came while requests were still queued
    assert "draining: not ready any more" in server.log()
