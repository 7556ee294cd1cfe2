"""Tensors through system shared memory (``Client(..., shared_memory=True)``): the KServe v2 ``systemsharedmemory``
extension, with :mod:`multiprocessing.shared_memory` (no tritonclient).

The client creates POSIX shared-memory objects, registers each once as a region of the server
(``POST /v2/systemsharedmemory/region/{name}/register``) and reuses it: a call copies its input into a free region,
asks ``POST /v2/models/{layer}/infer`` to read the input from there and write the output after it, and copies the
output out. Only the request's JSON crosses the socket. The server must run on the same host (it opens the object
by name under ``/dev/shm``). Regions are unregistered and unlinked by ``close()``/``aclose()``.

``RegionPool`` holds the regions without any I/O to the server, so that ``Client`` and ``AsyncClient`` share it and
only make their HTTP calls their own way.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any
from urllib.parse import quote

import numpy as np

from ._tensor import is_torch_tensor
from .errors import CodecError
from .layers import LayerInfo

ALIGN = 64
MIN_REGION_BYTES = 64 * 2**10
_NUMPY_TYPES = {np.dtype(np.float32): "FP32", np.dtype(np.float16): "FP16", np.dtype(np.float64): "FP64"}


@dataclass(frozen=True)
class ShmTensor:
    """A tensor's bytes in C order, its KServe datatype, and how to turn output bytes into the caller's kind."""

    raw: memoryview
    shape: tuple[int, ...]
    datatype: str
    restore: Callable[[bytearray, tuple[int, ...]], Any]


def prepare(x: Any) -> ShmTensor:
    """A numpy array or torch tensor (any device; torch also bfloat16) as bytes to put in a region.

    Raises:
        TypeError: neither numpy nor torch.
        CodecError: a dtype the server does not take (float32, float16, bfloat16, float64).
    """
    if isinstance(x, np.ndarray):
        arr = np.ascontiguousarray(x)
        datatype = _NUMPY_TYPES.get(arr.dtype.newbyteorder("=")) if arr.dtype.isnative else None
        if datatype is None:
            raise CodecError(f"dtype {x.dtype} cannot be sent through shared memory (float32, float16, float64)")
        dtype = arr.dtype

        def restore_numpy(data: bytearray, shape: tuple[int, ...]) -> np.ndarray:
            return np.frombuffer(data, dtype=dtype).reshape(shape)

        return ShmTensor(memoryview(arr).cast("B"), tuple(arr.shape), datatype, restore_numpy)
    if is_torch_tensor(x):
        import torch

        names = {torch.float32: "FP32", torch.float16: "FP16", torch.bfloat16: "BF16", torch.float64: "FP64"}
        if x.dtype not in names:
            raise CodecError(f"dtype {x.dtype} cannot be sent through shared memory")
        device, dtype = x.device, x.dtype
        cpu = x.detach().resolve_conj().resolve_neg().cpu().contiguous()
        raw = memoryview(cpu.reshape(-1).view(torch.uint8).numpy())

        def restore_torch(data: bytearray, shape: tuple[int, ...]) -> Any:
            out = torch.frombuffer(data, dtype=dtype).reshape(shape) if data else torch.empty(shape, dtype=dtype)
            return out if device.type == "cpu" else out.to(device)

        return ShmTensor(raw, tuple(cpu.shape), names[dtype], restore_torch)
    raise TypeError(f"expected a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")


def output_shape(layer: LayerInfo, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The output shape of ``layer`` for an input of ``shape`` ([N, C, H, W] or [C, H, W])."""
    if len(shape) not in (3, 4):
        raise CodecError(f"expected [N, C, H, W] or [C, H, W], got shape {list(shape)}")
    h, w = layer.output_hw(shape[-2], shape[-1])
    return (*shape[:-3], layer.out_channels, h, w)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Region:
    """One shared-memory object of this client, registered with the server under ``name``."""

    def __init__(self, size: int) -> None:
        self.name = f"deconv-client-{os.getpid()}-{uuid.uuid4().hex[:16]}"
        self.shm = shared_memory.SharedMemory(self.name, create=True, size=size)
        self.key = "/" + self.name
        self.size = size
        self.registered = False

    def register_body(self) -> dict[str, Any]:
        """The register request's body."""
        return {"key": self.key, "offset": 0, "byte_size": self.size}

    def destroy(self) -> None:
        """Close and unlink the object (the server's registration must be gone or going)."""
        self.shm.close()
        with contextlib.suppress(FileNotFoundError):
            self.shm.unlink()


class RegionPool:
    """The regions of one client: a call takes a free one large enough or a new one, and gives it back.

    Thread-safe (``Client`` is shared across threads). A new region is the next power of two of what the call
    needs (at least ``MIN_REGION_BYTES``); free regions smaller than a new one are retired (``acquire`` returns them
    for unregistering), so the pool does not grow with every larger tensor.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[Region] = []
        self._busy: set[Region] = set()
        self.closed = False

    def acquire(self, need: int) -> tuple[Region, list[Region]]:
        """A region of at least ``need`` bytes (``registered`` False: register it first), and retired regions."""
        with self._lock:
            if self.closed:
                raise RuntimeError("the client is closed")
            fits = [r for r in self._free if r.size >= need]
            if fits:
                region = min(fits, key=lambda r: r.size)
                self._free.remove(region)
                self._busy.add(region)
                return region, []
            size = max(MIN_REGION_BYTES, 1 << max(0, math.ceil(math.log2(max(need, 1)))))
            region = Region(size)
            retired = [r for r in self._free if r.size < size]
            self._free = [r for r in self._free if r.size >= size]
            self._busy.add(region)
            return region, retired

    def release(self, region: Region) -> None:
        """Give ``region`` back for the next call."""
        with self._lock:
            self._busy.discard(region)
            if region.registered and not self.closed:
                self._free.append(region)
                return
        region.destroy()

    def close(self) -> list[Region]:
        """Stop handing out regions; every region, to unregister then destroy."""
        with self._lock:
            self.closed = True
            regions = self._free + list(self._busy)
            self._free, self._busy = [], set()
        return regions


def register_path(region: Region) -> str:
    """``POST`` here registers ``region``."""
    return f"/v2/systemsharedmemory/region/{quote(region.name, safe='')}/register"


def unregister_path(region: Region) -> str:
    """``POST`` here unregisters ``region``."""
    return f"/v2/systemsharedmemory/region/{quote(region.name, safe='')}/unregister"


def infer_request(t: ShmTensor, region: Region, out_shape: tuple[int, ...], itemsize: int) -> dict[str, Any]:
    """The KServe request: the input at the start of ``region``, the output after it."""
    in_bytes = t.raw.nbytes
    out_bytes = math.prod(out_shape) * itemsize
    return {
        "inputs": [{"name": "input", "shape": list(t.shape), "datatype": t.datatype,
                    "parameters": {"shared_memory_region": region.name, "shared_memory_byte_size": in_bytes}}],
        "outputs": [{"name": "output", "parameters": {"shared_memory_region": region.name,
                                                      "shared_memory_byte_size": out_bytes,
                                                      "shared_memory_offset": _aligned(in_bytes)}}],
    }


def region_bytes(t: ShmTensor, out_shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of a region that holds the input and, after it, the output."""
    return _aligned(t.raw.nbytes) + math.prod(out_shape) * itemsize


def itemsize(datatype: str) -> int:
    """Bytes of one value of a KServe datatype."""
    return {"FP32": 4, "FP16": 2, "BF16": 2, "FP64": 8}[datatype]


def read_output(t: ShmTensor, region: Region, response: Any) -> Any:
    """The output the server wrote into ``region``, as the caller's kind of tensor (a copy)."""
    try:
        out = response["outputs"][0]
        shape = tuple(int(d) for d in out["shape"])
        params = out["parameters"]
        size = int(params["shared_memory_byte_size"])
        offset = int(params.get("shared_memory_offset", 0))
    except (KeyError, IndexError, TypeError, ValueError):
        raise CodecError(f"unexpected answer to a shared-memory request: {response!r}") from None
    if params.get("shared_memory_region") != region.name or offset + size > region.size or \
            size != math.prod(shape) * itemsize(t.datatype):
        raise CodecError(f"the server's answer does not fit the request's region: {response!r}")
    data = bytearray(region.shm.buf[offset:offset + size])
    return t.restore(data, shape)
