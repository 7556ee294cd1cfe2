"""SIGTERM under load: every accepted request is answered, later ones are refused, the process exits 0."""

from __future__ import annotations

import asyncio
import signal

import pytest

from bench.serving.reliability.limits import drain_keepalive
from bench.serving.reliability.under_load import SIGTERM_ENV, sigterm

from .conftest import explain

pytestmark = pytest.mark.slow


def test_sigterm_under_load_answers_every_accepted_request_and_exits_0(start_server):
    # Every batch after the probe's three waits for the drain (test-mode fault "hold"), so that the signal always
    # comes while all 200 requests are queued or executing: before, on a fast run they could all be answered first.
    server = start_server({**SIGTERM_ENV, "DECONV_MAX_QUEUE_SIZE": "400"})
    result = asyncio.run(sigterm(server, requests=200, after=20))
    assert result["ok"], explain(result)
    assert result["exit_status"] == 0
    assert result["answered_before_signal"] == 0
    assert "draining: not ready any more" in server.log()


@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_closes_kept_alive_connections_and_answers_a_request_still_arriving(start_server, processes):
    # Before: kept-alive connections were answered without Connection: close after SIGTERM (with several HTTP
    # processes they could be kept, 503 after 503, until the graceful timeout), and a request whose 1 MiB body
    # came during the drain could see its connection reset instead of the 503.
    server = start_server({"DECONV_HTTP_PROCESSES": str(processes), "DECONV_LOG_LEVEL": "info"})
    result = asyncio.run(drain_keepalive(server, idle=8))
    assert result["ok"], explain(result)


def test_sigterm_while_http_processes_start_stops_every_process_at_once(start_server):
    # A SIGTERM that came while an HTTP process created its metrics (prometheus-client's lock held, one lock for every
    # metric in multiprocess mode) hung that process: the signal handler set the readiness gauge, waited for the lock
    # its own thread held, and the supervisor killed the process after request timeout + 15 s (exit status 1). The
    # test-mode fault "startup" holds each HTTP process inside that lock, after it connected to the engine, until
    # the signal has reached it, so the signal always lands there.
    server = start_server({"DECONV_HTTP_PROCESSES": "2", "DECONV_TEST_MODE": "1", "DECONV_FAULTS": "startup",
                           "DECONV_REQUEST_TIMEOUT_S": "5", "DECONV_LOG_LEVEL": "info"}, ready=False)
    server.wait_log("start-up held until SIGTERM", count=2)
    server.proc.send_signal(signal.SIGTERM)
    # The supervisor kills a child still running 20 s (request timeout + 15) after the signal: this bound is only
    # how long a hung server is waited for, the outcome is the exit status.
    code = server.proc.wait(120)
    log = server.log()
    assert code == 0, log[-3000:]
    assert log.count("fault released: start-up goes on after SIGTERM") == 2, log[-3000:]
    assert "did not stop within" not in log
