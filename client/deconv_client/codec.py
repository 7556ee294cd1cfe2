"""The service's two tensor wire formats on the client's side: ``.npy`` and safetensors, as numpy arrays.

The formats themselves (header parsing, the dtype table, size checks, error messages) are implemented once, in
:mod:`deconv_client.wire`, which the server shares; this module views the data with numpy. Neither direction
copies the tensor's data in Python: encoding yields the small header followed by ``memoryview`` slices of the
array's own buffer, and decoding wraps the received buffer with ``numpy.frombuffer`` after the header was checked
against the bytes actually there. Decode from a ``bytearray`` and the arrays you get back are writable; decode
from ``bytes`` and they are read-only views. Nothing here ever unpickles.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from . import wire
from .errors import CodecError
from .wire import NPY_MEDIA_TYPE, SAFETENSORS_MEDIA_TYPE, WireError

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

# Bodies go out in slices of this size: zero-copy views, and a bound on what a transport copies at once.
_CHUNK = 1 << 20
# numpy dtype kinds that have a plain little-endian byte layout: bool, signed, unsigned, float, complex.
_PLAIN_KINDS = "biufc"
_NUMPY_TO_ST = {np.dtype(d.descr): d.code for d in wire.DTYPES.values() if d.descr is not None}


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
    dtype = wire.DTYPES.get(code)
    if dtype is None:
        raise CodecError(f"unsupported safetensors dtype {code!r}")
    if dtype.descr is None:
        raise CodecError(f"safetensors dtype {code} has no numpy equivalent; use torch tensors for it")
    return np.dtype(dtype.descr)


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
    if bytes(memoryview(body)[: len(wire.NPY_MAGIC)]) == wire.NPY_MAGIC:
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
    """Encode an array as ``.npy`` (``wire.npy_header``): header bytes + views of its buffer.

    Non-contiguous or big-endian arrays are converted first (the only case that copies).
    """
    array = _plain(np.asarray(array))
    first = wire.npy_header(array.dtype.str, array.shape)  # '<f4', '|b1', ...: _plain made it little-endian
    return Payload((first, *_byte_views(array)), NPY_MEDIA_TYPE, len(first) + array.nbytes)


def decode_npy(buffer: bytes | bytearray | memoryview) -> np.ndarray:
    """Decode a ``.npy`` payload into an array that views ``buffer`` (no copy), validated by ``wire.read_npy``.

    Raises :class:`CodecError` for a bad magic/version, a header that is not the expected literal dict,
    a non-plain dtype (object arrays are never unpickled) or a data size that does not match the header.
    """
    try:
        descr, fortran, shape, _, data = wire.read_npy(buffer)
    except WireError as exc:
        raise CodecError(str(exc)) from None
    dtype = np.dtype(descr)
    if math.prod(shape) == 0:
        return np.empty(shape, dtype=dtype)
    flat = np.frombuffer(data, dtype=dtype)
    return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)


def encode_safetensors(tensor: RawTensor) -> Payload:
    """Encode one tensor as a safetensors payload named ``tensor.name``: header bytes + the data views."""
    data = tensor.data.cast("B") if tensor.data.format != "B" else tensor.data
    try:
        wire.check_data(tensor.dtype, tensor.shape, len(data))
    except WireError as exc:
        raise CodecError(str(exc)) from None
    first = wire.safetensors_header(tensor.name, tensor.dtype, tensor.shape, len(data))
    views = [data[i : i + _CHUNK] for i in range(0, len(data), _CHUNK)]
    return Payload((first, *views), SAFETENSORS_MEDIA_TYPE, len(first) + len(data))


def encode_safetensors_array(array: np.ndarray, name: str = "tensor") -> Payload:
    """Encode a numpy array as a one-tensor safetensors payload (a view of its buffer, no copy)."""
    array = _plain(np.asarray(array))
    code = safetensors_dtype_for(array.dtype)
    flat = memoryview(array.reshape(-1).view(np.uint8))
    return encode_safetensors(RawTensor(code, tuple(array.shape), flat, name))


def decode_safetensors(buffer: bytes | bytearray | memoryview) -> RawTensor:
    """Decode a safetensors payload that holds exactly one tensor, as a view of ``buffer`` (no copy).

    ``wire.read_safetensors`` checks it: the header must parse as JSON, name exactly one tensor (besides
    ``__metadata__``) of a known dtype, and its ``data_offsets`` must cover the data exactly and match
    ``prod(shape) * itemsize``; else :class:`CodecError`.
    """
    try:
        name, dtype, shape, data = wire.read_safetensors(buffer)
    except WireError as exc:
        raise CodecError(str(exc)) from None
    return RawTensor(dtype.code, shape, data, name)
