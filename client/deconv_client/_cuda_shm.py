"""Torch CUDA tensors through CUDA shared memory (``Client(..., cuda_shared_memory=True)``): the KServe v2
``cudasharedmemory`` extension, with ctypes calls to the CUDA runtime (:mod:`deconv_client.cuda_ipc`; no
tritonclient, no CUDA Python package).

A call leaves its tensors where they are. It registers the GPU allocation that holds the input with the server (an
IPC handle: torch's caching allocator hands out pieces of larger ``cudaMalloc`` allocations, and a handle always
names its allocation's base, so the request gives the tensor's offset in the allocation), allocates the output with
torch on the same GPU, registers that allocation likewise, and asks ``POST /v2/models/{layer}/infer`` to read the
input from the one and write the output into the other. Only the request's JSON crosses the socket; the server's
GPU worker reads and writes this process's memory in place and has finished when the answer comes. The server
must run on the same machine, with the GPU.

Registrations are kept per allocation (GPU, base address, size and IPC handle: an allocation freed and another made
at the same address has another handle), at most ``MAX_REGIONS``: past that, the least recently used one that no
call is using is unregistered. While registered, an allocation stays mapped by the server. ``close()``/``aclose()``
unregister them all. Memory of the virtual memory management API (``PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True``) has no IPC handle: such a tensor raises ``CodecError``.

``CudaRegions`` holds the registrations and ``CudaCall`` one call's pieces, without I/O to the server, so that
``Client`` and ``AsyncClient`` only make their HTTP calls their own way.
"""

from __future__ import annotations

import asyncio
import base64
import math
import os
import threading
import uuid
from collections import OrderedDict
from typing import Any
from urllib.parse import quote

from . import cuda_ipc
from ._shm import output_shape
from ._tensor import is_torch_tensor
from .errors import CodecError
from .layers import LayerInfo

MAX_REGIONS = 32


def is_cuda_tensor(x: Any) -> bool:
    """A non-empty torch tensor on a GPU (an empty one has no memory to share: it goes the usual way)."""
    return is_torch_tensor(x) and x.is_cuda and x.numel() > 0


class CudaRegion:
    """One GPU allocation of this process, registered with the server (``registered``) under ``name``."""

    def __init__(self, device: int, base: int, size: int, handle: bytes) -> None:
        self.name = f"deconv-cuda-{os.getpid()}-{uuid.uuid4().hex[:16]}"
        self.device = device
        self.base = base
        self.size = size
        self.handle = handle
        self.users = 0  # calls using it now
        self.registered = False
        self.lock = threading.Lock()  # one registration at a time (Client)
        self.alock: asyncio.Lock | None = None  # the same for AsyncClient, made on its event loop

    def register_body(self) -> dict[str, Any]:
        """The register request's body."""
        return {"raw_handle": {"b64": base64.b64encode(self.handle).decode()}, "device_id": self.device,
                "byte_size": self.size}


def register_path(region: CudaRegion) -> str:
    """``POST`` here registers ``region``."""
    return f"/v2/cudasharedmemory/region/{quote(region.name, safe='')}/register"


def unregister_path(region: CudaRegion) -> str:
    """``POST`` here unregisters ``region``."""
    return f"/v2/cudasharedmemory/region/{quote(region.name, safe='')}/unregister"


class CudaRegions:
    """The registrations of one client, by allocation, least recently used first. Thread-safe."""

    def __init__(self, max_regions: int = MAX_REGIONS) -> None:
        self.max_regions = max_regions
        self._lock = threading.Lock()
        self._regions: OrderedDict[tuple[int, int, int, bytes], CudaRegion] = OrderedDict()
        self.closed = False

    def acquire(self, device: int, ptr: int, nbytes: int) -> tuple[CudaRegion, int, list[CudaRegion]]:
        """The region of the allocation that holds ``nbytes`` bytes at device pointer ``ptr`` (``registered``
        False: register it first), the bytes' offset in it, and regions retired to make room (to unregister).
        Give the region back with ``release``.

        Raises:
            CodecError: the memory has no IPC handle, or the bytes are not in one allocation.
        """
        cuda = cuda_ipc.cuda()
        try:
            base, size = cuda.allocation(device, ptr)
            if ptr + nbytes > base + size:
                raise CodecError(f"{nbytes} bytes at a tensor's address pass the end of its GPU allocation")
            handle = cuda.get_handle(device, base)
        except cuda_ipc.CudaError as exc:
            raise CodecError(f"the tensor cannot be passed through CUDA shared memory: {exc} (memory from "
                             "cudaMalloc is needed, as torch's caching allocator gives without expandable "
                             "segments)") from None
        key = (device, base, size, handle)
        with self._lock:
            if self.closed:
                raise RuntimeError("the client is closed")
            region = self._regions.get(key)
            if region is None:
                region = self._regions[key] = CudaRegion(device, base, size, handle)
            self._regions.move_to_end(key)
            region.users += 1
            retired = []
            for k, r in list(self._regions.items()):
                if len(self._regions) <= self.max_regions:
                    break
                if r.users == 0:
                    del self._regions[k]
                    retired.append(r)
        return region, ptr - base, retired

    def release(self, region: CudaRegion) -> None:
        """Give back a region from ``acquire``."""
        with self._lock:
            region.users -= 1

    def close(self) -> list[CudaRegion]:
        """Stop handing out regions; every region, to unregister."""
        with self._lock:
            self.closed = True
            regions = list(self._regions.values())
            self._regions.clear()
        return regions


_DATATYPES = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16", "float64": "FP64"}


class CudaCall:
    """One call's tensors and regions: made in the caller's thread (the input made contiguous, the output
    allocated, the caller's current stream noted), then ``attach`` (blocking) and the HTTP calls.

    Raises:
        CodecError: a dtype the server does not take.
    """

    def __init__(self, x: Any, info: LayerInfo) -> None:
        import torch

        datatype = _DATATYPES.get(str(x.dtype).removeprefix("torch."))
        if datatype is None:
            raise CodecError(f"dtype {x.dtype} cannot be sent through CUDA shared memory")
        self.datatype = datatype
        self.x = x.detach().resolve_conj().resolve_neg().contiguous()
        self.y = torch.empty(output_shape(info, tuple(self.x.shape)), dtype=self.x.dtype, device=self.x.device)
        self._stream = torch.cuda.current_stream(self.x.device)  # where the input was made
        self.regions: list[tuple[CudaRegion, int]] = []  # (region, offset): the input's, the output's

    def attach(self, regions: CudaRegions) -> list[CudaRegion]:
        """Wait until the input is written (the caller's stream), then take the regions of the input's and the
        output's allocations; the regions retired meanwhile (to unregister). Blocking.

        Raises:
            CodecError: a tensor's memory cannot be shared.
        """
        self._stream.synchronize()
        retired: list[CudaRegion] = []
        for t in (self.x, self.y):
            device = t.device.index or 0  # (a tensor on a GPU always has its index)
            region, offset, old = regions.acquire(device, t.data_ptr(), t.numel() * t.element_size())
            self.regions.append((region, offset))
            retired += old
        return retired

    def unregistered(self) -> list[CudaRegion]:
        """The call's regions not yet registered with the server (each once)."""
        seen: list[CudaRegion] = []
        for region, _ in self.regions:
            if not region.registered and region not in seen:
                seen.append(region)
        return seen

    def request(self) -> dict[str, Any]:
        """The KServe request: the input and the output in their regions."""
        (r_in, at_in), (r_out, at_out) = self.regions
        return {
            "inputs": [{"name": "input", "shape": list(self.x.shape), "datatype": self.datatype,
                        "parameters": {"shared_memory_region": r_in.name, "shared_memory_offset": at_in,
                                       "shared_memory_byte_size": self.x.numel() * self.x.element_size()}}],
            "outputs": [{"name": "output", "parameters": {
                "shared_memory_region": r_out.name, "shared_memory_offset": at_out,
                "shared_memory_byte_size": self.y.numel() * self.y.element_size()}}],
        }

    def result(self, response: Any) -> Any:
        """The output, which the server wrote into ``y`` before answering.

        Raises:
            CodecError: the answer does not describe this call's output.
        """
        try:
            out = response["outputs"][0]
            shape = tuple(int(d) for d in out["shape"])
            params = out["parameters"]
            size = int(params["shared_memory_byte_size"])
        except (KeyError, IndexError, TypeError, ValueError):
            raise CodecError(f"unexpected answer to a CUDA shared-memory request: {response!r}") from None
        region, _ = self.regions[1]
        if params.get("shared_memory_region") != region.name or shape != tuple(self.y.shape) or \
                size != math.prod(shape) * self.y.element_size():
            raise CodecError(f"the server's answer does not fit the request's output: {response!r}")
        return self.y

    def release(self, regions: CudaRegions) -> None:
        """Give the regions back (after the answer, or a failure)."""
        for region, _ in self.regions:
            regions.release(region)
        self.regions = []
