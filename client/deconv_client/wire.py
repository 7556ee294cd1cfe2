"""The tensor wire formats, ``.npy`` and safetensors: the one implementation that the client and the server share.

This module reads and writes the *headers* and checks them against the bytes actually there; it never touches
the tensor data, so it needs nothing beyond the standard library (no numpy, no torch, no httpx): the client views
the data with numpy (``deconv_client.codec``), the server with torch (``service.codec``), both without copies.

Reading a body gives its dtype, shape, layout and a ``memoryview`` of exactly its data bytes, after checking, in
this order and before anything is allocated: the header's framing and length, the header itself (``.npy``: numpy's
canonical layout matched by a regular expression, any other spelling by ``ast.literal_eval``; safetensors: JSON),
the dtype, the shape, the size the shape claims (``MAX_ELEMENTS`` and the caller's ``max_bytes``) and that the data
bytes match it exactly. Nothing here ever unpickles: object, structured, string and datetime dtypes are refused.

Every refusal is a ``WireError`` whose ``kind`` says why: ``"malformed"`` (not a valid file of the format),
``"dtype"`` (a dtype the format or this module does not carry) or ``"too_large"`` (the header claims too much);
each side turns it into its own error (``CodecError`` in the client; 400, 400 and 413 in the server).
"""

from __future__ import annotations

import ast
import json
import math
import re
import struct
import threading
from collections.abc import Sequence
from typing import Literal, NamedTuple

__all__ = [
    "DTYPES",
    "MAX_ELEMENTS",
    "MAX_HEADER_BYTES",
    "NPY_MAGIC",
    "NPY_MEDIA_TYPE",
    "SAFETENSORS_MEDIA_TYPE",
    "DType",
    "WireError",
    "check_data",
    "check_size",
    "npy_header",
    "read_npy",
    "read_safetensors",
    "safetensors_header",
]

NPY_MEDIA_TYPE = "application/x-npy"
SAFETENSORS_MEDIA_TYPE = "application/vnd.safetensors"

NPY_MAGIC = b"\x93NUMPY"
NPY_ALIGN = 64  # numpy pads headers so that the data starts on a 64-byte boundary
ST_ALIGN = 8  # the reference safetensors writer keeps the data 8-byte aligned
MAX_HEADER_BYTES = 1 << 16  # a one-tensor header is a few hundred bytes; refuse to parse anything huge
# Most elements a shape may span, counting a zero dimension as 1: keeps stride arithmetic (int64) far from
# overflowing even for empty tensors such as [0, 16, 10**18, 10**18].
MAX_ELEMENTS = 1 << 48


class DType(NamedTuple):
    """One dtype of the wire: its safetensors code, bytes per element, ``.npy`` descr and numpy/torch name."""

    code: str
    itemsize: int
    descr: str | None  # little-endian .npy descr; None: .npy cannot carry it
    name: str


# The dtype table: every dtype either format carries here (complex travels as .npy only, bfloat16 as
# safetensors only).
DTYPES: dict[str, DType] = {d.code: d for d in (
    DType("BOOL", 1, "|b1", "bool"),
    DType("U8", 1, "|u1", "uint8"),
    DType("I8", 1, "|i1", "int8"),
    DType("U16", 2, "<u2", "uint16"),
    DType("I16", 2, "<i2", "int16"),
    DType("U32", 4, "<u4", "uint32"),
    DType("I32", 4, "<i4", "int32"),
    DType("U64", 8, "<u8", "uint64"),
    DType("I64", 8, "<i8", "int64"),
    DType("F16", 2, "<f2", "float16"),
    DType("BF16", 2, None, "bfloat16"),
    DType("F32", 4, "<f4", "float32"),
    DType("F64", 8, "<f8", "float64"),
)}
# .npy type codes (the descr without its byte-order character) and their sizes; c8/c16 have no safetensors code.
_NPY_ITEMSIZE = {d.descr[1:]: d.itemsize for d in DTYPES.values() if d.descr is not None} | {"c8": 8, "c16": 16}
_SINGLE_BYTE = {"b1", "u1", "i1"}

Kind = Literal["malformed", "dtype", "too_large"]


class WireError(ValueError):
    """A body that is not a valid one-tensor file of its format, or a tensor the format cannot carry."""

    def __init__(self, message: str, kind: Kind = "malformed") -> None:
        super().__init__(message)
        self.kind: Kind = kind


def check_size(shape: Sequence[int], itemsize: int, where: str, max_bytes: int | None = None) -> int:
    """The data bytes a tensor of ``shape`` needs, checked before anything is allocated.

    Raises:
        WireError: (``"too_large"``) the shape spans more than ``MAX_ELEMENTS`` elements, or needs more than
            ``max_bytes`` bytes.
    """
    if math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS:
        raise WireError(f"{where}: shape {list(shape)} is larger than any tensor this service accepts", "too_large")
    need = math.prod(shape) * itemsize
    if max_bytes is not None and need > max_bytes:
        raise WireError(f"{where}: shape {list(shape)} needs {need} bytes, over the limit of {max_bytes} bytes",
                        "too_large")
    return need


def _shape(shape: object, types: type | tuple[type, ...], what: str) -> tuple[int, ...]:
    if not isinstance(shape, types) or not all(type(d) is int and d >= 0 for d in shape):
        raise WireError(f"bad {what} shape {shape!r}: it must be a list of non-negative integers")
    return tuple(shape)


# --- .npy -----------------------------------------------------------------------------------------------------


# The header exactly as numpy (and every writer copying it, ours included) lays it out, e.g.
# "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 16, 16, 16), }" plus padding. Matching it is about 30x
# cheaper than ast.literal_eval, which costs ~30 us per request; any other spelling still goes to literal_eval.
_NPY_CANONICAL = re.compile(
    r"\{'descr': '([^'\\]*)', 'fortran_order': (True|False), "
    r"'shape': \((|(?:0|[1-9][0-9]*),|(?:0|[1-9][0-9]*)(?:, (?:0|[1-9][0-9]*))+)\), \}[ \n]*")

# CPython 3.11 before 3.11.8 builds ASTs with interpreter-wide recursion bookkeeping, so ast.literal_eval in two
# threads at once can fail with "SystemError: AST constructor recursion depth mismatch" (CPython gh-106905); both
# the SDK (the CLI's bench, callers' pools) and the server decode from several threads, so literal_eval takes turns.
_LITERAL_EVAL_LOCK = threading.Lock()


def _npy_canonical_header(text: str) -> dict[str, object] | None:
    # The same dict as ast.literal_eval(text) when text is in numpy's canonical layout, else None.
    m = _NPY_CANONICAL.fullmatch(text)
    if m is None:
        return None
    descr, fortran, dims = m.groups()
    shape = tuple(int(d) for d in dims.split(",") if d)
    return {"descr": descr, "fortran_order": fortran == "True", "shape": shape}


def _npy_header_span(buf: memoryview) -> tuple[int, int]:
    # (where the header text starts, its length), the magic, version and length checked.
    if len(buf) < 10 or bytes(buf[:6]) != NPY_MAGIC:
        raise WireError("body is not a .npy file (bad magic: missing the \\x93NUMPY magic)")
    major = buf[6]
    if major == 1:
        (hlen,), start = struct.unpack_from("<H", buf, 8), 10
    elif major in (2, 3):
        if len(buf) < 12:
            raise WireError(".npy header is truncated")
        (hlen,), start = struct.unpack_from("<I", buf, 8), 12
    else:
        raise WireError(f".npy format version {major}.{buf[7]} is not supported (1.0, 2.0, 3.0 are)")
    if hlen > MAX_HEADER_BYTES:
        raise WireError(f".npy header of {hlen} bytes is over the {MAX_HEADER_BYTES}-byte limit")
    if start + hlen > len(buf):
        raise WireError(".npy header is truncated")
    return start, hlen


def _npy_header_dict(buf: memoryview, start: int, hlen: int) -> dict[str, object]:
    try:
        text = bytes(buf[start : start + hlen]).decode("utf-8" if buf[6] == 3 else "latin1")
        header = _npy_canonical_header(text)
        if header is None:
            with _LITERAL_EVAL_LOCK:
                header = ast.literal_eval(text)  # literals only: no names, no calls, no unpickling
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
        raise WireError("unreadable .npy header: not a valid dict literal") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise WireError(".npy header must be a dict with exactly 'descr', 'fortran_order' and 'shape'")
    return header


def _npy_header(buf: memoryview, start: int, hlen: int) -> tuple[str, bool, tuple[int, ...], int, int]:
    # (descr, fortran_order, shape, itemsize, data bytes) of a header that is one of the accepted ones.
    header = _npy_header_dict(buf, start, hlen)
    descr = header["descr"]
    if not isinstance(descr, str):
        raise WireError("structured .npy arrays are not supported; send one plain array", "dtype")
    if descr.endswith("O"):
        raise WireError(".npy object arrays are refused (object arrays are never unpickled); send a plain array",
                        "dtype")
    order, code = descr[:1], descr[1:]
    itemsize = _NPY_ITEMSIZE.get(code)
    if itemsize is None or order not in ("<", ">", "=", "|") or (order == "|" and code not in _SINGLE_BYTE):
        raise WireError(f".npy dtype {descr!r} is not allowed: send bool, integer, float or complex data (object "
                        "arrays are never unpickled)", "dtype")
    fortran = header["fortran_order"]
    if not isinstance(fortran, bool):
        raise WireError(".npy header's fortran_order must be True or False")
    shape = _shape(header["shape"], tuple, ".npy")
    return descr, fortran, shape, itemsize, check_size(shape, itemsize, ".npy")


# Headers read lately (their bytes, magic to padding) -> what they say: a server reads the same few headers on
# every request (~5 us each in _npy_header). Bounded: emptied when full.
_NPY_HEADERS: dict[bytes, tuple[str, bool, tuple[int, ...], int, int]] = {}
_NPY_HEADERS_MAX = 256


def read_npy(
    body: bytes | bytearray | memoryview, max_bytes: int | None = None
) -> tuple[str, bool, tuple[int, ...], int, memoryview]:
    """Check a ``.npy`` body (format 1.0, 2.0 or 3.0) and find its data, without copying it.

    Returns ``(descr, fortran_order, shape, itemsize, data)``: e.g. ``'<f4'``, and exactly the data bytes.

    Accepts bool, integer, float and complex dtypes in either byte order, C or Fortran order.

    Raises:
        WireError: not a .npy file, truncated, a header that is not the expected literal dict, a dtype that is not
            plain (object arrays are never unpickled), a claim over ``max_bytes`` (see ``check_size``), or a data
            size that does not match the header.
    """
    buf = memoryview(body).cast("B")
    start, hlen = _npy_header_span(buf)
    data_start = start + hlen
    key = bytes(buf[:data_start])
    known = _NPY_HEADERS.get(key)
    if known is None:
        known = _npy_header(buf, start, hlen)
        if len(_NPY_HEADERS) >= _NPY_HEADERS_MAX:
            _NPY_HEADERS.clear()
        _NPY_HEADERS[key] = known
    descr, fortran, shape, itemsize, need = known
    if max_bytes is not None and need > max_bytes:
        check_size(shape, itemsize, ".npy", max_bytes)  # raises
    have = len(buf) - data_start
    if have != need:
        raise WireError(f".npy data is {have} bytes, the header ({descr} {list(shape)}) says {need}")
    return descr, fortran, shape, itemsize, buf[data_start:]


def npy_header(descr: str, shape: Sequence[int]) -> bytes:
    """The header of a C-order ``.npy`` file (version 1.0, or 2.0 for a huge one), padded as numpy pads it."""
    key = (descr, tuple(shape))
    header = _NPY_WRITTEN.get(key)
    if header is None:
        if len(_NPY_WRITTEN) >= _NPY_HEADERS_MAX:
            _NPY_WRITTEN.clear()
        header = _NPY_WRITTEN[key] = _npy_header_text(descr, shape)
    return header


# Headers written lately: (descr, shape) -> the header (bounded as _NPY_HEADERS).
_NPY_WRITTEN: dict[tuple[str, tuple[int, ...]], bytes] = {}


def _npy_header_text(descr: str, shape: Sequence[int]) -> bytes:
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {tuple(shape)!r}, }}".encode("latin1")
    if len(text) < 1 << 15:  # version 1.0: a 2-byte header length
        pad = -(11 + len(text)) % NPY_ALIGN  # magic, version, length, the header, '\n'
        return NPY_MAGIC + b"\x01\x00" + struct.pack("<H", len(text) + pad + 1) + text + b" " * pad + b"\n"
    pad = -(13 + len(text)) % NPY_ALIGN  # version 2.0 (4-byte length) only for a header too long for 1.0
    return NPY_MAGIC + b"\x02\x00" + struct.pack("<I", len(text) + pad + 1) + text + b" " * pad + b"\n"


# --- safetensors ----------------------------------------------------------------------------------------------


def read_safetensors(
    body: bytes | bytearray | memoryview, max_bytes: int | None = None
) -> tuple[str, DType, tuple[int, ...], memoryview]:
    """Check a safetensors body that holds exactly one tensor and find its data, without copying it.

    Returns ``(name, dtype, shape, data)``: the tensor's name, its row of ``DTYPES``, and exactly its data bytes.

    Only the *format* is implemented, not the package: an 8-byte little-endian header length, a JSON header
    (``__metadata__`` ignored), then the raw little-endian bytes, which ``data_offsets`` must cover exactly.

    Raises:
        WireError: not safetensors, truncated, not exactly one tensor, an unknown dtype, a claim over ``max_bytes``
            (see ``check_size``), or offsets that do not match the shape and the data.
    """
    buf = memoryview(body).cast("B")
    if len(buf) < 8:
        raise WireError("body is not safetensors (shorter than its 8-byte header length)")
    (hlen,) = struct.unpack_from("<Q", buf, 0)
    if hlen > MAX_HEADER_BYTES or 8 + hlen > len(buf):
        if len(buf) > 8 and buf[8] != ord("{"):
            raise WireError("body is not safetensors (its JSON header does not follow the 8-byte length)")
        if hlen > MAX_HEADER_BYTES:
            raise WireError(f"safetensors header of {hlen} bytes is over the {MAX_HEADER_BYTES}-byte limit")
        raise WireError(f"safetensors header is truncated: {hlen} bytes claimed, the body is {len(buf)}")
    try:
        header = json.loads(bytes(buf[8 : 8 + hlen]))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise WireError("unreadable safetensors header: not valid JSON") from None
    if not isinstance(header, dict):
        raise WireError("the safetensors header must be a JSON object")
    names = [k for k in header if k != "__metadata__"]
    if len(names) != 1:
        raise WireError(f"expected exactly one tensor in the safetensors body, found {len(names)}")
    name = names[0]
    info = header[name]
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise WireError(f"safetensors tensor {name!r} needs dtype, shape and data_offsets")
    code, offsets = info["dtype"], info["data_offsets"]
    dtype = DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise WireError(f"unsupported safetensors dtype {code!r}", "dtype")
    shape = _shape(info["shape"], list, "safetensors")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise WireError(f"safetensors tensor {name!r}: bad data_offsets {offsets!r}, expected [begin, end]")
    need = check_size(shape, dtype.itemsize, f"safetensors tensor {name!r}", max_bytes)
    data = buf[8 + hlen :]
    if offsets[0] != 0 or offsets[1] != len(data):
        raise WireError(f"safetensors data_offsets {offsets} do not cover the {len(data)} data bytes exactly")
    if len(data) != need:
        raise WireError(f"safetensors data is {len(data)} bytes, {code} {list(shape)} needs {need}")
    return name, dtype, shape, data


def safetensors_header(name: str, code: str, shape: Sequence[int], nbytes: int) -> bytes:
    """The 8-byte length and JSON header of a one-tensor safetensors file, padded to keep the data aligned.

    ``code`` is a key of ``DTYPES`` and ``nbytes`` is ``prod(shape) * itemsize``: the writer checks its tensor
    (``deconv_client.codec.encode_safetensors`` does, with ``check_data``).
    """
    header = {name: {"dtype": code, "shape": list(shape), "data_offsets": [0, nbytes]}}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % ST_ALIGN)
    return struct.pack("<Q", len(text)) + text


def check_data(code: str, shape: Sequence[int], nbytes: int) -> None:
    """Check that ``nbytes`` of data make a tensor of dtype ``code`` and ``shape``, before writing it.

    Raises:
        WireError: (``"dtype"``) an unknown dtype code, or (``"malformed"``) ``nbytes`` does not match the shape.
    """
    dtype = DTYPES.get(code)
    if dtype is None:
        raise WireError(f"unsupported safetensors dtype {code!r}", "dtype")
    if nbytes != math.prod(shape) * dtype.itemsize:
        raise WireError(f"{nbytes} bytes of data for a {code} tensor of shape {list(shape)}")
