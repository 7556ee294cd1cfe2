"""The service's two tensor wire formats, written and read by hand: ``.npy`` and safetensors.

Neither direction copies the tensor's data in Python: encoding yields the small header followed by
``memoryview`` slices of the array's own buffer, and decoding wraps the received buffer with
``numpy.frombuffer`` after checking the header's size against the bytes actually there. Decode from a
``bytearray`` and the arrays you get back are writable; decode from ``bytes`` and they are read-only views.

Nothing here ever unpickles: ``.npy`` headers are parsed with :func:`ast.literal_eval` (literals only) and object,
structured, string and datetime dtypes are refused. Only the ``safetensors`` *format* is implemented, not the
package: an 8-byte little-endian header length, a JSON header, then the raw little-endian bytes.
"""

from __future__ import annotations

import ast
import json
import math
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .errors import CodecError

__all__ = [
    "NPY_MEDIA_TYPE",
    "SAFETENSORS_MEDIA_TYPE",
    "Payload",
    "RawTensor",
    "decode_npy",
    "decode_safetensors",
    "encode_npy",
    "encode_safetensors",
    "encode_safetensors_array",
    "media_type_of",
    "numpy_dtype_for",
    "safetensors_dtype_for",
]

NPY_MEDIA_TYPE = "application/x-npy"
SAFETENSORS_MEDIA_TYPE = "application/vnd.safetensors"

_NPY_MAGIC = b"\x93NUMPY"
# numpy's own default limit for a header it is willing to parse (numpy.lib.format, max_header_size).
_NPY_MAX_HEADER = 10_000
_NPY_ALIGN = 64
# safetensors' reference implementation refuses headers over 100 MB; one tensor needs far less.
_ST_MAX_HEADER = 1 << 20
_ST_ALIGN = 8
# Bodies go out in slices of this size: zero-copy views, and a bound on what a transport copies at once.
_CHUNK = 1 << 20
# numpy dtype kinds that have a plain little-endian byte layout: bool, signed, unsigned, float, complex.
_PLAIN_KINDS = "biufc"

_ST_TO_NUMPY: dict[str, str | None] = {
    "BOOL": "|b1",
    "U8": "|u1",
    "I8": "|i1",
    "U16": "<u2",
    "I16": "<i2",
    "U32": "<u4",
    "I32": "<i4",
    "U64": "<u8",
    "I64": "<i8",
    "F16": "<f2",
    "BF16": None,  # no numpy dtype; torch decodes it
    "F32": "<f4",
    "F64": "<f8",
}
_ST_ITEMSIZE = {code: 2 if descr is None else np.dtype(descr).itemsize for code, descr in _ST_TO_NUMPY.items()}
_NUMPY_TO_ST = {np.dtype(v): k for k, v in _ST_TO_NUMPY.items() if v is not None}


@dataclass(frozen=True)
class Payload:
    """An encoded body: ``chunks`` (header bytes, then views of the tensor's buffer) and its media type.

    The views keep the source array alive; do not modify the array until the payload has been sent.
    """

    chunks: tuple[bytes | memoryview, ...]
    media_type: str
    nbytes: int

    def __iter__(self) -> Iterator[bytes | memoryview]:
        return iter(self.chunks)

    def tobytes(self) -> bytes:
        """The whole body as one ``bytes`` object (this one copies)."""
        return b"".join(self.chunks)


@dataclass(frozen=True)
class RawTensor:
    """One tensor as raw C-order little-endian bytes, named by its safetensors dtype code.

    Attributes:
        dtype: ``"F32"``, ``"F16"``, ``"BF16"``, ``"F64"``, ``"I64"``, ... (safetensors' codes).
        shape: the tensor's shape.
        data: exactly ``prod(shape) * itemsize`` C-contiguous bytes (a view of the buffer it came from).
        name: the tensor's name in a safetensors file.
    """

    dtype: str
    shape: tuple[int, ...]
    data: memoryview
    name: str = "tensor"

    def to_numpy(self) -> np.ndarray:
        """A numpy view of :attr:`data` (no copy); raises :class:`CodecError` for BF16, which numpy lacks."""
        np_dtype = numpy_dtype_for(self.dtype)
        if math.prod(self.shape) == 0:
            return np.empty(self.shape, dtype=np_dtype)
        return np.frombuffer(self.data, dtype=np_dtype).reshape(self.shape)


def numpy_dtype_for(code: str) -> np.dtype:
    """The little-endian numpy dtype of a safetensors dtype code (:class:`CodecError` if there is none)."""
    if code not in _ST_TO_NUMPY:
        raise CodecError(f"unsupported safetensors dtype {code!r}")
    descr = _ST_TO_NUMPY[code]
    if descr is None:
        raise CodecError(f"safetensors dtype {code} has no numpy equivalent; use torch tensors for it")
    return np.dtype(descr)


def safetensors_dtype_for(dtype: np.dtype) -> str:
    """The safetensors dtype code of a numpy dtype (any byte order), e.g. ``float32`` -> ``"F32"``."""
    code = _NUMPY_TO_ST.get(np.dtype(dtype).newbyteorder("<"))
    if code is None:
        raise CodecError(f"dtype {np.dtype(dtype)} cannot be sent as safetensors")
    return code


def media_type_of(content_type: str | None, body: bytes | bytearray | memoryview) -> str:
    """The tensor format of a body: from its ``Content-Type`` if it names one, else from its first bytes."""
    if content_type:
        base = content_type.split(";", 1)[0].strip().lower()
        if base in (NPY_MEDIA_TYPE, SAFETENSORS_MEDIA_TYPE):
            return base
    if bytes(memoryview(body)[: len(_NPY_MAGIC)]) == _NPY_MAGIC:
        return NPY_MEDIA_TYPE
    if content_type and content_type.split(";", 1)[0].strip().lower() != "application/octet-stream":
        raise CodecError(f"expected a tensor body, got Content-Type {content_type!r}")
    return SAFETENSORS_MEDIA_TYPE


def _plain(array: np.ndarray) -> np.ndarray:
    """``array`` as C-contiguous little-endian data of a plain dtype, copying only when it is not already."""
    dtype = array.dtype
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in _PLAIN_KINDS:
        raise CodecError(f"dtype {dtype} cannot be sent: only bool, integer, float and complex tensors")
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and not np.little_endian):
        array = array.astype(dtype.newbyteorder("<"))
    # (np.ascontiguousarray would also turn a 0-d array into a 1-d one.)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def _byte_views(array: np.ndarray) -> list[memoryview]:
    """Zero-copy byte slices of a C-contiguous array's buffer."""
    flat = memoryview(array.reshape(-1).view(np.uint8))
    return [flat[i : i + _CHUNK] for i in range(0, len(flat), _CHUNK)]


def encode_npy(array: np.ndarray) -> Payload:
    """Encode an array as ``.npy`` (version 1.0, or 2.0 for a huge header): header bytes + views of its buffer.

    Non-contiguous or big-endian arrays are converted first (the only case that copies).
    """
    array = _plain(np.asarray(array))
    descr = array.dtype.str  # '<f4', '|b1', ...: _plain made it little-endian
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {tuple(array.shape)!r}, }}"
    head = header.encode("latin1")
    # Pad with spaces so that the data starts on a 64-byte boundary, as numpy does; the header ends in '\n'.
    # Version 1.0 has a 2-byte header length; 2.0 (4 bytes) only for a header that does not fit in that.
    version, fmt = (1, "<H") if 10 + len(head) + _NPY_ALIGN < 1 << 16 else (2, "<I")
    prefix_len = 8 + struct.calcsize(fmt)
    pad = -(prefix_len + len(head) + 1) % _NPY_ALIGN
    hlen = len(head) + pad + 1
    prefix = _NPY_MAGIC + bytes([version, 0]) + struct.pack(fmt, hlen)
    first = prefix + head + b" " * pad + b"\n"
    views = _byte_views(array)
    return Payload((first, *views), NPY_MEDIA_TYPE, len(first) + array.nbytes)


# CPython 3.11 before 3.11.8 builds ASTs with interpreter-wide recursion bookkeeping, so ast.literal_eval in two
# threads at once can fail with "SystemError: AST constructor recursion depth mismatch" (CPython gh-106905); the
# SDK decodes from several threads (the CLI's bench, callers' pools), so header parsing takes turns.
_LITERAL_EVAL_LOCK = threading.Lock()


def decode_npy(buffer: bytes | bytearray | memoryview) -> np.ndarray:
    """Decode a ``.npy`` payload into an array that views ``buffer`` (no copy), validating it first.

    Raises :class:`CodecError` for a bad magic/version, a header that is not the expected literal dict,
    a non-plain dtype (object arrays are never unpickled) or a data size that does not match the header.
    """
    mv = memoryview(buffer).cast("B")
    if len(mv) < 10 or bytes(mv[:6]) != _NPY_MAGIC:
        raise CodecError("not a .npy payload (bad magic)")
    major = mv[6]
    if major == 1:
        start, hlen = 10, struct.unpack("<H", mv[8:10])[0]
    elif major in (2, 3):
        if len(mv) < 12:
            raise CodecError("truncated .npy header")
        start, hlen = 12, struct.unpack("<I", mv[8:12])[0]
    else:
        raise CodecError(f"unsupported .npy version {major}.{mv[7]}")
    if hlen > _NPY_MAX_HEADER:
        raise CodecError(f".npy header of {hlen} bytes is over the {_NPY_MAX_HEADER}-byte limit")
    if start + hlen > len(mv):
        raise CodecError("truncated .npy header")
    try:
        text = bytes(mv[start : start + hlen]).decode("utf8" if major == 3 else "latin1")
        with _LITERAL_EVAL_LOCK:
            header = ast.literal_eval(text)
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError) as exc:
        raise CodecError(f"unreadable .npy header: {exc}") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise CodecError("the .npy header must be a dict with exactly 'descr', 'fortran_order' and 'shape'")
    descr, fortran, shape = header["descr"], header["fortran_order"], header["shape"]
    if not isinstance(descr, str):
        raise CodecError("structured .npy dtypes are not supported")
    try:
        dtype = np.dtype(descr)
    except TypeError as exc:
        raise CodecError(f"bad .npy dtype {descr!r}: {exc}") from None
    if dtype.hasobject or dtype.fields is not None or dtype.kind not in _PLAIN_KINDS:
        raise CodecError(f".npy dtype {descr!r} is not allowed (object arrays are never unpickled)")
    if not isinstance(fortran, bool):
        raise CodecError("'fortran_order' must be True or False")
    if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
        raise CodecError(f"bad .npy shape {shape!r}")
    data = mv[start + hlen :]
    count = math.prod(shape)
    if len(data) != count * dtype.itemsize:
        raise CodecError(
            f".npy data is {len(data)} bytes, the header ({descr} {list(shape)}) says {count * dtype.itemsize}"
        )
    if count == 0:
        return np.empty(shape, dtype=dtype)
    flat = np.frombuffer(data, dtype=dtype, count=count)
    return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)


def encode_safetensors(tensor: RawTensor) -> Payload:
    """Encode one tensor as a safetensors payload named ``tensor.name``: header bytes + the data views."""
    if tensor.dtype not in _ST_ITEMSIZE:
        raise CodecError(f"unsupported safetensors dtype {tensor.dtype!r}")
    data = tensor.data.cast("B") if tensor.data.format != "B" else tensor.data
    expected = math.prod(tensor.shape) * _ST_ITEMSIZE[tensor.dtype]
    if len(data) != expected:
        raise CodecError(f"{len(data)} bytes of data for a {tensor.dtype} tensor of shape {list(tensor.shape)}")
    header = {tensor.name: {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [0, expected]}}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % _ST_ALIGN)  # keeps the data 8-byte aligned, as the reference writer does
    first = struct.pack("<Q", len(head)) + head
    views = [data[i : i + _CHUNK] for i in range(0, len(data), _CHUNK)]
    return Payload((first, *views), SAFETENSORS_MEDIA_TYPE, len(first) + expected)


def encode_safetensors_array(array: np.ndarray, name: str = "tensor") -> Payload:
    """Encode a numpy array as a one-tensor safetensors payload (a view of its buffer, no copy)."""
    array = _plain(np.asarray(array))
    code = safetensors_dtype_for(array.dtype)
    flat = memoryview(array.reshape(-1).view(np.uint8))
    return encode_safetensors(RawTensor(code, tuple(array.shape), flat, name))


def decode_safetensors(buffer: bytes | bytearray | memoryview) -> RawTensor:
    """Decode a safetensors payload that holds exactly one tensor, as a view of ``buffer`` (no copy).

    The header must parse as JSON, name exactly one tensor (besides ``__metadata__``) of a known dtype, and its
    ``data_offsets`` must cover the data exactly and match ``prod(shape) * itemsize``; else :class:`CodecError`.
    """
    mv = memoryview(buffer).cast("B")
    if len(mv) < 8:
        raise CodecError("not a safetensors payload (shorter than its 8-byte header length)")
    hlen = struct.unpack("<Q", mv[:8])[0]
    if hlen > _ST_MAX_HEADER:
        raise CodecError(f"safetensors header of {hlen} bytes is over the {_ST_MAX_HEADER}-byte limit")
    if 8 + hlen > len(mv):
        raise CodecError("truncated safetensors header")
    try:
        header = json.loads(bytes(mv[8 : 8 + hlen]))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CodecError(f"unreadable safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise CodecError("the safetensors header must be a JSON object")
    names = [k for k in header if k != "__metadata__"]
    if len(names) != 1:
        raise CodecError(f"expected exactly one tensor in the safetensors payload, found {len(names)}")
    name = names[0]
    info = header[name]
    if not isinstance(info, dict):
        raise CodecError(f"bad safetensors entry for {name!r}")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if code not in _ST_ITEMSIZE:
        raise CodecError(f"unsupported safetensors dtype {code!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CodecError(f"bad safetensors shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CodecError(f"bad safetensors data_offsets {offsets!r}")
    data = mv[8 + hlen :]
    expected = math.prod(shape) * _ST_ITEMSIZE[code]
    if offsets[0] != 0 or offsets[1] != len(data):
        raise CodecError(f"safetensors data_offsets {offsets} do not cover the {len(data)} data bytes exactly")
    if offsets[1] - offsets[0] != expected:
        raise CodecError(f"safetensors data is {len(data)} bytes, {code} {shape} needs {expected}")
    return RawTensor(code, tuple(shape), data, name)
