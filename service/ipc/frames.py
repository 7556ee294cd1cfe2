"""The frames between the HTTP processes and the engine process (``DECONV_HTTP_PROCESSES`` > 1).

One Unix-domain stream connection per HTTP process. Every frame is ``u32 length | u8 kind | body`` (little-endian;
``length`` counts the kind byte and the body). Tensors travel as their raw C-order bytes after a fixed header;
metadata that is not a tensor (state, errors) is JSON. Nothing is pickled.

HTTP process -> engine:

* ``SUBMIT``: ``u64 id | u16 layer | u8 dtype | u8 flags | u32 N, C, H, W | f64 received | f64 deadline`` + the
  input bytes, or, with flag ``SHARED``, ``u64 input offset | u64 output offset`` in the HTTP process's shared
  arena (``service.ipc.shm``): the input is there and the output is to be written there. ``received`` and
  ``deadline`` are ``time.monotonic()`` values (one clock for every process on the machine); deadline NaN means
  none. ``layer`` indexes the layer names of the engine's ``STATE`` frame.
* ``DROP``: ``u64 id | u8 reason``: the caller gave up on a queued request (reason: ``DROP_REASONS``). The
  engine answers ``ERROR`` (deadline_exceeded) only for reason ``deadline`` and only when the request was still
  queued; otherwise a batch already holds it and its ``RESULT`` or ``ERROR`` follows as usual.

Engine -> HTTP process:

* ``STATE``: JSON ``{"state", "reason", "backend", "layers": [names]}``, on connect and at every change.
* ``RESULT``: ``u64 id | u32 batch_samples | u32 batch_requests | f64 queue_s | u32 N, C, H, W | u8 len | u8 flags``
  + worker name + output bytes (the request's dtype); with flag ``SHARED`` no bytes: the output is in the
  request's slot.
* ``ERROR``: ``u64 id`` + JSON ``{"type", "message", "headers"}`` (a ``ServiceError`` of that type).
* ``DONE``: ``u64 id``: a request with a slot that the engine took out of its queue after a ``DROP``; it holds
  nothing of it any more (the HTTP process may reuse the slot).

A request with a slot gets exactly one of ``RESULT``, ``ERROR`` or ``DONE``, after which the engine never touches
the slot again.
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from service import errors
from service.codec import AnyTensor, RawTensor, bytes_of

SUBMIT, DROP, STATE, RESULT, ERROR, DONE = 1, 2, 3, 4, 5, 6
SHARED = 1  # flag of SUBMIT and RESULT: the tensor is in the HTTP process's arena, not in the frame

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DROP_REASONS: tuple[str, ...] = ("disconnected", "timeout", "deadline", "cancelled")

_PREFIX = struct.Struct("<IB")  # length (kind + body), kind
_SUBMIT = struct.Struct("<QHBB4Idd")
_DROP = struct.Struct("<QB")
_SLOT = struct.Struct("<QQ")  # input offset, output offset
_RESULT = struct.Struct("<QIId4IBB")
_SHARED_RESULT = struct.Struct("<IB" + _RESULT.format[1:])  # a RESULT's prefix and head in one pack (see result_frame)
_ID = struct.Struct("<Q")

# The length field is 32 bits: a larger frame cannot be sent (the sender raises ProtocolError).
MAX_FRAME_BYTES = 2**32 - 1

_ERROR_TYPES: dict[str, type[errors.ServiceError]] = {}


def _error_types() -> dict[str, type[errors.ServiceError]]:
    if not _ERROR_TYPES:
        todo: list[type[errors.ServiceError]] = [errors.ServiceError]
        while todo:
            cls = todo.pop()
            _ERROR_TYPES.setdefault(cls.type, cls)
            todo.extend(cls.__subclasses__())
    return _ERROR_TYPES


class ProtocolError(ValueError):
    """A frame that does not follow this module's layout."""


# --- encoding -------------------------------------------------------------------------------------------------


def _frame(kind: int, *parts: bytes | memoryview) -> list[bytes | memoryview]:
    size = 1 + sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {size} bytes is over the limit of {MAX_FRAME_BYTES}")
    return [_PREFIX.pack(size, kind), *parts]


def submit_frame(request_id: int, layer: int, x: AnyTensor, received: float,
                 deadline: float | None, slot: tuple[int, int] | None = None) -> list[bytes | memoryview]:
    """``SUBMIT`` for input ``x`` ``[N, C, H, W]`` of layer index ``layer``: its bytes, or with ``slot`` (input
    offset, output offset in the sender's arena, where ``x``'s bytes already are) only the slot."""
    n, c, h, w = (int(d) for d in x.shape)
    head = _SUBMIT.pack(request_id, layer, DTYPES.index(x.dtype), 0 if slot is None else SHARED, n, c, h, w,
                        received, math.nan if deadline is None else deadline)
    if slot is None:
        return _frame(SUBMIT, head, bytes_of(x))
    return _frame(SUBMIT, head, _SLOT.pack(*slot))


def drop_frame(request_id: int, reason: str) -> list[bytes | memoryview]:
    """``DROP`` of a queued request (``reason`` one of ``DROP_REASONS``)."""
    return _frame(DROP, _DROP.pack(request_id, DROP_REASONS.index(reason)))


def state_frame(state: str, reason: str, backend: str, layers: list[str]) -> list[bytes | memoryview]:
    """``STATE`` of the engine."""
    body = json.dumps({"state": state, "reason": reason, "backend": backend, "layers": layers}).encode()
    return _frame(STATE, body)


def result_frame(request_id: int, y: AnyTensor, batch_samples: int, batch_requests: int,
                 queue_s: float, worker: str, shared: bool = False) -> list[bytes | memoryview]:
    """``RESULT`` carrying output ``y`` ``[N, C, H, W]``, or with ``shared`` saying it is in the request's slot."""
    name = worker.encode()[:255]
    n, c, h, w = y.shape
    if shared:  # every request of a batch with slots gets one: one pack and one bytes object for the frame
        size = 1 + _RESULT.size + len(name)
        return [_SHARED_RESULT.pack(size, RESULT, request_id, batch_samples, batch_requests, queue_s, n, c, h, w,
                                    len(name), SHARED) + name]
    head = _RESULT.pack(request_id, batch_samples, batch_requests, queue_s, n, c, h, w, len(name), 0)
    return _frame(RESULT, head, name, bytes_of(y))


def done_frame(request_id: int) -> list[bytes | memoryview]:
    """``DONE``: the engine holds nothing of a request with a slot that it took out of its queue."""
    return _frame(DONE, _ID.pack(request_id))


def error_frame(request_id: int, error: errors.ServiceError) -> list[bytes | memoryview]:
    """``ERROR``: the request fails with ``error`` (its type, message and headers travel)."""
    body = json.dumps({"type": error.type, "message": error.message, "headers": error.headers}).encode()
    return _frame(ERROR, _ID.pack(request_id), body)


# --- decoding -------------------------------------------------------------------------------------------------


class Submit(NamedTuple):
    """A decoded ``SUBMIT`` (a tuple: the engine makes one per request)."""

    request_id: int
    layer: int
    x: RawTensor  # a view of the frame's body, or of the sender's arena
    received: float
    deadline: float | None
    out_offset: int | None  # where in the sender's arena the output goes (None: it travels in a RESULT frame)


@dataclass(frozen=True)
class Output:
    """A decoded ``RESULT``."""

    request_id: int
    y: RawTensor  # a view of the frame's body, or of the request's slot (``shared``)
    batch_samples: int
    batch_requests: int
    queue_s: float
    worker: str
    shared: bool  # the output is in the request's slot


def _check_tensor_bytes(body: bytearray, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    need = math.prod(shape) * dtype.itemsize
    if len(body) - offset != need:
        raise ProtocolError(f"tensor {list(shape)} {dtype} needs {need} bytes, the frame holds {len(body) - offset}")


def parse_submit(body: bytearray, arena: memoryview | None = None) -> Submit:
    """Decode a ``SUBMIT`` body; the input is a ``RawTensor`` (no torch tensor: see ``RawTensor``) over ``body``,
    or with flag ``SHARED`` over the sender's ``arena`` (the engine's mapping of it)."""
    try:
        rid, layer, code, flags, n, c, h, w, received, deadline = _SUBMIT.unpack_from(body)
        dtype = DTYPES[code]
    except (struct.error, IndexError) as exc:
        raise ProtocolError(f"bad SUBMIT frame: {exc}") from exc
    shape = (n, c, h, w)
    out_offset = None
    if flags & SHARED:
        if arena is None:
            raise ProtocolError("a SUBMIT names a slot, but the connection has no arena")
        if len(body) != _SUBMIT.size + _SLOT.size:
            raise ProtocolError(f"a SUBMIT with a slot is {_SUBMIT.size + _SLOT.size} bytes, got {len(body)}")
        in_offset, out_offset = _SLOT.unpack_from(body, _SUBMIT.size)
        end = in_offset + math.prod(shape) * dtype.itemsize
        if end > arena.nbytes:  # the output's end depends on the layer: the engine checks it
            raise ProtocolError(f"input slot [{in_offset}, {end}) is outside the {arena.nbytes}-byte arena")
        x = RawTensor(arena[in_offset:end], dtype, shape)
    else:
        _check_tensor_bytes(body, _SUBMIT.size, dtype, shape)
        x = RawTensor(memoryview(body)[_SUBMIT.size:], dtype, shape)
    return Submit(rid, layer, x, received, None if math.isnan(deadline) else deadline, out_offset)


def parse_drop(body: bytearray) -> tuple[int, str]:
    """Decode a ``DROP`` body: (request id, reason)."""
    try:
        rid, reason = _DROP.unpack_from(body)
        return rid, DROP_REASONS[reason]
    except (struct.error, IndexError) as exc:
        raise ProtocolError(f"bad DROP frame: {exc}") from exc


def parse_state(body: bytearray) -> dict[str, Any]:
    """Decode a ``STATE`` body."""
    try:
        state = json.loads(body)
    except ValueError as exc:
        raise ProtocolError(f"bad STATE frame: {exc}") from exc
    if not isinstance(state, dict) or not {"state", "reason", "backend", "layers"} <= state.keys():
        raise ProtocolError("bad STATE frame: missing fields")
    return state


def parse_result(body: bytearray, dtype: torch.dtype, slot: memoryview | None = None) -> Output:
    """Decode a ``RESULT`` body whose output has ``dtype``; the output is a ``RawTensor`` over ``body``, or with
    flag ``SHARED`` over the request's ``slot`` (its output's place in the arena, at least the output's size)."""
    try:
        rid, samples, requests, queue_s, n, c, h, w, name_len, flags = _RESULT.unpack_from(body)
    except struct.error as exc:
        raise ProtocolError(f"bad RESULT frame: {exc}") from exc
    start = _RESULT.size
    worker = bytes(body[start:start + name_len]).decode(errors="replace")
    shape = (n, c, h, w)
    need = math.prod(shape) * dtype.itemsize
    if flags & SHARED:
        if slot is None or slot.nbytes < need or len(body) != start + name_len:
            raise ProtocolError(f"a RESULT in a slot for request {rid}, which has "
                                f"{'no slot' if slot is None else f'a {slot.nbytes}-byte slot'} for {need} bytes")
        return Output(rid, RawTensor(slot[:need], dtype, shape), samples, requests, queue_s, worker, True)
    _check_tensor_bytes(body, start + name_len, dtype, shape)
    y = RawTensor(memoryview(body)[start + name_len:], dtype, shape)
    return Output(rid, y, samples, requests, queue_s, worker, False)


def result_id(body: bytearray) -> int:
    """The request id of a ``RESULT``, ``ERROR`` or ``DONE`` body."""
    if len(body) < _ID.size:
        raise ProtocolError("frame too short for a request id")
    return int(_ID.unpack_from(body)[0])


def parse_error(body: bytearray) -> tuple[int, errors.ServiceError]:
    """Decode an ``ERROR`` body: (request id, the error to raise)."""
    rid = result_id(body)
    try:
        info = json.loads(body[_ID.size:])
        cls = _error_types().get(str(info["type"]), errors.InternalError)
        error = cls.__new__(cls)
        errors.ServiceError.__init__(error, str(info["message"]), headers=dict(info.get("headers") or {}))
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolError(f"bad ERROR frame: {exc}") from exc
    return rid, error


# --- the connection -------------------------------------------------------------------------------------------


class FrameProtocol(asyncio.Protocol):
    """A stream of frames in both directions. Subclasses implement ``frame_received`` and ``lost``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self.loop = asyncio.get_running_loop()  # the connection's event loop
        self._closed = self.loop.create_future()
        self._out: list[bytes | memoryview] = []  # frames queued in this loop iteration, written together

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (asyncio's or uvloop's)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        start = 0
        try:
            while len(buf) - start >= _PREFIX.size:
                size, kind = _PREFIX.unpack_from(buf, start)
                end = start + 4 + size
                if size < 1:
                    raise ProtocolError("empty frame")
                if len(buf) < end:
                    break
                body = buf[start + _PREFIX.size:end]  # a copy: tensors decoded from it outlive the buffer
                start = end
                self.frame_received(kind, body)
        except ProtocolError as exc:
            self.protocol_error(exc)
            return
        finally:
            del buf[:start]

    def send(self, parts: list[bytes | memoryview]) -> None:
        """Queue one frame (from ``*_frame``); dropped when the connection is gone.

        Frames sent during one event-loop iteration (a batch's results, a burst of requests) leave in one write
        at the end of it: one system call instead of one per frame.
        """
        if self.transport is None or self.transport.is_closing():
            return
        if not self._out:
            self.loop.call_soon(self._flush)
        self._out.extend(parts)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(out)

    def frame_received(self, kind: int, body: bytearray) -> None:
        """Handle one frame."""
        raise NotImplementedError

    def protocol_error(self, exc: ProtocolError) -> None:
        """A malformed frame: close the connection (``connection_lost`` follows)."""
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self._closed.done():
            self._closed.set_result(None)
        self.lost(exc)

    def lost(self, exc: Exception | None) -> None:
        """The other side closed or failed."""

    async def closed(self) -> None:
        """Wait until the connection is closed."""
        await asyncio.shield(self._closed)

    def close(self) -> None:
        """Close after the queued frames are written."""
        if self.transport is not None:
            self._flush()
            self.transport.close()


Factory = Callable[[], FrameProtocol]
