"""Closing the listening port without resetting a connection it took: ``take_waiting`` (the standard library only,
so that the supervisor imports it without the HTTP app).

Closing a listening TCP socket resets every connection waiting in its backlog, and a client whose connect succeeded
may have sent its request already; so the connections waiting are accepted first. Accepting until the backlog is
empty and then closing is not enough: the kernel completes handshakes whatever the process does, and one that
completes between the last ``accept`` (which found the backlog empty) and the close is reset. That interval is short
in the code but not in time: ``accept`` lets go of the interpreter, and a busy worker thread or a loaded machine
can hold the process off for milliseconds while clients connect. So first the listener stops taking new connections
(``stop_admitting``): the kernel drops their opening SYN, the backlog can only shrink, and once the port is closed
each such client is refused when it sends its SYN again (a refused connection carried no request: the client may
retry elsewhere). What TCP leaves no way to wait for: a handshake answered just before and whose last segment is
still on its way when the port closes (within one round trip, on loopback within the kernel's own processing of it)
is reset.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import sys
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("deconv.service")

SO_ATTACH_FILTER = 26  # Linux (asm-generic); the socket module does not name it


class Listener(Protocol):
    """A listening socket: a ``socket.socket``, or asyncio's view of one (``asyncio.Server.sockets``)."""

    family: int

    def fileno(self) -> int: ...

    def setsockopt(self, level: int, optname: int, value: bytes, /) -> None: ...


class _SockFilter(ctypes.Structure):  # struct sock_filter: one classic BPF instruction
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


# A socket filter on a TCP socket sees each segment from its TCP header on. Drop a segment whose flags have SYN set
# and ACK clear (a client opening a connection); keep everything else, so that a handshake already answered with
# SYN-ACK completes and its connection joins the backlog. (A connection accepted from then on carries the filter too;
# an open connection is sent no such segment.)
_DROP_SYN = (
    (0x30, 0, 0, 13),  # ldb [13]: the flags byte
    (0x54, 0, 0, 0x12),  # and #(SYN | ACK)
    (0x15, 0, 1, 0x02),  # jeq #SYN: drop, else keep
    (0x06, 0, 0, 0),  # drop
    (0x06, 0, 0, 0xFFFFFFFF),  # keep the whole segment
)


def stop_admitting(listener: Listener) -> bool:
    """From now on the kernel opens no new connection on ``listener`` (a TCP socket, Linux): a client's SYN is
    dropped, so its connect waits and is refused once the port is closed. Whether that took effect."""
    if sys.platform != "linux" or listener.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    program = (_SockFilter * len(_DROP_SYN))(*(_SockFilter(*instruction) for instruction in _DROP_SYN))
    fprog = _SockFprog(len(_DROP_SYN), ctypes.cast(program, ctypes.POINTER(_SockFilter)))
    try:
        listener.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(fprog))  # the kernel copies the program
    except OSError as exc:
        log.warning("could not stop new connections before closing the port (%s): a client connecting as it closes "
                    "may be reset", exc)
        return False
    return True


def take_waiting(listener: Listener, take: Callable[[socket.socket], object]) -> int:
    """Stop admitting new connections on ``listener`` (``stop_admitting``), then accept every connection waiting in
    its backlog and pass each to ``take``; how many. The caller closes ``listener`` next: nothing waits in its
    backlog then, and a client connecting meanwhile is refused rather than reset."""
    stop_admitting(listener)
    taken = 0
    backlog = socket.socket(fileno=os.dup(listener.fileno()))  # (asyncio's view of a listener does not accept)
    try:
        backlog.setblocking(False)
        while True:
            try:
                conn, _ = backlog.accept()
            except OSError:  # nothing more waiting (or the listener failed): stop
                break
            taken += 1
            take(conn)
    finally:
        backlog.close()
    return taken
