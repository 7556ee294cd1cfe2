"""Tensor wire formats for the service: ``.npy`` and safetensors, decoded without copies and never unpickled.

The formats themselves (header parsing, the dtype table, size checks, error messages) have one implementation,
``deconv_client.wire``, which the client SDK shares; this module adds the service's side: the dtypes it computes
in, its errors (400/413), and views of the request buffer in place: as a ``RawTensor`` (``decode_raw``, the
service's request path) or a torch tensor (``decode``, ``torch.frombuffer``). Headers claiming more data than
``max_bytes``, or a shape beyond ``MAX_ELEMENTS``, are refused with 413 before anything is allocated. Pass a
writable buffer (``bytearray``) to share it; a read-only one (``bytes``) is shared too, and the tensor must then be
treated as read-only.

Encoding gives a small header and a view of the tensor's bytes (``encode_parts``), which a response writes to the
socket as they are; ``encode`` joins them (one copy of the tensor).
bfloat16 travels only as safetensors: .npy has no bf16 dtype.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import torch
from deconv_client import wire
from deconv_client.wire import (
    MAX_ELEMENTS,
    MAX_HEADER_BYTES,
    NPY_MAGIC,
    WireError,
    npy_header,
    read_npy,
    read_safetensors,
    safetensors_header,
)

from service.errors import (
    InvalidInputError,
    MalformedBodyError,
    PayloadTooLargeError,
    RegionError,
    ServiceError,
    UnsupportedMediaTypeError,
)

__all__ = ["MAX_ELEMENTS", "MAX_HEADER_BYTES", "NPY_MAGIC"]  # the wire's limits, re-exported for the service

NPY = wire.NPY_MEDIA_TYPE
SAFETENSORS = wire.SAFETENSORS_MEDIA_TYPE
MEDIA_TYPES = (NPY, SAFETENSORS)

# The dtypes the service computes in, out of the wire's table (deconv_client.wire.DTYPES).
ST_DTYPES = {code: getattr(torch, wire.DTYPES[code].name) for code in ("F16", "BF16", "F32", "F64")}
_ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
_NPY_DESCR = {dtype: wire.DTYPES[code].descr for code, dtype in ST_DTYPES.items() if wire.DTYPES[code].descr}
_NPY_DTYPES = {order + descr[1:]: dtype for dtype, descr in _NPY_DESCR.items() for order in "<="}
BufferLike = bytes | bytearray | memoryview

DTYPE_NAMES = {dtype: wire.DTYPES[code].name for code, dtype in ST_DTYPES.items()}

_ERRORS: dict[str, type[ServiceError]] = {
    "malformed": MalformedBodyError, "dtype": InvalidInputError, "too_large": PayloadTooLargeError,
}


def _service_error(exc: WireError) -> ServiceError:
    """The service's error (400, 400 or 413) for a refusal of the wire format."""
    return _ERRORS[exc.kind](str(exc))


def _check_rank(shape: tuple[int, ...], where: str) -> tuple[int, ...]:
    if len(shape) > 8:
        raise InvalidInputError(f"{where}: a tensor of rank {len(shape)}; expected [N, C, H, W] or [C, H, W]")
    return shape


def check_size(shape: Sequence[int], itemsize: int, where: str, max_bytes: int | None = None) -> int:
    """The data bytes a tensor of ``shape`` needs, checked before anything is allocated (``wire.check_size``).

    Raises:
        PayloadTooLargeError: the shape spans more than ``MAX_ELEMENTS`` elements, or needs more than
            ``max_bytes`` bytes (413).
    """
    try:
        return wire.check_size(shape, itemsize, where, max_bytes)
    except WireError as exc:
        raise _service_error(exc) from None


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


def raw_view(data: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> RawTensor:
    """``RawTensor(data, dtype, shape)`` without its size check, for a caller that cut ``data`` to the size of
    ``shape`` itself (the engine's frame decoder, once per request)."""
    t = RawTensor.__new__(RawTensor)
    t.data, t.dtype, t.shape = data, dtype, shape
    return t


class SlotTensor(RawTensor):
    """A request's input whose output is to be written into ``out`` (exactly the output's bytes): the request's
    slot in an HTTP process's shared arena (``service.ipc.shm``), where the input is too. ``pinned``: the arena is
    page-locked for the GPUs (``service.engine.ops.HostPin``), which then copy to and from the slot directly."""

    __slots__ = ("out", "pinned")

    def __init__(self, data: memoryview, dtype: torch.dtype, shape: tuple[int, ...], out: memoryview,
                 pinned: bool = False) -> None:
        super().__init__(data, dtype, shape)
        self.out = out
        self.pinned = pinned

    @classmethod
    def of(cls, x: RawTensor, out: memoryview, pinned: bool = False) -> SlotTensor:
        """``x`` (checked when it was made) with its output's place ``out``: the engine makes one per request."""
        t = cls.__new__(cls)
        t.data, t.dtype, t.shape, t.out, t.pinned = x.data, x.dtype, x.shape, out, pinned
        return t


class _Described:
    """What a tensor known by its dtype and shape alone answers (``SourceTensor``, ``DeviceTensor``)."""

    __slots__ = ()
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def element_size(self) -> int:
        """Bytes per element, as ``torch.Tensor.element_size``."""
        return self.dtype.itemsize


class SourceTensor(_Described):
    """A request's input still at its source (a client's shared-memory region, checked): ``fill`` copies its
    bytes into a buffer of exactly ``nbytes``, so that they can go straight to where they are needed (a slot of
    the engine link's arena) instead of through a copy of their own; ``load`` is that copy, as a ``RawTensor``."""

    __slots__ = ("dtype", "fill", "shape")

    def __init__(self, fill: Callable[[memoryview], None], dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.fill = fill
        self.dtype = dtype
        self.shape = shape

    def reshape(self, shape: tuple[int, ...]) -> SourceTensor:
        """The same bytes as ``shape`` (same number of elements)."""
        return SourceTensor(self.fill, self.dtype, shape)

    def load(self) -> RawTensor:
        """The bytes, copied out of their source."""
        data = memoryview(bytearray(self.nbytes))
        self.fill(data)
        return RawTensor(data, self.dtype, self.shape)


class DeviceTensor(_Described):
    """A tensor in a client's shared-memory region that the engine maps, by reference: the registration it lies in
    (``token``, ``service.http.shm_regions``), that region's GPU (-1: a system region the engine page-locked, for
    any GPU), the byte offset in the region, dtype and shape. Only the engine's GPU worker touches the bytes
    (``service.engine.cuda_shm``); as a result, the place the output was written to."""

    __slots__ = ("device", "dtype", "offset", "shape", "token")

    def __init__(self, token: str, device: int, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.token = token
        self.device = device
        self.offset = offset
        self.dtype = dtype
        self.shape = shape

    def reshape(self, shape: tuple[int, ...]) -> DeviceTensor:
        """The same bytes as ``shape`` (same number of elements)."""
        return DeviceTensor(self.token, self.device, self.offset, self.dtype, shape)


class CudaJob:
    """A request with a tensor in shared memory the engine maps: its input ``x`` (in a region, or host bytes) and
    where its output goes (``out``: a region, or None for the host as usual). ``device``: the GPU whose worker runs
    it, its CUDA regions' GPU, or -1 (any GPU) when its regions are all system regions the engine page-locked. Shape
    and dtype are the input's, as for any request.

    Raises:
        RegionError: the input and the output lie on different GPUs, or neither is in a region.
    """

    __slots__ = ("device", "out", "x")

    def __init__(self, x: AnyTensor | DeviceTensor, out: DeviceTensor | None) -> None:
        regions = [t for t in (x, out) if isinstance(t, DeviceTensor)]
        if not regions:
            raise RegionError("a shared-memory request names no region the engine maps")
        devices = {t.device for t in regions if t.device >= 0}
        if len(devices) > 1:
            raise RegionError(f"the input's and the output's CUDA shared-memory regions lie on GPUs "
                              f"{sorted(devices)}; use regions of one GPU")
        self.x = x
        self.out = out
        self.device = devices.pop() if devices else -1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def element_size(self) -> int:
        """Bytes per element, as ``torch.Tensor.element_size``."""
        return self.x.dtype.itemsize

    def reshape(self, shape: tuple[int, ...]) -> CudaJob:
        """The same request with its input as ``shape``."""
        return CudaJob(self.x.reshape(shape), self.out)


AnyTensor = torch.Tensor | RawTensor
"""A request's input or output: a torch tensor, or a ``RawTensor`` (the HTTP path and the engine process keep
requests as these: a torch tensor per request costs more CPU than the rest of its decoding)."""


def as_tensor(t: AnyTensor) -> torch.Tensor:
    """``t`` as a torch tensor (a view of a ``RawTensor``'s bytes)."""
    return t.tensor() if isinstance(t, RawTensor) else t


def bytes_of(t: AnyTensor) -> memoryview:
    """The bytes of ``t`` in C order (see ``tensor_bytes``)."""
    return t.data if isinstance(t, RawTensor) else tensor_bytes(t)


# Copies of at least this many bytes go through torch, whose CPU copy runs on its intra-op threads with the GIL
# released; smaller ones are a memoryview assignment (one thread, under the GIL, ~10 us less a call).
PARALLEL_COPY_BYTES = 1 << 20


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` for two writable byte views of one size, on several threads and without the GIL when
    large (a GPU worker's megabyte outputs into their slots: one thread copied 2-5 GB/s, bench/NOTES.md)."""
    if src.nbytes < PARALLEL_COPY_BYTES:
        dst[:] = src
        return
    torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))


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


def decode_npy(body: BufferLike, max_bytes: int | None = None) -> torch.Tensor:
    """Decode a ``.npy`` body (format 1.0, 2.0 or 3.0) into a tensor that shares ``body``'s memory (see
    ``decode_npy_raw``)."""
    return as_tensor(decode_npy_raw(body, max_bytes))


def decode_npy_raw(body: BufferLike, max_bytes: int | None = None) -> AnyTensor:
    """Decode a ``.npy`` body (format 1.0, 2.0 or 3.0) into a ``RawTensor`` over ``body``'s bytes (a Fortran-order
    array of rank 2 or more: a transposed torch view of them).

    The wire format is read by ``deconv_client.wire.read_npy``; the service takes little-endian float16, float32
    and float64 in C or Fortran order, and refuses object arrays (which would need pickle) and every other dtype.

    Raises:
        MalformedBodyError: not a .npy file, truncated, or the byte count does not match the shape.
        InvalidInputError: a dtype the service does not compute in.
        PayloadTooLargeError: the header claims more than ``max_bytes`` of data (see ``check_size``).
    """
    try:
        descr, fortran, shape, _, data = read_npy(body, max_bytes)
    except WireError as exc:
        raise _service_error(exc) from None
    dtype = _NPY_DTYPES.get(descr)
    if dtype is None:
        raise InvalidInputError(f".npy dtype {descr!r} is not supported; send little-endian float16, float32 "
                                "or float64 (bfloat16: use safetensors)")
    _check_rank(shape, ".npy")
    if not fortran or len(shape) < 2:  # a 0-d or 1-d array lies the same in both orders
        return RawTensor(data, dtype, shape)
    # Fortran order: the data is the transpose laid out in C order; a transposed view, still no copy.
    return view_tensor(data, 0, dtype, shape[::-1]).permute(*reversed(range(len(shape))))


def encode_npy(t: AnyTensor) -> bytes:
    """``t`` as a ``.npy`` file (C order, little-endian, ``wire.npy_header``). float16/32/64 only."""
    return b"".join(npy_parts(t))


def npy_parts(t: AnyTensor) -> tuple[bytes, memoryview]:
    """``encode_npy(t)`` as its header and a view of ``t``'s bytes, not joined (a response writes them as they are)."""
    descr = _NPY_DESCR.get(t.dtype)
    if descr is None:
        raise UnsupportedMediaTypeError(f"{DTYPE_NAMES.get(t.dtype, t.dtype)} cannot be written as .npy; "
                                        f"accept {SAFETENSORS} instead")
    return npy_header(descr, t.shape), bytes_of(t)


# --- safetensors ----------------------------------------------------------------------------------------------


def decode_safetensors(body: BufferLike, max_bytes: int | None = None) -> torch.Tensor:
    """Decode a safetensors body holding exactly one tensor (F16, BF16, F32, F64) without copying (see
    ``decode_safetensors_raw``)."""
    return decode_safetensors_raw(body, max_bytes).tensor()


def decode_safetensors_raw(body: BufferLike, max_bytes: int | None = None) -> RawTensor:
    """Decode a safetensors body holding exactly one tensor (F16, BF16, F32, F64) into a ``RawTensor`` over
    ``body``'s bytes (the format is read by ``deconv_client.wire.read_safetensors``).

    Raises:
        MalformedBodyError: not safetensors, truncated, inconsistent offsets, or not exactly one tensor.
        InvalidInputError: a dtype the service does not compute in.
        PayloadTooLargeError: the header claims more than ``max_bytes`` of data (see ``check_size``).
    """
    try:
        name, wire_dtype, shape, data = read_safetensors(body, max_bytes)
    except WireError as exc:
        raise _service_error(exc) from None
    dtype = ST_DTYPES.get(wire_dtype.code)
    if dtype is None:
        raise InvalidInputError(f"safetensors dtype {wire_dtype.code!r} is not supported; send F16, BF16, F32 or F64")
    return RawTensor(data, dtype, _check_rank(shape, f"safetensors tensor {name!r}"))


def encode_safetensors(t: AnyTensor, name: str = "output") -> bytes:
    """``t`` as a safetensors file holding one tensor called ``name`` (``wire.safetensors_header``)."""
    return b"".join(safetensors_parts(t, name))


def safetensors_parts(t: AnyTensor, name: str = "output") -> tuple[bytes, memoryview]:
    """``encode_safetensors(t, name)`` as its header and a view of ``t``'s bytes, not joined."""
    data = bytes_of(t)
    return safetensors_header(name, _ST_NAMES[t.dtype], t.shape, data.nbytes), data


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
    return b"".join(encode_parts(t, media_type))


def encode_parts(t: AnyTensor, media_type: str) -> tuple[bytes, memoryview]:
    """``encode(t, media_type)`` as its header and a view of ``t``'s bytes: a response body written as these two
    parts costs no copy of the tensor before the socket."""
    return npy_parts(t) if media_type == NPY else safetensors_parts(t)
