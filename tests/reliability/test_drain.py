"""SIGTERM while clients keep connecting and sending: every connection the server accepted is answered, later
clients are refused, one and two HTTP processes; and the listener a drain closes, on its own."""

from __future__ import annotations

import asyncio
import errno
import select
import socket
import sys

import pytest

from bench.serving.reliability.attacks import drain_connections
from service.http.listening import take_waiting

from .conftest import explain

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("processes", [1, 2])
def test_every_connection_accepted_during_the_drain_is_answered_and_later_ones_are_refused(start_server,
                                                                                           processes):
    # Before: with two HTTP processes the supervisor kept accepting once both had stopped taking connections and
    # closed each one unanswered (over 4,000 in one run); with one process, connections waiting in the listen
    # backlog were reset when the port closed at exit. A client that had sent its request saw a close or a reset.
    server = start_server({"DECONV_HTTP_PROCESSES": str(processes), "DECONV_LOG_LEVEL": "info"})
    result = asyncio.run(drain_connections(server, clients=16, before=100))
    assert result["ok"], explain(result)


@pytest.mark.skipif(sys.platform != "linux", reason="the listener stops taking connections with a Linux socket filter")
def test_a_client_connecting_after_the_backlog_was_taken_is_refused_not_reset():
    # Before: the port closed right after the last accept found its backlog empty, and a handshake that completed in
    # between was reset after its client had sent a request; a loaded machine, or a worker thread holding the
    # interpreter as accept returns, can keep that interval open for milliseconds (6 of 116 connections reset in one
    # run of the test above). Now the listener takes no new connection before its backlog is taken: such a client is
    # refused once the port closes (it carried no request and may retry elsewhere).
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    address = listener.getsockname()
    waiting = socket.create_connection(address)  # in the backlog when the drain begins
    late = socket.socket()
    taken: list[socket.socket] = []
    try:
        waiting.sendall(b"x")
        assert take_waiting(listener, taken.append) == 1
        late.setblocking(False)
        assert late.connect_ex(address) in (0, errno.EINPROGRESS)  # after the backlog was taken, before the close
        listener.close()
        _, writable, _ = select.select([], [late], [], 60)  # the connect's outcome (60 s: only a bound)
        assert writable, "the connect never ended"
        assert late.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNREFUSED
        taken[0].settimeout(10)
        assert taken[0].recv(1) == b"x"  # the connection that waited is served as usual
    finally:
        for conn in (*taken, waiting, late, listener):
            conn.close()
