"""Tensor wire formats: ``.npy`` and safetensors, decoded without copies and never unpickled.

Decoding parses the header by hand (``ast.literal_eval`` for .npy's dict literal, ``json`` for safetensors), checks
dtype, shape and that the byte count matches exactly *before* anything is allocated (a header claiming more data
than ``max_bytes``, or a shape beyond ``MAX_ELEMENTS``, is refused with 413), then views the request
buffer in place: as a ``RawTensor`` (``decode_raw``, the service's request path) or a torch tensor
(``decode``, ``torch.frombuffer``). Pass a writable buffer (``bytearray``) to share it; a read-only one
(``bytes``) is shared too, and the tensor must then be treated as read-only.

Encoding writes a small header followed by the tensor's bytes (one copy, into the response body).
bfloat16 travels only as safetensors: .npy has no bf16 dtype.
"""

from __future__ import annotations

import ast
import json
import math
import re
import struct
import warnings
from collections.abc import Sequence

import torch

from service.errors import InvalidInputError, MalformedBodyError, PayloadTooLargeError, UnsupportedMediaTypeError

NPY = "application/x-npy"
SAFETENSORS = "application/vnd.safetensors"
MEDIA_TYPES = (NPY, SAFETENSORS)

NPY_MAGIC = b"\x93NUMPY"
MAX_HEADER_BYTES = 1 << 16  # a one-tensor header is a few hundred bytes; refuse to parse anything huge
# Most elements a shape may span, counting a zero dimension as 1: keeps torch's stride arithmetic (int64) far
# from overflowing even for empty tensors such as [0, 16, 10**18, 10**18].
MAX_ELEMENTS = 1 << 48

_NPY_DTYPES = {"f2": torch.float16, "f4": torch.float32, "f8": torch.float64}
_NPY_DESCR = {torch.float16: "<f2", torch.float32: "<f4", torch.float64: "<f8"}
ST_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
_ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
BufferLike = bytes | bytearray | memoryview

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
               torch.float64: "float64"}


def _check_shape(shape: object, where: str) -> tuple[int, ...]:
    if not isinstance(shape, list | tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise MalformedBodyError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if len(shape) > 8:
        raise InvalidInputError(f"{where}: a tensor of rank {len(shape)}; expected [N, C, H, W] or [C, H, W]")
    return tuple(shape)


def check_size(shape: Sequence[int], itemsize: int, where: str, max_bytes: int | None = None) -> int:
    """The data bytes a tensor of ``shape`` needs, checked before anything is allocated.

    Raises:
        PayloadTooLargeError: the shape spans more than ``MAX_ELEMENTS`` elements, or needs more than
            ``max_bytes`` bytes (413).
    """
    if math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS:
        raise PayloadTooLargeError(f"{where}: shape {list(shape)} is larger than any tensor this server accepts")
    need = math.prod(shape) * itemsize
    if max_bytes is not None and need > max_bytes:
        raise PayloadTooLargeError(f"{where}: shape {list(shape)} needs {need} bytes, over the limit of "
                                   f"{max_bytes} bytes")
    return need


def view_tensor(buf: BufferLike, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor of ``shape`` over ``buf[offset:]`` without copying (the caller checked the size).

    A copy is made only when the data is not aligned to the element size (rare: every writer pads headers).
    """
    count = math.prod(shape)
    if count == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    if isinstance(buf, bytearray) or (isinstance(buf, memoryview) and not buf.readonly):
        flat = torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    else:
        with warnings.catch_warnings():
            # A read-only buffer (bytes) is fine here: the service never writes into request tensors.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    if flat.data_ptr() % flat.element_size():
        flat = flat.clone()
    return flat.view(tuple(shape))


class RawTensor:
    """A dense C-order tensor kept as the bytes it arrived in, not yet (or no longer) a torch tensor.

    Requests travel as these from the HTTP body to the worker (through the engine link in a multi-process
    server): a torch tensor per request would cost an event loop more than the rest of the request's handling.
    The worker copies a batch's inputs into one staging tensor (``copy_into``) and hands back each request's
    output as a slice of the batch's output (``Worker._deliver``).
    """

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, data: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        if data.nbytes != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{data.nbytes} bytes cannot hold a {list(shape)} {dtype} tensor")
        self.data = data  # C-contiguous bytes (format "B")
        self.dtype = dtype
        self.shape = shape

    def element_size(self) -> int:
        """Bytes per element, as ``torch.Tensor.element_size``."""
        return self.dtype.itemsize

    def tensor(self) -> torch.Tensor:
        """A torch tensor over the same bytes (no copy when aligned)."""
        return view_tensor(self.data, 0, self.dtype, self.shape)

    def reshape(self, shape: tuple[int, ...]) -> RawTensor:
        """The same bytes as ``shape`` (same number of elements)."""
        return RawTensor(self.data, self.dtype, shape)


class SlotTensor(RawTensor):
    """A request's input whose output is to be written into ``out`` (exactly the output's bytes): the request's
    slot in an HTTP process's shared arena (``service.ipc.shm``), where the input is too."""

    __slots__ = ("out",)

    def __init__(self, data: memoryview, dtype: torch.dtype, shape: tuple[int, ...], out: memoryview) -> None:
        super().__init__(data, dtype, shape)
        self.out = out

    @classmethod
    def of(cls, x: RawTensor, out: memoryview) -> SlotTensor:
        """``x`` (checked when it was made) with its output's place ``out``: the engine makes one per request."""
        t = cls.__new__(cls)
        t.data, t.dtype, t.shape, t.out = x.data, x.dtype, x.shape, out
        return t


AnyTensor = torch.Tensor | RawTensor
"""A request's input or output: a torch tensor, or a ``RawTensor`` (the HTTP path and the engine process keep
requests as these: a torch tensor per request costs more CPU than the rest of its decoding)."""


def as_tensor(t: AnyTensor) -> torch.Tensor:
    """``t`` as a torch tensor (a view of a ``RawTensor``'s bytes)."""
    return t.tensor() if isinstance(t, RawTensor) else t


def bytes_of(t: AnyTensor) -> memoryview:
    """The bytes of ``t`` in C order (see ``tensor_bytes``)."""
    return t.data if isinstance(t, RawTensor) else tensor_bytes(t)


def copy_into(dst: torch.Tensor, parts: Sequence[RawTensor]) -> None:
    """Fill ``dst`` (contiguous, on the CPU, of the parts' dtype) with ``parts`` one after the other."""
    out = tensor_bytes(dst)
    offset = 0
    for part in parts:
        end = offset + part.data.nbytes
        out[offset:end] = part.data
        offset = end
    if offset != out.nbytes:
        raise ValueError(f"the parts hold {offset} bytes, the destination {out.nbytes}")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` in C order (little-endian), as a view when ``t`` is already contiguous on the CPU."""
    if (t.dtype != torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad
            and t.numel()):
        return memoryview(t.numpy()).cast("B")  # one call instead of five (numpy has no bfloat16)
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# --- .npy -----------------------------------------------------------------------------------------------------


# The header exactly as numpy (and every writer copying it, ours included) lays it out, e.g.
# "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 16, 16, 16), }" plus padding. Matching it is about 30x
# cheaper than ast.literal_eval, which costs ~30 us per request; any other spelling still goes to literal_eval.
_NPY_CANONICAL = re.compile(
    r"\{'descr': '([^'\\]*)', 'fortran_order': (True|False), "
    r"'shape': \((|(?:0|[1-9][0-9]*),|(?:0|[1-9][0-9]*)(?:, (?:0|[1-9][0-9]*))+)\), \}[ \n]*")


def _npy_canonical_header(text: str) -> dict[str, object] | None:
    # The same dict as ast.literal_eval(text) when text is in numpy's canonical layout, else None.
    m = _NPY_CANONICAL.fullmatch(text)
    if m is None:
        return None
    descr, fortran, dims = m.groups()
    shape = tuple(int(d) for d in dims.split(",") if d)
    return {"descr": descr, "fortran_order": fortran == "True", "shape": shape}


def _npy_header(buf: memoryview) -> tuple[dict[str, object], int]:
    if len(buf) < 10 or bytes(buf[:6]) != NPY_MAGIC:
        raise MalformedBodyError("body is not a .npy file (missing the \\x93NUMPY magic)")
    major = buf[6]
    if major == 1:
        (hlen,), start = struct.unpack_from("<H", buf, 8), 10
    elif major in (2, 3):
        if len(buf) < 12:
            raise MalformedBodyError(".npy header is truncated")
        (hlen,), start = struct.unpack_from("<I", buf, 8), 12
    else:
        raise MalformedBodyError(f".npy format version {major}.{buf[7]} is not supported (1.0, 2.0, 3.0 are)")
    if hlen > MAX_HEADER_BYTES:
        raise MalformedBodyError(f".npy header of {hlen} bytes is too large")
    if start + hlen > len(buf):
        raise MalformedBodyError(".npy header is truncated")
    try:
        text = bytes(buf[start : start + hlen]).decode("utf-8" if major == 3 else "latin1")
        header = _npy_canonical_header(text)
        if header is None:
            header = ast.literal_eval(text)  # literals only: no names, no calls, no unpickling
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
        raise MalformedBodyError(".npy header is not a valid dict literal") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise MalformedBodyError(".npy header must be a dict with exactly 'descr', 'fortran_order' and 'shape'")
    return header, start + hlen


def decode_npy(body: BufferLike, max_bytes: int | None = None) -> torch.Tensor:
    """Decode a ``.npy`` body (format 1.0, 2.0 or 3.0) into a tensor that shares ``body``'s memory (see
    ``decode_npy_raw``)."""
    return as_tensor(decode_npy_raw(body, max_bytes))


def decode_npy_raw(body: BufferLike, max_bytes: int | None = None) -> AnyTensor:
    """Decode a ``.npy`` body (format 1.0, 2.0 or 3.0) into a ``RawTensor`` over ``body``'s bytes (a Fortran-order
    array of rank 2 or more: a transposed torch view of them).

    Accepts little-endian float16, float32 and float64 in C or Fortran order; object arrays (which would need
    pickle) and every other dtype are refused.

    Raises:
        MalformedBodyError: not a .npy file, truncated, or the byte count does not match the shape.
        InvalidInputError: a dtype the service does not compute in.
        PayloadTooLargeError: the header claims more than ``max_bytes`` of data (see ``check_size``).
    """
    buf = memoryview(body).cast("B")
    header, data_start = _npy_header(buf)
    descr = header["descr"]
    if not isinstance(descr, str):
        raise InvalidInputError("structured .npy arrays are not supported; send one float16/float32/float64 array")
    if descr.endswith("O"):
        raise InvalidInputError(".npy object arrays are refused (they would need unpickling); send a float array")
    order, code = descr[:1], descr[1:]
    if order not in ("<", "=") or code not in _NPY_DTYPES:
        raise InvalidInputError(f".npy dtype {descr!r} is not supported; send little-endian float16, float32 "
                                "or float64 (bfloat16: use safetensors)")
    dtype = _NPY_DTYPES[code]
    fortran = header["fortran_order"]
    if not isinstance(fortran, bool):
        raise MalformedBodyError(".npy header's fortran_order must be True or False")
    shape = _check_shape(header["shape"], ".npy")
    need = check_size(shape, dtype.itemsize, ".npy", max_bytes)
    have = len(buf) - data_start
    if have != need:
        raise MalformedBodyError(f".npy data holds {have} bytes but shape {list(shape)} of {descr} needs {need}")
    if not fortran or len(shape) < 2:  # a 0-d or 1-d array lies the same in both orders
        return RawTensor(buf[data_start:], dtype, shape)
    # Fortran order: the data is the transpose laid out in C order; a transposed view, still no copy.
    return view_tensor(buf, data_start, dtype, shape[::-1]).permute(*reversed(range(len(shape))))


def encode_npy(t: AnyTensor) -> bytes:
    """``t`` as a version 1.0 ``.npy`` file (C order, little-endian). float16/32/64 only."""
    descr = _NPY_DESCR.get(t.dtype)
    if descr is None:
        raise UnsupportedMediaTypeError(f"{DTYPE_NAMES.get(t.dtype, t.dtype)} cannot be written as .npy; "
                                   f"accept {SAFETENSORS} instead")
    shape = tuple(t.shape)
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape!r}, }}"
    # Pad so that magic + length + header + newline is a multiple of 64 (numpy's alignment).
    pad = -(10 + len(text) + 1) % 64
    header = NPY_MAGIC + b"\x01\x00" + struct.pack("<H", len(text) + pad + 1) + text.encode() + b" " * pad + b"\n"
    return b"".join((header, bytes_of(t)))


# --- safetensors ----------------------------------------------------------------------------------------------


def decode_safetensors(body: BufferLike, max_bytes: int | None = None) -> torch.Tensor:
    """Decode a safetensors body holding exactly one tensor (F16, BF16, F32, F64) without copying (see
    ``decode_safetensors_raw``)."""
    return decode_safetensors_raw(body, max_bytes).tensor()


def decode_safetensors_raw(body: BufferLike, max_bytes: int | None = None) -> RawTensor:
    """Decode a safetensors body holding exactly one tensor (F16, BF16, F32, F64) into a ``RawTensor`` over
    ``body``'s bytes.

    Raises:
        MalformedBodyError: not safetensors, truncated, inconsistent offsets, or not exactly one tensor.
        InvalidInputError: a dtype the service does not compute in.
        PayloadTooLargeError: the header claims more than ``max_bytes`` of data (see ``check_size``).
    """
    buf = memoryview(body).cast("B")
    if len(buf) < 8:
        raise MalformedBodyError("body is not safetensors (shorter than its 8-byte header length)")
    (hlen,) = struct.unpack_from("<Q", buf, 0)
    if len(buf) > 8 and buf[8] != ord("{"):
        raise MalformedBodyError("body is not safetensors (its JSON header does not follow the 8-byte length)")
    if hlen > MAX_HEADER_BYTES or 8 + hlen > len(buf):
        raise MalformedBodyError(f"safetensors header length {hlen} is invalid for a body of {len(buf)} bytes")
    try:
        header = json.loads(bytes(buf[8 : 8 + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise MalformedBodyError("safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise MalformedBodyError("safetensors header must be a JSON object")
    header.pop("__metadata__", None)
    if len(header) != 1:
        raise MalformedBodyError(f"safetensors body holds {len(header)} tensors; send exactly one")
    (name, info), = header.items()
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise MalformedBodyError(f"safetensors tensor {name!r} needs dtype, shape and data_offsets")
    dtype = ST_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise InvalidInputError(f"safetensors dtype {info['dtype']!r} is not supported; send F16, BF16, F32 or F64")
    shape = _check_shape(info["shape"], f"safetensors tensor {name!r}")
    offsets = info["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(
            isinstance(o, int) and not isinstance(o, bool) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise MalformedBodyError(f"safetensors tensor {name!r}: data_offsets must be [begin, end], got {offsets!r}")
    begin, end = offsets
    need = check_size(shape, dtype.itemsize, f"safetensors tensor {name!r}", max_bytes)
    if end - begin != need:
        raise MalformedBodyError(f"safetensors tensor {name!r}: {end - begin} bytes, shape {list(shape)} needs {need}")
    data_start = 8 + hlen
    if data_start + end != len(buf):
        raise MalformedBodyError(f"safetensors body is {len(buf)} bytes, the header describes {data_start + end}")
    return RawTensor(buf[data_start + begin:data_start + end], dtype, shape)


def encode_safetensors(t: AnyTensor, name: str = "output") -> bytes:
    """``t`` as a safetensors file holding one tensor called ``name``."""
    data = bytes_of(t)
    header = {name: {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [0, len(data)]}}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keep the data 8-byte aligned
    return b"".join((struct.pack("<Q", len(text)), text, data))


# --- dispatch by media type -----------------------------------------------------------------------------------


def media_type_of(content_type: str | None) -> str:
    """The canonical media type of a Content-Type header value (parameters dropped).

    Raises:
        UnsupportedMediaTypeError: missing or not one of the two tensor formats.
    """
    base = (content_type or "").split(";", 1)[0].strip().lower()
    if base in MEDIA_TYPES:
        return base
    shown = repr(content_type) if content_type else "missing"
    raise UnsupportedMediaTypeError(f"Content-Type {shown} is not supported; send {NPY} or {SAFETENSORS}")


def negotiate(accept: str | None, request_type: str) -> str:
    """The response media type: the request's unless ``Accept`` names the other format.

    Raises:
        UnsupportedMediaTypeError: ``Accept`` admits neither format.
    """
    if not accept or not accept.strip():
        return request_type
    ranked: list[tuple[float, int, str]] = []
    for i, part in enumerate(accept.split(",")):
        fields = [f.strip() for f in part.split(";")]
        media, q = fields[0].lower(), 1.0
        for f in fields[1:]:
            if f.lower().startswith("q="):
                try:
                    q = float(f[2:])
                except ValueError:
                    q = 0.0
        if q > 0 and media:
            ranked.append((-q, i, media))
    for _, _, media in sorted(ranked):
        if media in MEDIA_TYPES:
            return media
        if media in ("*/*", "application/*"):
            return request_type
    raise UnsupportedMediaTypeError(f"Accept {accept!r} admits neither {NPY} nor {SAFETENSORS}")


def decode(body: BufferLike, media_type: str, max_bytes: int | None = None) -> torch.Tensor:
    """Decode ``body`` in ``media_type`` (one of ``MEDIA_TYPES``); ``max_bytes`` bounds the tensor's claimed size."""
    return as_tensor(decode_raw(body, media_type, max_bytes))


def decode_raw(body: BufferLike, media_type: str, max_bytes: int | None = None) -> AnyTensor:
    """``decode`` without making a torch tensor: a ``RawTensor`` over ``body``'s bytes (a Fortran-order .npy of
    rank 2 or more: a torch view).

    Raises:
        MalformedBodyError: the body is empty, or not a valid file of ``media_type``.
    """
    if not len(memoryview(body)):
        kind = ".npy" if media_type == NPY else "safetensors"
        raise MalformedBodyError(f"the request body is empty: send one tensor as {kind}")
    return decode_npy_raw(body, max_bytes) if media_type == NPY else decode_safetensors_raw(body, max_bytes)


def encode(t: AnyTensor, media_type: str) -> bytes:
    """Encode ``t`` in ``media_type`` (one of ``MEDIA_TYPES``)."""
    return encode_npy(t) if media_type == NPY else encode_safetensors(t)
