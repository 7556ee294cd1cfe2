"""KServe CUDA shared memory in the engine: the clients' GPU allocations, mapped where the GPU workers run.

A client registers a region through the HTTP layer, which keeps the registration (name, GPU, byte size and a
token: ``service.http.shm_regions``) and asks the engine to map the allocation behind the client's IPC handle
(``CudaRegions.open``: ``cudaIpcOpenMemHandle`` through ``deconv_client.cuda_ipc``, on the region's GPU). The
mapping is checked against the registration (the allocation must hold ``byte_size`` bytes, where the driver can
tell) and kept until the registration goes (``close``) or the engine stops (``close_all``). The HTTP processes
never touch device memory: they have no CUDA.

A request's tensor in a region travels as a ``codec.DeviceTensor`` (token, offset, dtype, shape) inside a
``codec.CudaJob``. The worker of the region's GPU leases the region for the batch (``place``: the address of exactly
the tensor's bytes, the bounds checked again; ``lease``: a tensor over them) and gives it back after the batch
(``release``), so that a region unregistered meanwhile is unmapped only once no batch uses it, and a later request
gets ``UnknownRegionError``.

Two registrations of one allocation share one mapping: a process opens a handle once. The number of
registrations is bounded (``Settings.cuda_shm_max_regions``).

System regions (KServe system shared memory) are mapped here too when the engine computes on GPUs
(``Settings.system_shm_pinned``): ``open_system`` maps the registered bytes of the client's POSIX object, checked to
be the object registered, and page-locks them (``service.engine.ops.HostPin``), so that a tensor in such a region
goes between it and the GPU by the copy engines alone (a ``DeviceTensor`` of device -1: any GPU), no host copy. The
CPU never reads or writes that mapping: pages a client truncates away stay locked until the region is unmapped,
so the GPU's copies never fault, where a CPU access would raise SIGBUS. Their number and bytes are bounded where
they are registered (``Settings.system_shm_max_regions``, ``system_shm_max_bytes``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from deconv_client import cuda_ipc

from service.engine.ops import HostPin, Place
from service.errors import InternalError, RegionError, UnknownRegionError
from service.ipc.shm import address_of, map_object

# Page-locks host memory for the GPUs: a view of the same bytes whose lock lasts as long as any view made from it.
PinFn = Callable[[memoryview], memoryview]

log = logging.getLogger("deconv.service")


class IpcBackend(Protocol):
    """How regions are mapped and read (``CudaIpc``; tests substitute host memory)."""

    def open(self, device: int, handle: bytes) -> int:
        """Map the allocation of ``handle`` on ``device``: its address here.

        Raises:
            CudaError: the handle does not open.
        """
        ...

    def allocation_bytes(self, device: int, ptr: int) -> int | None:
        """Bytes of the mapped allocation from ``ptr`` on, None when the driver cannot tell."""
        ...

    def close(self, device: int, ptr: int) -> None:
        """Unmap what ``open`` mapped."""
        ...

    def view(self, device: int, ptr: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over ``nbytes`` bytes at ``ptr`` on ``device``, without a copy."""
        ...


class _DeviceBytes:
    """Device memory as the CUDA array interface describes it, for ``torch.as_tensor``: one row of bytes."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 2}


class CudaIpc:
    """The CUDA IPC calls of a GPU engine (``deconv_client.cuda_ipc``) and torch views of mapped memory.

    Raises:
        CudaError: the CUDA libraries cannot be loaded.
    """

    def __init__(self) -> None:
        self.cuda = cuda_ipc.cuda()
        self._size_unknown_logged = False

    def open(self, device: int, handle: bytes) -> int:
        return self.cuda.open(device, handle)

    def allocation_bytes(self, device: int, ptr: int) -> int | None:
        try:
            base, size = self.cuda.allocation(device, ptr)
        except cuda_ipc.CudaError as exc:
            if not self._size_unknown_logged:
                self._size_unknown_logged = True
                log.warning("CUDA shared memory: the size of a mapped allocation cannot be read (%s); registrations' "
                            "byte_size is trusted", exc)
            return None
        return base + size - ptr

    def close(self, device: int, ptr: int) -> None:
        self.cuda.close(device, ptr)

    def view(self, device: int, ptr: int, nbytes: int) -> torch.Tensor:
        t = torch.as_tensor(_DeviceBytes(ptr, nbytes), device=torch.device("cuda", device))
        if t.data_ptr() != ptr or t.numel() != nbytes:  # a copy would take writes away from the region
            raise InternalError(f"a view of CUDA shared memory on GPU {device} is not the memory itself")
        return t


@dataclass(eq=False)
class _Mapping:
    """One opened IPC handle, shared by the registrations of its allocation (``users``)."""

    device: int
    handle: bytes
    ptr: int
    nbytes: int | None  # the allocation's bytes from ptr on (None: unknown)
    users: int = 0


@dataclass(eq=False)
class _HostMapping:
    """A system region's bytes, mapped and page-locked here (``open_system``), and their address; unmapped when the
    last view of them is gone."""

    view: memoryview
    address: int


@dataclass(eq=False)
class _Region:
    """One registration: its mapping, its size, the batches using it (``pins``), and whether it is going."""

    token: str
    mapping: _Mapping | _HostMapping
    byte_size: int
    pins: int = 0
    closing: bool = False


class CudaRegions:
    """The engine's CUDA shared-memory regions (``service.engine.interface.CudaMemory``): ``open`` and ``close`` on
    the event loop, ``lease`` and ``release`` on the GPU workers' threads (one lock for both sides). Unavailable
    until ``configure`` finds GPUs and the CUDA libraries."""

    def __init__(self, max_regions: int, system: bool = True) -> None:
        self.max_regions = max_regions
        self.system = system  # map system regions too, when the engine computes on GPUs (Settings.system_shm_pinned)
        self._ipc: IpcBackend | None = None
        self._pin: PinFn | None = None
        self._devices: list[int] = []
        self._reason = "CUDA shared memory is not ready: the engine has not started"
        self._lock = threading.Lock()  # _regions, _mappings, pins, closing
        self._opening: asyncio.Lock | None = None  # one open at a time: a handle is opened once
        self._regions: dict[str, _Region] = {}
        self._mappings: dict[tuple[int, bytes], _Mapping] = {}

    def configure(self, devices: list[torch.device], ipc: IpcBackend | None = None, pin: PinFn | None = None) -> None:
        """Serve regions on these devices' GPUs (with ``ipc``, else the CUDA libraries of this process), and system
        regions page-locked with ``pin`` (else ``HostPin`` on GPUs; none without a GPU)."""
        self._devices = sorted(d.index for d in devices if d.type == "cuda" and d.index is not None)
        if pin is None and self.system and self._devices:
            pin = _host_pin
        self._pin = pin if self.system else None
        if ipc is None and self.max_regions > 0 and self._devices:
            try:
                ipc = CudaIpc()
            except cuda_ipc.CudaError as exc:
                log.warning("CUDA shared memory is off: %s", exc)
                self._reason = f"CUDA shared memory is unavailable on this server: {exc}"
        if self.max_regions == 0:
            self._reason = "CUDA shared memory is off on this server (DECONV_CUDA_SHM_MAX_REGIONS=0)"
            ipc = None
        elif not self._devices and ipc is None:
            self._reason = ("CUDA shared memory needs a GPU: this server computes on the CPU (no CUDA device "
                            "visible, or DECONV_DEVICES=cpu)")
        self._ipc = ipc
        if ipc is not None:
            self._reason = ""
            log.info("CUDA shared memory: regions on GPU(s) %s, at most %d", self._devices or [0], self.max_regions)

    @property
    def available(self) -> bool:
        """Whether regions can be opened."""
        return self._ipc is not None

    @property
    def reason(self) -> str:
        """Why regions cannot be opened ("" when they can)."""
        return self._reason

    @property
    def system_available(self) -> bool:
        """Whether system regions are mapped here (``open_system``)."""
        return self._pin is not None

    @property
    def regions(self) -> int:
        """Registrations mapped."""
        return len(self._regions)

    @property
    def mappings(self) -> int:
        """Allocations mapped (registrations of one allocation share one)."""
        return len(self._mappings)

    async def open(self, token: str, handle: bytes, device: int, byte_size: int) -> None:
        """Map the allocation of ``handle`` on GPU ``device`` for registration ``token`` (``CudaMemory.open``).

        Raises:
            RegionError: unavailable, not a GPU this engine computes on, a handle that does not open, an allocation
                smaller than ``byte_size``, a token already open, or ``max_regions`` registrations open.
        """
        ipc = self._ipc
        if ipc is None:
            raise RegionError(self._reason)
        if self._devices and device not in self._devices:
            raise RegionError(f"device_id {device} is not a GPU this server computes on (GPUs {self._devices})")
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            with self._lock:
                if token in self._regions:
                    raise RegionError("this registration is open already")
                if len(self._regions) >= self.max_regions:
                    raise RegionError(f"{len(self._regions)} CUDA shared-memory regions are registered, the most this "
                                      f"server holds (DECONV_CUDA_SHM_MAX_REGIONS={self.max_regions}); unregister one "
                                      "first")
                mapping = self._mappings.get((device, handle))
                if mapping is not None:  # joined under the lock: a worker's release cannot unmap it meanwhile
                    self._add(token, mapping, byte_size)
                    return
            mapping = await asyncio.to_thread(self._map, ipc, device, handle)  # (opens are one at a time)
            try:
                with self._lock:
                    self._add(token, mapping, byte_size)
            except RegionError:
                await asyncio.to_thread(self._unmap, [mapping])
                raise

    async def open_system(self, token: str, key: str, offset: int, byte_size: int, dev: int, ino: int) -> None:
        """Map and page-lock ``byte_size`` bytes at ``offset`` of the shared-memory object ``key`` for registration
        ``token`` (``CudaMemory.open_system``): the object must be the one registered (``dev``, ``ino``).

        Raises:
            RegionError: system regions are not mapped here, a token already open, the object gone, replaced or
                too small, or memory that cannot be locked.
        """
        pin = self._pin
        if pin is None:
            raise RegionError("this server does not map system shared memory (no GPU, or "
                              "DECONV_SYSTEM_SHM_PINNED=false)")
        with self._lock:
            if token in self._regions:
                raise RegionError("this registration is open already")
        view = await asyncio.to_thread(self._map_system, pin, key, offset, byte_size, dev, ino)
        with self._lock:
            if token in self._regions:
                raise RegionError("this registration is open already")
            self._regions[token] = _Region(token, _HostMapping(view, address_of(view)), byte_size)

    @staticmethod
    def _map_system(pin: PinFn, key: str, offset: int, byte_size: int, dev: int, ino: int) -> memoryview:
        mapped, start = map_object(key, offset, byte_size, dev, ino)
        try:
            locked = pin(mapped)  # whole pages; the region's bytes are a view of them
        except RuntimeError as exc:
            raise RegionError(f"cannot page-lock shared-memory object {key!r} for the GPU: {exc}") from None
        return locked[start:start + byte_size]

    def _add(self, token: str, mapping: _Mapping, byte_size: int) -> None:
        """Register ``token`` on ``mapping`` (under the lock).

        Raises:
            RegionError: ``byte_size`` is larger than the allocation.
        """
        if mapping.nbytes is not None and byte_size > mapping.nbytes:
            raise RegionError(f"byte_size {byte_size} is larger than the GPU allocation behind the handle "
                              f"({mapping.nbytes} bytes)")
        mapping.users += 1
        self._mappings[(mapping.device, mapping.handle)] = mapping
        self._regions[token] = _Region(token, mapping, byte_size)

    @staticmethod
    def _map(ipc: IpcBackend, device: int, handle: bytes) -> _Mapping:
        try:
            ptr = ipc.open(device, handle)
        except cuda_ipc.CudaError as exc:
            raise RegionError(f"the CUDA IPC handle does not open on GPU {device}: {exc} (a handle from "
                              "cudaIpcGetMemHandle of a live allocation in another process on this machine)") from None
        try:
            nbytes = ipc.allocation_bytes(device, ptr)
        except BaseException:
            ipc.close(device, ptr)
            raise
        return _Mapping(device, handle, ptr, nbytes)

    async def close(self, tokens: list[str]) -> None:
        """Unmap these registrations' allocations, each once no batch uses it (``CudaMemory.close``)."""
        unmap: list[_Mapping] = []
        with self._lock:
            for token in tokens:
                region = self._regions.get(token)
                if region is not None:
                    region.closing = True
                    if region.pins == 0:
                        unmap += self._drop(region)
        if unmap:
            await asyncio.to_thread(self._unmap, unmap)

    def close_all(self) -> None:
        """Unmap everything (at shutdown, once the workers have stopped; blocking)."""
        with self._lock:
            mappings = list(self._mappings.values())
            self._regions.clear()
            self._mappings.clear()
        self._unmap(mappings)
        if mappings:
            log.info("CUDA shared memory: unmapped %d allocation(s)", len(mappings))

    def _drop(self, region: _Region) -> list[_Mapping]:
        """Forget ``region`` (under the lock); its mapping when no registration uses it any more (a system
        region's goes with its last view)."""
        del self._regions[region.token]
        mapping = region.mapping
        if isinstance(mapping, _HostMapping):
            return []
        mapping.users -= 1
        if mapping.users > 0:
            return []
        self._mappings.pop((mapping.device, mapping.handle), None)
        return [mapping]

    def _unmap(self, mappings: list[_Mapping]) -> None:
        ipc = self._ipc
        for m in mappings:
            if ipc is None:
                break
            try:
                ipc.close(m.device, m.ptr)
            except (cuda_ipc.CudaError, RuntimeError) as exc:
                log.warning("CUDA shared memory: unmapping an allocation on GPU %d failed: %s", m.device, exc)

    # --- the workers' side ------------------------------------------------------------------------------

    def lease(self, token: str, offset: int, nbytes: int, device: int) -> torch.Tensor:
        """The ``nbytes`` bytes at ``offset`` of registration ``token`` as a uint8 tensor on GPU ``device`` (a
        system region's: a CPU tensor over its page-locked bytes, for the GPU's copy engines only), the region held
        (not unmapped) until ``release(token)``.

        Raises:
            UnknownRegionError: the region was unregistered.
            RegionError: it lies on another GPU, or the bytes are not all inside it.
        """
        mapping = self._hold(token, offset, nbytes, device)
        if isinstance(mapping, _HostMapping):
            return torch.frombuffer(mapping.view, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes \
                else torch.empty(0, dtype=torch.uint8)
        try:
            assert self._ipc is not None
            return self._ipc.view(device, mapping.ptr + offset, nbytes)
        except BaseException:
            self.release(token)
            raise

    def place(self, token: str, offset: int, nbytes: int, device: int) -> Place:
        """``lease`` as the place the GPU reaches the bytes at (``ops.Place``: a CUDA region's device address, or a
        system region's page-locked host address), with no tensor made: for ``ops.conv_transpose2d_placed``.

        Raises:
            UnknownRegionError: the region was unregistered.
            RegionError: it lies on another GPU, or the bytes are not all inside it.
        """
        mapping = self._hold(token, offset, nbytes, device)
        return (mapping.address if isinstance(mapping, _HostMapping) else mapping.ptr) + offset, nbytes

    def _hold(self, token: str, offset: int, nbytes: int, device: int) -> _Mapping | _HostMapping:
        """Check that the bytes lie in registration ``token``, on ``device`` for a CUDA region, and hold the region
        (``lease``); its mapping."""
        with self._lock:
            region = self._regions.get(token)
            if region is None or region.closing:
                raise UnknownRegionError("the shared-memory region was unregistered before the request ran")
            mapping = region.mapping
            if isinstance(mapping, _Mapping) and mapping.device != device:
                raise RegionError(f"the CUDA shared-memory region lies on GPU {mapping.device}, not {device}")
            if offset + nbytes > region.byte_size:
                kind = "system" if isinstance(mapping, _HostMapping) else "CUDA"
                raise RegionError(f"{nbytes} bytes at offset {offset} reach past the end of a {kind} shared-memory "
                                  f"region of {region.byte_size} bytes")
            region.pins += 1
            return mapping

    def release(self, token: str) -> None:
        """Give back a ``lease``; a region unregistered meanwhile is unmapped now."""
        with self._lock:
            region = self._regions.get(token)
            if region is None:
                return
            region.pins -= 1
            unmap = self._drop(region) if region.closing and region.pins == 0 else []
        self._unmap(unmap)


def _host_pin(view: memoryview) -> memoryview:
    """``view`` page-locked for every GPU (``HostPin``), for the GPU's copy engines."""
    return HostPin(view).view
