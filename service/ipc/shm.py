"""Shared memory between an HTTP process and the engine (``DECONV_HTTP_PROCESSES`` > 1): tensors without sockets;
and the clients' POSIX shared-memory objects (KServe system shared memory), opened and mapped by key
(``open_object``, ``map_object``).

Each HTTP process owns one arena, an anonymous memory file (``memfd_create``) of ``DECONV_IPC_SHM_BYTES`` bytes,
and passes its file descriptor to the engine over the engine socket when it connects (``SCM_RIGHTS``, in the
``HELLO`` message). Both map it. For a request, the HTTP process takes one slot (``Arena.alloc``) for the input
followed by room for the output, copies the input there and sends a ``SUBMIT`` frame that names the slot instead
of carrying the bytes (``service.ipc.frames``); the engine's worker reads the input from the slot and writes the output
into it, and the ``RESULT`` frame says so. The tensor bytes then cross no socket: the engine's event loop, the one
serial stage of the server, neither reads nor writes them.

Slot lifetime, decided by the HTTP process alone: a slot is taken before ``SUBMIT`` and given back when the
engine's last word on that request arrives (``ERROR`` or ``DONE``), never earlier, so that the engine never writes
into memory that serves another request. A request the HTTP process gives up on keeps its slot until then. After a
``RESULT`` (the engine's last word too) the output stays where the engine wrote it: the request's answer is a view
of the slot (``Arena.lend``), written from there to the client's socket or shared-memory region without a copy,
and the slot is given back once the last view of it is gone (the response written, the request's objects
dropped), never while anything can still read it. If the engine connection is lost, the arena is dropped with it.
A request that does not fit (the arena is full, slots lent to answers still being written included, or the request
is larger than the arena) travels inline in its frames, as without an arena.

The pages are the kernel's anonymous shared memory: they are not in ``/dev/shm`` (whose size containers limit) and
only the pages touched count; ``Arena.alloc`` takes the lowest free slot, so under a steady load the same few
pages are reused.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import functools
import mmap
import os
import re
import socket
import stat
import struct
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np

from service.errors import RegionError

# Slots start on cache-line boundaries.
ALIGN = 64

# The first message on an engine connection: magic, version, arena bytes (0: no arena, no file descriptor).
_HELLO = struct.Struct("<4sHQ")
_MAGIC = b"DCNV"
_VERSION = 1
HELLO_BYTES = _HELLO.size


class HandshakeError(ConnectionError):
    """The first message on an engine connection was not a valid ``HELLO``."""


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to ``ALIGN``."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """An HTTP process's shared memory and its slots: the lowest free range that fits (first fit), and ranges
    merged with their free neighbours when given back. Event-loop only (not thread-safe)."""

    def __init__(self, size: int) -> None:
        """Create a memory file of ``size`` bytes (a multiple of ``ALIGN``) and map it.

        Raises:
            OSError: the system refused the memory file or the mapping.
            ValueError: ``size`` is not a positive multiple of ``ALIGN``.
        """
        if size <= 0 or size % ALIGN:
            raise ValueError(f"an arena's size must be a positive multiple of {ALIGN}, got {size}")
        self.size = size
        self.fd = os.memfd_create("deconv-ipc", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size)
        except OSError:
            os.close(self.fd)
            raise
        self.view = memoryview(self._map)  # format "B"
        self._address = address_of(self.view)
        self._free: list[tuple[int, int]] = [(0, size)]  # disjoint [start, end) ranges, sorted, never adjacent
        self._used: dict[int, int] = {}  # start -> end of each slot handed out
        self._lent = 0  # slots lent (``lend``) and not given back yet

    @property
    def used_bytes(self) -> int:
        """Bytes in slots handed out and not given back."""
        return sum(end - start for start, end in self._used.items())

    @property
    def slots(self) -> int:
        """Slots handed out and not given back."""
        return len(self._used)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free slot of at least ``nbytes`` bytes, or None when no free range is that large."""
        need = aligned(max(nbytes, 1))
        for i, (start, end) in enumerate(self._free):
            if end - start >= need:
                if end - start == need:
                    del self._free[i]
                else:
                    self._free[i] = (start + need, end)
                self._used[start] = start + need
                return start
        return None

    def free(self, start: int) -> None:
        """Give back the slot at ``start`` (from ``alloc``).

        Raises:
            KeyError: no slot starts there (given back twice, or never handed out).
        """
        end = self._used.pop(start)
        free = self._free
        i = bisect.bisect_left(free, (start, end))
        if i < len(free) and free[i][0] == end:  # merge with the range after
            end = free.pop(i)[1]
        if i > 0 and free[i - 1][1] == start:  # and with the range before
            start = free[i - 1][0]
            free[i - 1] = (start, end)
        else:
            free.insert(i, (start, end))

    def offset_of(self, view: memoryview) -> int | None:
        """Where the bytes of ``view`` (C-contiguous) lie in memory lent from the arena (``lend``), or None when
        they are not all inside the arena; None at once while nothing is lent (no address taken: the common case of
        requests whose bodies are not lent costs nothing here)."""
        if not self._lent:
            return None
        offset = address_of(view) - self._address
        return offset if offset >= 0 and offset + view.nbytes <= self.size else None

    def lend(self, start: int, offset: int, nbytes: int) -> memoryview:
        """A writable view of the ``nbytes`` bytes at ``offset``, inside the slot at ``start`` (from ``alloc``),
        that holds the slot: it is given back (``free``) once that view and every view, array or tensor made from
        it are gone (``lend`` below), and never before. The slot must not be given back otherwise."""
        self._lent += 1
        return lend(self.view[offset:offset + nbytes], functools.partial(self._give_back, start))

    def _give_back(self, start: int) -> None:
        self._lent -= 1
        self.free(start)

    def close(self) -> None:
        """Close the file descriptor (the engine holds its own copy); the mapping stays while views of it live."""
        with contextlib.suppress(OSError):
            os.close(self.fd)


def address_of(view: memoryview) -> int:
    """The address of the first byte of ``view``."""
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])


def lend(view: memoryview, release: Callable[[], None]) -> memoryview:
    """A writable view of ``view``'s bytes that calls ``release`` once it and every view, array or tensor made from
    it are gone, on the thread of the event loop running now, and never before: memory lent to a request and taken
    back when the request's last object is.

    The view's exporter is a numpy array over the bytes: slices of the view, ``torch.frombuffer`` and numpy arrays
    of it keep that array alive, and its end calls ``release``.
    """
    owner = np.frombuffer(view, dtype=np.uint8)
    done = weakref.finalize(owner, _give_back, release, asyncio.get_running_loop(), threading.get_ident())
    done.atexit = False
    return memoryview(owner)


def _give_back(release: Callable[[], None], loop: asyncio.AbstractEventLoop, thread: int) -> None:
    """Call a lent view's ``release`` (``lend``) on the thread of its event loop."""
    if threading.get_ident() == thread:
        release()
    else:  # the last view went in another thread (a garbage collection there): the loop releases it
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending, nobody allocates
            loop.call_soon_threadsafe(release)


def send_hello(sock: socket.socket, arena: Arena | None) -> None:
    """Send the ``HELLO`` on a freshly connected (blocking) engine socket, with the arena's file descriptor."""
    msg = _HELLO.pack(_MAGIC, _VERSION, 0 if arena is None else arena.size)
    if arena is None:
        sock.sendall(msg)
    else:
        socket.send_fds(sock, [msg], [arena.fd])


def recv_hello(sock: socket.socket) -> memoryview | None:
    """Read the ``HELLO`` of an accepted engine connection (readable, so the call does not block) and map the
    arena it passes: a writable view of it, or None when the HTTP process has none.

    Raises:
        HandshakeError: not a ``HELLO``, a version this engine does not speak, or a missing file descriptor.
        OSError: the mapping failed.
    """
    msg, fds, _, _ = socket.recv_fds(sock, HELLO_BYTES, 1)
    try:
        if len(msg) != HELLO_BYTES:
            raise HandshakeError(f"a HELLO is {HELLO_BYTES} bytes, got {len(msg)}")
        magic, version, size = _HELLO.unpack(msg)
        if magic != _MAGIC or version != _VERSION:
            raise HandshakeError(f"not a deconv HELLO (magic {magic!r}, version {version})")
        if size == 0:
            if fds:
                raise HandshakeError("a HELLO without an arena passed a file descriptor")
            return None
        if len(fds) != 1:
            raise HandshakeError(f"a HELLO of a {size}-byte arena passed {len(fds)} file descriptors")
        if os.fstat(fds[0]).st_size < size:
            raise HandshakeError(f"the arena's file holds {os.fstat(fds[0]).st_size} bytes, the HELLO says {size}")
        return memoryview(mmap.mmap(fds[0], size))
    finally:
        for fd in fds:
            os.close(fd)


# --- the clients' POSIX shared-memory objects (KServe system shared memory) -------------------------------------

SHM_DIR = Path("/dev/shm")
# A key names one object directly under /dev/shm; leading slashes are dropped as shm_open drops them.
_KEY = re.compile(r"/*([^/\x00]{1,255})")


def _object_path(key: str) -> Path:
    m = _KEY.fullmatch(key)
    if m is None or m.group(1) in (".", ".."):
        raise RegionError(f"key {key!r} does not name a POSIX shared-memory object (one name under /dev/shm, as "
                          "shm_open takes it, e.g. '/my_region')")
    return SHM_DIR / m.group(1)


def open_object(key: str) -> tuple[int, os.stat_result]:
    """The descriptor and ``fstat`` of the shared-memory object ``key`` (a regular file under /dev/shm).

    Raises:
        RegionError: no such object, not one this server may open read-write, or not a regular file.
    """
    path = _object_path(key)
    try:
        # O_NONBLOCK: a FIFO planted under that name must not stall the event loop; the check below refuses it.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise RegionError(f"no shared-memory object {key!r} (create it with shm_open before registering)") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RegionError(f"shared-memory key {key!r} is a symbolic link; name the object itself") from None
        raise RegionError(f"cannot open shared-memory object {key!r} read-write: "
                          f"{os.strerror(exc.errno or 0)}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise RegionError(f"shared-memory key {key!r} is not a memory object")
    return fd, st


def map_object(key: str, offset: int, byte_size: int, dev: int, ino: int) -> tuple[memoryview, int]:
    """``byte_size`` bytes at ``offset`` of the shared-memory object ``key``, mapped read-write: the mapping (whole
    pages, from the one that holds ``offset``) and where in it the bytes start. The object must be the one
    registered (device ``dev``, inode ``ino``) and hold those bytes now. The mapping lives as long as a view of it.

    Touching mapped pages that a client later truncated away raises SIGBUS in the process that touches them: the
    caller hands the memory only to the GPU's copy engines after locking it (``service.engine.ops.HostPin``), whose
    locked pages outlive a truncation.

    Raises:
        RegionError: no such object, another object under that name, or too small.
    """
    fd, st = open_object(key)
    try:
        if (st.st_dev, st.st_ino) != (dev, ino):
            raise RegionError(f"shared-memory object {key!r} was replaced after the region was registered; register "
                              "it again")
        if offset + byte_size > st.st_size:
            raise RegionError(f"shared-memory object {key!r} holds {st.st_size} bytes, fewer than the region's "
                              f"{byte_size} at offset {offset}")
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            mapped = mmap.mmap(fd, offset + byte_size - start, offset=start)
        except OSError as exc:
            raise RegionError(f"cannot map shared-memory object {key!r}: {os.strerror(exc.errno or 0)}") from None
    finally:
        os.close(fd)
    return memoryview(mapped), offset - start
