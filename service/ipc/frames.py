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
  With flag ``DEVICE`` the request has a tensor in CUDA shared memory (``codec.CudaJob``): the head is followed by
  ``i32 GPU | u8 where | 32s input token | u64 input offset | 32s output token | u64 output offset | u32 N, C, H, W
  of the output`` (``where``: 1 the input is in a region, 2 the output goes to one; a token names a registration,
  ``service.engine.cuda_shm``; GPU -1: the regions are system regions the engine page-locked, for any GPU) and by
  the input's bytes when it is not in a region.
* ``DROP``: ``u64 id | u8 reason``: the caller gave up on a queued request (reason: ``DROP_REASONS``). The
  engine answers ``ERROR`` (deadline_exceeded) only for reason ``deadline`` and only when the request was still
  queued; otherwise a batch already holds it and its ``RESULT`` or ``ERROR`` follows as usual.
* ``CUDA_OPEN``: ``u64 call id | i32 GPU | u64 byte size | 32s token | 64s IPC handle``: map a client's GPU
  allocation for a CUDA shared-memory registration. ``CUDA_CLOSE``: ``u64 call id | 32s token ...``: unmap those
  registrations'. ``SYSTEM_OPEN``: ``u64 call id | u64 offset | u64 byte size | u64 device | u64 inode | 32s token``
  + the key (UTF-8): map and page-lock a client's system shared-memory region (``CUDA_CLOSE`` unmaps it too). The
  engine answers each with ``REPLY`` or ``ERROR`` (call ids and request ids are one sequence).

Engine -> HTTP process:

* ``STATE``: JSON ``{"state", "reason", "backend", "layers": [names], "cuda_shm": bool, "cuda_shm_reason",
  "system_shm": bool}``, on connect and at every change (``system_shm``: the engine maps system regions).
* ``RESULT``: ``u64 id | u32 batch_samples | u32 batch_requests | f64 queue_s | u32 N, C, H, W | u8 len | u8 flags``
  + worker name + output bytes (the request's dtype); with flag ``SHARED`` no bytes: the output is in the
  request's slot; with flag ``DEVICE`` no bytes: the output is in the request's CUDA shared-memory region.
* ``REPLY``: ``u64 call id``: a ``CUDA_OPEN``, ``SYSTEM_OPEN`` or ``CUDA_CLOSE`` is done.
* ``ERROR``: ``u64 id`` + JSON ``{"type", "message", "headers"}`` (a ``ServiceError`` of that type).
* ``DONE``: ``u64 id``: a request with a slot that the engine took out of its queue after a ``DROP``; it holds
  nothing of it any more (the HTTP process may reuse the slot).

A request with a slot gets exactly one of ``RESULT``, ``ERROR`` or ``DONE``, after which the engine never touches
the slot again.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from service import errors
from service.codec import AnyTensor, CudaJob, DeviceTensor, RawTensor, bytes_of, raw_view

SUBMIT, DROP, STATE, RESULT, ERROR, DONE, CUDA_OPEN, CUDA_CLOSE, REPLY, SYSTEM_OPEN = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10
SHARED = 1  # flag of SUBMIT and RESULT: the tensor is in the HTTP process's arena, not in the frame
DEVICE = 2  # flag of SUBMIT and RESULT: a tensor is in a client's CUDA shared-memory region
IN_REGION, OUT_REGION = 1, 2  # a DEVICE SUBMIT's "where"
TOKEN_BYTES = 32  # a CUDA shared-memory registration's token (uuid4().hex)

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DROP_REASONS: tuple[str, ...] = ("disconnected", "timeout", "deadline", "cancelled")

_PREFIX = struct.Struct("<IB")  # length (kind + body), kind
_SUBMIT = struct.Struct("<QHBB4Idd")
_DROP = struct.Struct("<QB")
_SLOT = struct.Struct("<QQ")  # input offset, output offset
_RESULT = struct.Struct("<QIId4IBB")
_SHARED_RESULT = struct.Struct("<IB" + _RESULT.format[1:])  # a RESULT's prefix and head in one pack (see result_frame)
_ID = struct.Struct("<Q")
_DEVICE = struct.Struct(f"<iB{TOKEN_BYTES}sQ{TOKEN_BYTES}sQ4I")
_CUDA_OPEN = struct.Struct(f"<QiQ{TOKEN_BYTES}s64s")
_SYSTEM_OPEN = struct.Struct(f"<5Q{TOKEN_BYTES}s")

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


def _token(t: DeviceTensor | None) -> bytes:
    return b"" if t is None else _token_bytes(t.token)


def submit_frame(request_id: int, layer: int, x: AnyTensor | CudaJob, received: float,
                 deadline: float | None, slot: tuple[int, int] | None = None) -> list[bytes | memoryview]:
    """``SUBMIT`` for input ``x`` ``[N, C, H, W]`` of layer index ``layer``: its bytes, or with ``slot`` (input
    offset, output offset in the sender's arena, where ``x``'s bytes already are) only the slot; a ``CudaJob`` names
    its regions (and carries its input's bytes when they are not in one; never a slot)."""
    n, c, h, w = (int(d) for d in x.shape)
    job = x if isinstance(x, CudaJob) else None
    flags = DEVICE if job is not None else 0 if slot is None else SHARED
    head = _SUBMIT.pack(request_id, layer, DTYPES.index(x.dtype), flags, n, c, h, w, received,
                        math.nan if deadline is None else deadline)
    if job is not None:
        src, out = job.x, job.out
        in_region = isinstance(src, DeviceTensor)
        where = (IN_REGION if in_region else 0) | (OUT_REGION if out is not None else 0)
        device = _DEVICE.pack(job.device, where, _token(src if in_region else None),  # type: ignore[arg-type]
                              src.offset if in_region else 0, _token(out), 0 if out is None else out.offset,
                              *(out.shape if out is not None else (0, 0, 0, 0)))
        return _frame(SUBMIT, head, device) if in_region else _frame(SUBMIT, head, device, bytes_of(src))
    if slot is None:
        return _frame(SUBMIT, head, bytes_of(x))  # type: ignore[arg-type]
    return _frame(SUBMIT, head, _SLOT.pack(*slot))


def drop_frame(request_id: int, reason: str) -> list[bytes | memoryview]:
    """``DROP`` of a queued request (``reason`` one of ``DROP_REASONS``)."""
    return _frame(DROP, _DROP.pack(request_id, DROP_REASONS.index(reason)))


def state_frame(state: str, reason: str, backend: str, layers: list[str], cuda_shm: bool = False,
                cuda_shm_reason: str = "", system_shm: bool = False) -> list[bytes | memoryview]:
    """``STATE`` of the engine (``cuda_shm``: whether it maps CUDA shared memory, else why not; ``system_shm``:
    whether it maps system regions)."""
    body = json.dumps({"state": state, "reason": reason, "backend": backend, "layers": layers,
                       "cuda_shm": cuda_shm, "cuda_shm_reason": cuda_shm_reason, "system_shm": system_shm}).encode()
    return _frame(STATE, body)


def result_frame(request_id: int, y: AnyTensor | DeviceTensor, batch_samples: int, batch_requests: int,
                 queue_s: float, worker: str, shared: bool = False) -> list[bytes | memoryview]:
    """``RESULT`` carrying output ``y`` ``[N, C, H, W]``, or with ``shared`` saying it is in the request's slot, or
    (``y`` a ``DeviceTensor``) in the request's CUDA shared-memory region."""
    name = _worker_name(worker)
    n, c, h, w = y.shape
    if isinstance(y, DeviceTensor):
        return _frame(RESULT, _RESULT.pack(request_id, batch_samples, batch_requests, queue_s, n, c, h, w, len(name),
                                           DEVICE), name)
    if shared:  # every request of a batch with slots gets one: one pack and one bytes object for the frame
        size = 1 + _RESULT.size + len(name)
        return [_SHARED_RESULT.pack(size, RESULT, request_id, batch_samples, batch_requests, queue_s, n, c, h, w,
                                    len(name), SHARED) + name]
    head = _RESULT.pack(request_id, batch_samples, batch_requests, queue_s, n, c, h, w, len(name), 0)
    return _frame(RESULT, head, name, bytes_of(y))


@functools.lru_cache(maxsize=256)  # a server has a few workers; a RESULT per request names one
def _worker_name(worker: str) -> bytes:
    return worker.encode()[:255]


def cuda_open_frame(call_id: int, token: str, handle: bytes, device: int, byte_size: int) -> list[bytes | memoryview]:
    """``CUDA_OPEN``: map the allocation of IPC ``handle`` on GPU ``device`` for registration ``token``."""
    if len(handle) != 64:
        raise ProtocolError(f"a CUDA IPC handle has 64 bytes, got {len(handle)}")
    return _frame(CUDA_OPEN, _CUDA_OPEN.pack(call_id, device, byte_size, _token_bytes(token), handle))


def system_open_frame(call_id: int, token: str, key: str, offset: int, byte_size: int, dev: int,
                      ino: int) -> list[bytes | memoryview]:
    """``SYSTEM_OPEN``: map and page-lock ``byte_size`` bytes at ``offset`` of the object ``key`` (device ``dev``,
    inode ``ino``) for registration ``token``."""
    return _frame(SYSTEM_OPEN, _SYSTEM_OPEN.pack(call_id, offset, byte_size, dev, ino, _token_bytes(token)),
                  key.encode())


def cuda_close_frame(call_id: int, tokens: list[str]) -> list[bytes | memoryview]:
    """``CUDA_CLOSE``: unmap these registrations' allocations."""
    return _frame(CUDA_CLOSE, _ID.pack(call_id), b"".join(_token_bytes(t) for t in tokens))


def reply_frame(call_id: int) -> list[bytes | memoryview]:
    """``REPLY``: the call is done."""
    return _frame(REPLY, _ID.pack(call_id))


def _token_bytes(token: str) -> bytes:
    data = token.encode()
    if len(data) != TOKEN_BYTES:
        raise ProtocolError(f"a CUDA shared-memory token has {TOKEN_BYTES} characters, got {token!r}")
    return data


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
    x: RawTensor | CudaJob  # a view of the frame's body, or of the sender's arena; or a request in CUDA regions
    received: float
    deadline: float | None
    out_offset: int | None  # where in the sender's arena the output goes (None: it travels in a RESULT frame)


@dataclass(frozen=True)
class Output:
    """A decoded ``RESULT``."""

    request_id: int
    y: RawTensor | DeviceTensor  # a view of the frame's body, or of the request's slot (``shared``), or its region's
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
    or with flag ``SHARED`` over the sender's ``arena`` (the engine's mapping of it). The engine decodes one per
    request on its event loop: each tensor's size is computed once, here."""
    try:
        rid, layer, code, flags, n, c, h, w, received, deadline = _SUBMIT.unpack_from(body)
        dtype = DTYPES[code]
    except (struct.error, IndexError) as exc:
        raise ProtocolError(f"bad SUBMIT frame: {exc}") from exc
    shape = (n, c, h, w)
    due = None if deadline != deadline else deadline  # NaN: none
    if flags & DEVICE:
        return Submit(rid, layer, _cuda_job(body, dtype, shape), received, due, None)
    nbytes = n * c * h * w * dtype.itemsize
    if flags & SHARED:
        if arena is None:
            raise ProtocolError("a SUBMIT names a slot, but the connection has no arena")
        if len(body) != _SUBMIT.size + _SLOT.size:
            raise ProtocolError(f"a SUBMIT with a slot is {_SUBMIT.size + _SLOT.size} bytes, got {len(body)}")
        in_offset, out_offset = _SLOT.unpack_from(body, _SUBMIT.size)
        end = in_offset + nbytes
        if end > arena.nbytes:  # the output's end depends on the layer: the engine checks it
            raise ProtocolError(f"input slot [{in_offset}, {end}) is outside the {arena.nbytes}-byte arena")
        return Submit(rid, layer, raw_view(arena[in_offset:end], dtype, shape), received, due, out_offset)
    _check_tensor_bytes(body, _SUBMIT.size, dtype, shape)
    return Submit(rid, layer, raw_view(memoryview(body)[_SUBMIT.size:], dtype, shape), received, due, None)


def _cuda_job(body: bytearray, dtype: torch.dtype, shape: tuple[int, int, int, int]) -> CudaJob:
    """The ``CudaJob`` of a ``SUBMIT`` with flag ``DEVICE``."""
    try:
        device, where, in_token, in_offset, out_token, out_offset, *out_shape = _DEVICE.unpack_from(body, _SUBMIT.size)
        start = _SUBMIT.size + _DEVICE.size
        x: RawTensor | DeviceTensor
        if where & IN_REGION:
            if len(body) != start:
                raise ProtocolError("a SUBMIT with its input in a CUDA region carries no input bytes")
            x = DeviceTensor(in_token.decode("ascii"), device, in_offset, dtype, shape)
        else:
            _check_tensor_bytes(body, start, dtype, shape)
            x = RawTensor(memoryview(body)[start:], dtype, shape)
        out = DeviceTensor(out_token.decode("ascii"), device, out_offset, dtype, tuple(out_shape)) \
            if where & OUT_REGION else None
        return CudaJob(x, out)
    except (struct.error, UnicodeDecodeError, errors.RegionError) as exc:
        raise ProtocolError(f"bad SUBMIT frame with CUDA regions: {exc}") from exc


def parse_cuda_open(body: bytearray) -> tuple[int, str, bytes, int, int]:
    """Decode a ``CUDA_OPEN`` body: (call id, token, handle, device, byte size)."""
    try:
        call_id, device, byte_size, token, handle = _CUDA_OPEN.unpack(body)
        return call_id, token.decode("ascii"), handle, device, byte_size
    except (struct.error, UnicodeDecodeError) as exc:
        raise ProtocolError(f"bad CUDA_OPEN frame: {exc}") from exc


def parse_system_open(body: bytearray) -> tuple[int, str, str, int, int, int, int]:
    """Decode a ``SYSTEM_OPEN`` body: (call id, token, key, offset, byte size, device, inode)."""
    try:
        call_id, offset, byte_size, dev, ino, token = _SYSTEM_OPEN.unpack_from(body)
        key = bytes(body[_SYSTEM_OPEN.size:]).decode()
        return call_id, token.decode("ascii"), key, offset, byte_size, dev, ino
    except (struct.error, UnicodeDecodeError) as exc:
        raise ProtocolError(f"bad SYSTEM_OPEN frame: {exc}") from exc


def parse_cuda_close(body: bytearray) -> tuple[int, list[str]]:
    """Decode a ``CUDA_CLOSE`` body: (call id, tokens)."""
    call_id = result_id(body)
    data = bytes(body[_ID.size:])
    if len(data) % TOKEN_BYTES:
        raise ProtocolError(f"bad CUDA_CLOSE frame: {len(data)} bytes of tokens")
    try:
        return call_id, [data[i:i + TOKEN_BYTES].decode("ascii") for i in range(0, len(data), TOKEN_BYTES)]
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"bad CUDA_CLOSE frame: {exc}") from exc


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
    if flags & DEVICE:
        if len(body) != start + name_len:
            raise ProtocolError(f"a RESULT in a CUDA region for request {rid} carries bytes")
        return Output(rid, DeviceTensor("", -1, 0, dtype, shape), samples, requests, queue_s, worker, False)
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
