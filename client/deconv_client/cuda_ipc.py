"""CUDA IPC through ctypes: what the client SDK and the server need to pass device memory between processes (the
KServe v2 ``cudasharedmemory`` extension), without a CUDA Python package.

A process exports an allocation with ``cudaIpcGetMemHandle`` (64 opaque bytes, the same for every pointer into
the allocation: a handle always names the allocation's base), another process on the same machine maps it with
``cudaIpcOpenMemHandle`` and unmaps it with ``cudaIpcCloseMemHandle``. A process cannot open a handle it exported
itself. The runtime calls go to the CUDA runtime library this process already loaded (torch's, found in
``/proc/self/maps``), so that they share its state; the allocation's base and size come from the driver
(``cuMemGetAddressRange``), which the runtime has no call for.

Every call names its device: the runtime's current device is set for the call and put back after it, and a
failed call's error is taken out of the runtime's last-error slot, so that torch does not see it later as the
error of one of its own kernels.

Standard library only: the server's engine imports this module too (``.importlinter``), so that the library
lookup, the handle and the error handling have one implementation.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import re
import sys
import threading
from collections.abc import Iterator

HANDLE_BYTES = 64
# cudaIpcOpenMemHandle's flag that lets a handle of one GPU be opened on another with peer access.
_LAZY_ENABLE_PEER_ACCESS = 1
_RUNTIME_NAME = re.compile(r"libcudart(?:-[0-9a-f]+)?\.so(?:\.\d+)*$")


class CudaError(RuntimeError):
    """A CUDA call failed, or the CUDA libraries could not be loaded."""


class _Handle(ctypes.Structure):
    """``cudaIpcMemHandle_t``: 64 opaque bytes, passed by value. Its bytes go in and out whole (``to_handle``,
    ``from_handle``): the field itself reads and writes as a C string, which stops at the first zero byte."""

    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


def to_handle(data: bytes) -> _Handle:
    """The ``cudaIpcMemHandle_t`` of these 64 bytes.

    Raises:
        CudaError: not 64 bytes.
    """
    if len(data) != HANDLE_BYTES:
        raise CudaError(f"a CUDA IPC handle has {HANDLE_BYTES} bytes, got {len(data)}")
    return _Handle.from_buffer_copy(data)


def from_handle(handle: _Handle) -> bytes:
    """The 64 bytes of a ``cudaIpcMemHandle_t``."""
    return bytes(handle)


def _loaded_runtime() -> str | None:
    """The path of the CUDA runtime library this process has mapped (torch's), if any."""
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(" ", 1)[-1].strip()
            if path.startswith("/") and _RUNTIME_NAME.search(os.path.basename(path)):
                return path
    return None


def _runtime_candidates() -> list[str]:
    """Where to look for the CUDA runtime: the copy already loaded, then the CUDA wheels and torch's library
    folder on ``sys.path``, then the loader's search path."""
    found = [p for p in [_loaded_runtime()] if p]
    for entry in sys.path:
        for pattern in ("nvidia/*/lib/libcudart.so*", "nvidia/cuda_runtime/lib/libcudart.so*",
                        "torch/lib/libcudart*.so*"):
            found += sorted(glob.glob(os.path.join(entry, pattern)))
    return [*found, "libcudart.so", "libcudart.so.13", "libcudart.so.12"]


class Cuda:
    """The CUDA runtime (``libcudart``) and driver (``libcuda``) calls of CUDA IPC. Thread-safe (each call sets
    and puts back the device of the calling thread). ``runtime``: the runtime library to load (default: the one
    this process loaded, else one found); ``driver``: the driver library.

    Raises:
        CudaError: either library cannot be loaded.
    """

    def __init__(self, runtime: str | None = None, driver: str = "libcuda.so.1") -> None:
        errors = []
        self.runtime_path = ""
        for path in [runtime] if runtime else _runtime_candidates():
            try:
                self._rt = ctypes.CDLL(path)
                self.runtime_path = path
                break
            except OSError as exc:
                errors.append(str(exc))
        else:
            raise CudaError("no CUDA runtime library (libcudart) found: " + "; ".join(errors[-3:]))
        try:
            self._drv = ctypes.CDLL(driver)
        except OSError as exc:
            raise CudaError(f"no CUDA driver library ({driver}): {exc}") from None
        rt, drv = self._rt, self._drv
        c_int, c_void_p, c_uint = ctypes.c_int, ctypes.c_void_p, ctypes.c_uint
        for name, args in (("cudaGetDevice", [ctypes.POINTER(c_int)]), ("cudaSetDevice", [c_int]),
                           ("cudaGetLastError", []),
                           ("cudaIpcGetMemHandle", [ctypes.POINTER(_Handle), c_void_p]),
                           ("cudaIpcOpenMemHandle", [ctypes.POINTER(c_void_p), _Handle, c_uint]),
                           ("cudaIpcCloseMemHandle", [c_void_p])):
            fn = getattr(rt, name)
            fn.argtypes, fn.restype = args, c_int
        rt.cudaGetErrorString.argtypes, rt.cudaGetErrorString.restype = [c_int], ctypes.c_char_p
        u64 = ctypes.c_uint64
        drv.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64]
        drv.cuMemGetAddressRange_v2.restype = c_int
        drv.cuGetErrorString.argtypes = [c_int, ctypes.POINTER(ctypes.c_char_p)]
        drv.cuGetErrorString.restype = c_int

    def _check(self, err: int, what: str) -> None:
        if err:
            self._rt.cudaGetLastError()  # the failure stays out of the next caller's error check
            text = self._rt.cudaGetErrorString(err) or b"unknown error"
            raise CudaError(f"{what}: {text.decode(errors='replace')} (CUDA error {err})")

    @contextlib.contextmanager
    def _on(self, device: int) -> Iterator[None]:
        """Run on ``device`` (the runtime's current device of this thread), put back after. Set even when it is
        current already: ``cudaSetDevice`` also makes the device's primary context current to this thread, which
        the driver's calls need."""
        previous = ctypes.c_int(-1)
        self._check(self._rt.cudaGetDevice(ctypes.byref(previous)), "cudaGetDevice")
        self._check(self._rt.cudaSetDevice(device), f"cudaSetDevice({device})")
        try:
            yield
        finally:
            if previous.value != device:
                self._rt.cudaSetDevice(previous.value)

    def allocation(self, device: int, ptr: int) -> tuple[int, int]:
        """The base address and size of the allocation that holds device pointer ``ptr`` on ``device``.

        Raises:
            CudaError: ``ptr`` is not in an allocation of this process's context on ``device``.
        """
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        with self._on(device):
            err = self._drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
        if err:
            text = ctypes.c_char_p()
            self._drv.cuGetErrorString(err, ctypes.byref(text))
            raise CudaError(f"cuMemGetAddressRange: {(text.value or b'unknown error').decode(errors='replace')} "
                            f"(CUDA driver error {err})")
        return base.value, size.value

    def get_handle(self, device: int, base: int) -> bytes:
        """The IPC handle of the allocation at ``base`` on ``device`` (from ``cudaMalloc``; not memory of the
        virtual memory management API, such as torch's expandable segments)."""
        handle = _Handle()
        with self._on(device):
            self._check(self._rt.cudaIpcGetMemHandle(ctypes.byref(handle), base), "cudaIpcGetMemHandle")
        return from_handle(handle)

    def open(self, device: int, handle: bytes) -> int:
        """Map another process's allocation (its IPC ``handle``) on ``device``; its base address here."""
        raw = to_handle(handle)
        ptr = ctypes.c_void_p()
        with self._on(device):
            self._check(self._rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), raw, _LAZY_ENABLE_PEER_ACCESS),
                        "cudaIpcOpenMemHandle")
        if not ptr.value:
            raise CudaError("cudaIpcOpenMemHandle returned no address")
        return ptr.value

    def close(self, device: int, ptr: int) -> None:
        """Unmap an allocation that ``open`` mapped."""
        with self._on(device):
            self._check(self._rt.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")


_cuda: Cuda | None = None
_cuda_lock = threading.Lock()


def cuda() -> Cuda:
    """This process's ``Cuda``, loaded on first use (after torch initialized CUDA, so that its runtime is the one
    found).

    Raises:
        CudaError: the CUDA libraries cannot be loaded.
    """
    global _cuda
    with _cuda_lock:
        if _cuda is None:
            _cuda = Cuda()
        return _cuda
