"""Request bodies of an HTTP process read into memory that is reused from one request to the next.

A multi-megabyte body read into a new buffer costs more than its bytes: the buffer's pages are fresh, so the kernel
maps and zeroes every one of them as the body lands (bench/NOTES.md, issue 30: the largest share of an HTTP
process's CPU with 4 MiB bodies). A body of ``MIN_BYTES`` or more whose length is declared is read instead into a
buffer of this pool, whose pages stay mapped: ``BodyPool.take`` lends one of at least the body's size, and it comes
back to the pool once the request's last view of it is gone (the decoded tensor, the answer written from it:
``service.ipc.shm.lend``), never before. Idle buffers are kept up to ``max_idle_bytes`` (the settings'
``body_pool_bytes``), the least recently returned given up first; a buffer in use is its request's own and counts
in the server's bound on bytes in flight (``service.budget``) by the body's length, as any body does (a reused
buffer may be up to a quarter, or ``GRAIN``, larger).

Event-loop only (not thread-safe); a buffer whose last view goes in another thread comes back through the loop.

A KServe request's JSON is at most ``MAX_JSON_BYTES`` after decompression (``decompress_json`` decompresses a body
that is all JSON a step at a time, no further than that). ``parse_json`` reads the JSON bodies (KServe requests,
shared-memory registrations) with integer literals bounded by this module's own limit (``MAX_JSON_INT_DIGITS``),
not by Python's process-wide one (``sys.get_int_max_str_digits``): a longer integer is a ``LongNumberError`` (400)
in every field, whatever that setting is, and every other number parses to a value (a float literal of any length
is a float, perhaps 0 or infinity).
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import itertools
import json
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from service.errors import MalformedBodyError, PayloadTooLargeError, UnsupportedMediaTypeError
from service.ipc.shm import lend

# Smaller bodies are read into a plain growing buffer: allocating them costs little.
MIN_BYTES = 64 * 2**10
# Buffers are allocated in multiples of this, and a body takes an idle buffer at most this much (or a quarter of the
# body) larger than it: requests of one shape share buffers, and no small body holds a large one.
GRAIN = 64 * 2**10


class BodyPool:
    """Buffers for request bodies: lent by ``take``, back when the request's last view of one is gone."""

    def __init__(self, max_idle_bytes: int) -> None:
        """``max_idle_bytes``: most bytes of buffers kept while no request uses them (0: none, every body is read
        into a new buffer)."""
        if max_idle_bytes < 0:
            raise ValueError(f"max_idle_bytes must be >= 0, got {max_idle_bytes}")
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[tuple[int, int, np.ndarray]] = []  # (capacity, return order, buffer), sorted
        self._order = itertools.count()
        self.idle_bytes = 0
        self.taken = 0  # bodies lent a buffer
        self.reused = 0  # ... of which got an idle one

    @property
    def idle(self) -> int:
        """Buffers kept for the next bodies."""
        return len(self._idle)

    def take(self, nbytes: int) -> memoryview | None:
        """A writable view of exactly ``nbytes`` bytes of a pooled buffer, which comes back to the pool once the
        view and everything made from it are gone; None when the body is below ``MIN_BYTES`` or the pool keeps
        nothing (the caller then reads into a buffer of its own)."""
        if nbytes < MIN_BYTES or self.max_idle_bytes == 0:
            return None
        i = bisect.bisect_left(self._idle, (nbytes,))
        if i < len(self._idle) and self._idle[i][0] <= nbytes + max(GRAIN, nbytes // 4):
            capacity, _, buf = self._idle.pop(i)
            self.idle_bytes -= capacity
            self.reused += 1
        else:
            buf = np.empty(-(-nbytes // GRAIN) * GRAIN, dtype=np.uint8)
        self.taken += 1
        return lend(memoryview(buf)[:nbytes], functools.partial(self._give, buf))

    def _give(self, buf: np.ndarray) -> None:
        """A lent buffer's last view is gone: keep it, giving up the least recently returned buffers beyond the
        bound (this one too when it alone exceeds it)."""
        capacity = buf.nbytes
        if capacity > self.max_idle_bytes:
            return
        bisect.insort(self._idle, (capacity, next(self._order), buf))
        self.idle_bytes += capacity
        while self.idle_bytes > self.max_idle_bytes:
            oldest = min(range(len(self._idle)), key=lambda j: self._idle[j][1])
            self.idle_bytes -= self._idle.pop(oldest)[0]


# The most digits of an integer in a JSON body: a float64 reaches 309, every count and size of the protocols far
# fewer, and the product of a shape's 4 dimensions stays under Python's int-conversion limit (4,300 digits by
# default, process-wide and changeable), so that a message can still print it.
MAX_JSON_INT_DIGITS = 1000


class LongNumberError(ValueError):
    """A JSON integer of more than ``MAX_JSON_INT_DIGITS`` digits."""


def _bounded_int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > MAX_JSON_INT_DIGITS:
        raise LongNumberError(f"a JSON integer has {digits} digits, more than the {MAX_JSON_INT_DIGITS} this server "
                              "reads")
    return int(text)


_DECODER = json.JSONDecoder(parse_int=_bounded_int)


def parse_json(data: bytes | bytearray | memoryview) -> Any:
    """``data`` (UTF-8, -16 or -32, as ``json.loads`` reads bytes) as a Python value, integers bounded.

    Raises:
        LongNumberError: an integer of more than ``MAX_JSON_INT_DIGITS`` digits.
        ValueError: not valid JSON (``json.JSONDecodeError``) or not valid text (``UnicodeDecodeError``).
        RecursionError: nested too deeply.
    """
    view = memoryview(data).cast("B")
    return _DECODER.decode(str(view, json.detect_encoding(bytes(view[:4])), "surrogatepass"))


# The most bytes of a KServe request's JSON (after decompression): parsing holds the interpreter, whatever thread
# runs it, for ~50 ms a MiB of numbers (more on a busy machine), so larger JSON is refused (413) before it is
# decompressed further or parsed; a tensor that large travels as binary or in shared memory.
MAX_JSON_BYTES = 4 * 2**20
# Bytes a JSON body is decompressed by between two returns to the event loop (well under a millisecond each).
DECOMPRESS_STEP = 256 * 2**10


def json_too_large(what: str) -> PayloadTooLargeError:
    """The 413 of a request whose JSON exceeds ``MAX_JSON_BYTES`` (``what``: which JSON, with its size)."""
    return PayloadTooLargeError(
        f"{what} is over the {MAX_JSON_BYTES}-byte limit of a request's JSON; send the input as binary (the binary "
        "tensor extension: Inference-Header-Content-Length and parameters.binary_data_size) or in shared memory")


async def decompress_json(body: bytearray | memoryview, encoding: str | None) -> bytearray | memoryview:
    """A body that is all JSON, decompressed as ``Content-Encoding`` says (``decompress``), no further than
    ``MAX_JSON_BYTES``.

    Raises:
        PayloadTooLargeError: more than ``MAX_JSON_BYTES`` once decompressed (413).
        UnsupportedMediaTypeError: another encoding (415).
        MalformedBodyError: not valid compressed data (400).
    """
    return await decompress(body, encoding, MAX_JSON_BYTES, lambda: json_too_large("the decompressed JSON body"))


def body_too_large(limit: int) -> PayloadTooLargeError:
    """The 413 of a body larger than ``limit`` bytes once decompressed."""
    return PayloadTooLargeError(f"decompressed body exceeds the limit of {limit} bytes")


async def decompress(body: bytearray | memoryview, encoding: str | None, limit: int,
                     too_large: Callable[[], PayloadTooLargeError] | None = None) -> bytearray | memoryview:
    """``body`` decompressed as ``Content-Encoding`` says (gzip, deflate, identity: the body as it is), no further
    than ``limit`` bytes, and a step at a time with the event loop let run between steps, so that many such bodies
    at once delay no other connection by more than a step each. ``too_large``: the error past the limit (default
    ``body_too_large``).

    Raises:
        PayloadTooLargeError: more than ``limit`` bytes once decompressed (413).
        UnsupportedMediaTypeError: another encoding (415).
        MalformedBodyError: not valid compressed data (400).
    """
    enc = (encoding or "identity").strip().lower()
    if enc == "identity":
        return body
    if enc not in ("gzip", "deflate"):
        raise UnsupportedMediaTypeError(f"Content-Encoding {encoding!r} is not supported (gzip, deflate, identity)")
    d = zlib.decompressobj(wbits=31 if enc == "gzip" else 15)
    out = bytearray()
    data = bytes(body)
    try:
        while True:
            piece = d.decompress(data, DECOMPRESS_STEP)
            out += piece
            if len(out) > limit:
                raise too_large() if too_large is not None else body_too_large(limit)
            data = d.unconsumed_tail
            if not data and len(piece) < DECOMPRESS_STEP:  # all input taken, no output held back
                break
            await asyncio.sleep(0)
    except zlib.error:
        raise MalformedBodyError(f"body is not valid {enc} data") from None
    return out
