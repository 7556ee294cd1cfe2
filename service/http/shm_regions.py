"""KServe v2 shared memory: the clients' registered regions, system (Triton's ``systemsharedmemory`` extension)
and CUDA (``cudasharedmemory``).

A client creates a POSIX shared-memory object (``shm_open``, under ``/dev/shm``), registers a region of it by name
(``key``, ``offset``, ``byte_size``), and then names the region in an inference request's input or output
parameters (``shared_memory_region``, ``shared_memory_offset``, ``shared_memory_byte_size``) instead of sending
the tensor's bytes (docs/protocol.md, "System shared memory").

Safety, whatever a client sends or does to its object:

- A key names one object directly under ``/dev/shm`` (no path, no symbolic link, a regular file), opened read-write
  with ``O_NOFOLLOW``; the region must lie within the object's size (``fstat``) when it is registered.
- Every access is checked against the registered range: ``offset + byte_size`` of a tensor within the region's
  ``byte_size``, so a client never reads or writes outside what it registered.
- Tensors are copied with ``pread``/``pwrite`` on the object's descriptor, never through a mapping: a client that
  truncates its object after registering makes the access fail with a short read (400), where a mapping would
  kill the server with SIGBUS. Before each access the object's current size is checked against the region.
  On a GPU server the engine maps and page-locks a registered region instead (``mark_mapped``;
  ``service.engine.cuda_shm``), and its tensors are not copied here at all: they go to the engine as references,
  and only the GPU's copy engines touch the locked pages, which outlive a truncation (no fault, no SIGBUS).
- A request holds what it checked, from the check to the access: an output is written through a descriptor of the
  request's own (``writer``: a duplicate of the region's, taken when the bytes were checked), so that a region
  unregistered and registered again under the same name meanwhile, in this process or another, never receives
  another request's output; and the write happens only if the name still stands for the registration that was
  checked (else 400, nothing written). An input is read on the event loop with no await after its check.
- Every use checks that the object under the key is still the one registered (device and inode, one ``stat``): an
  object deleted and created again under the same name is refused (400) in every process, where a descriptor
  opened before would silently serve the deleted one.
- The number of regions and their total bytes are bounded (``Settings.system_shm_max_regions``,
  ``system_shm_max_bytes``); names are unique; descriptors are closed on unregister and at shutdown.

Multi-process server (``DECONV_HTTP_PROCESSES`` > 1): a client's connections may land on different HTTP processes,
so the regions are kept where every process sees them, a directory in the server's private working directory
(``DirectoryStore``): one record file per region, changed under an exclusive ``flock``, so that uniqueness and the
bounds hold across processes. Each process opens its own descriptor for a region when first used and checks, on
every use, that the record is still there and still the same registration (a token), and that the object is the
one registered (device and inode), so an unregistered or re-registered name never reaches stale memory. A single
process keeps its regions in memory (``MemoryStore``).

CUDA regions (docs/protocol.md, "CUDA shared memory") are a client's GPU allocations, registered by IPC handle.
Their records live in the same store, so that one name is one region of one kind across every process (a name
taken by a region of either kind is refused), and the same checks hold for them: the bounds of every tensor
against the registered ``byte_size``, the token of the registration, the bound on their number
(``Settings.cuda_shm_max_regions``). This process never maps their memory: the engine does, where the GPU workers
run (``service.engine.cuda_shm``), under the record's token, and a request names the region to it
(``device_tensor``, a ``codec.DeviceTensor``).

That check costs no file read per request: every change of the records (register, unregister) also adds one to a
generation counter, 8 bytes of a file in the directory that every process maps (``DirectoryStore.generation``),
after the change and under the lock. A process reads the record again only when the counter moved since it last
read it; a request that comes after an unregister was answered, in whichever process, sees the new count and so
the record gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import struct
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from service.codec import DeviceTensor
from service.errors import RegionError, UnknownRegionError
from service.ipc.shm import SHM_DIR, open_object

log = logging.getLogger("deconv.service")

MAX_NAME_CHARS = 256
# The generation counter of a multi-process server's records (DirectoryStore.generation).
_GENERATION = struct.Struct("<Q")
# The kinds of region (Record.kind), and what names them in messages.
SYSTEM, CUDA = "system", "cuda"
_KIND_NAMES = {SYSTEM: "system", CUDA: "CUDA"}


@dataclass(frozen=True)
class Record:
    """One registration as the store keeps it: a system region (``key``, ``offset``; ``dev``/``ino``: the object
    registered; ``mapped``: the engine maps it too) or a CUDA region (``device_id``; the engine maps its allocation
    under ``token``). ``token``: this registration, so that a name unregistered and registered again is never taken
    for the old one."""

    name: str
    key: str
    offset: int
    byte_size: int
    dev: int
    ino: int
    token: str
    kind: str = SYSTEM
    device_id: int = -1
    mapped: bool = False  # a system region the engine maps and page-locks under ``token`` (``mark_mapped``)

    def status(self) -> dict[str, Any]:
        """The region's entry in a status answer (Triton's fields for its kind)."""
        if self.kind == CUDA:
            return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


class MemoryStore:
    """The records of a single-process server."""

    def __init__(self) -> None:
        self._records: dict[str, Record] = {}

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Nothing to lock: the one event loop changes the records."""
        yield

    def get(self, name: str) -> Record | None:
        return self._records.get(name)

    def generation(self) -> int:
        """Nothing to follow: this process makes every change, and forgets its regions as it does."""
        return 0

    def all(self) -> list[Record]:
        return list(self._records.values())

    def add(self, record: Record) -> None:
        self._records[record.name] = record

    def remove(self, name: str) -> None:
        self._records.pop(name, None)


class DirectoryStore:
    """The records of a multi-process server: one JSON file per region in ``root``, shared by its HTTP processes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_path = root / ".lock"
        fd = os.open(root / ".generation", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size < _GENERATION.size:  # the first process (a longer file is never shortened)
                os.ftruncate(fd, _GENERATION.size)
            self._generation = mmap.mmap(fd, _GENERATION.size)
        finally:
            os.close(fd)

    def generation(self) -> int:
        """The count of changes to the records, in every process (read from the shared mapping: no system call)."""
        return _GENERATION.unpack_from(self._generation)[0]

    def _changed(self) -> None:
        """Count a change, once it is made (under the lock)."""
        _GENERATION.pack_into(self._generation, 0, self.generation() + 1)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive across the server's processes (``flock``), for a check and a change made together."""
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _path(self, name: str) -> Path:
        return self.root / (hashlib.sha256(name.encode()).hexdigest() + ".json")

    @staticmethod
    def _read(path: Path) -> Record | None:
        try:
            return Record(**json.loads(path.read_bytes()))
        except FileNotFoundError:
            return None

    def get(self, name: str) -> Record | None:
        return self._read(self._path(name))

    def all(self) -> list[Record]:
        records = (self._read(p) for p in sorted(self.root.glob("*.json")))
        return sorted((r for r in records if r is not None), key=lambda r: r.name)

    def add(self, record: Record) -> None:
        path = self._path(record.name)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(record)))
        os.replace(tmp, path)  # readers see the whole record or none
        self._changed()

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(name).unlink()
        self._changed()


class Region:
    """A registered region as this process knows it: its record, the object's descriptor (a system region; None for
    a CUDA region, whose memory only the engine maps), and the store's generation when the record was last read
    (``DirectoryStore.generation``)."""

    __slots__ = ("fd", "generation", "record")

    def __init__(self, record: Record, fd: int | None, generation: int) -> None:
        self.record = record
        self.fd = fd
        self.generation = generation


def _engine_maps(record: Record) -> bool:
    """Whether the engine maps ``record``'s memory under its token."""
    return record.kind == CUDA or record.mapped


def _non_negative_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RegionError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _positive_int(value: Any, what: str) -> int:
    if _non_negative_int(value, what) == 0:
        raise RegionError(f"{what} must be positive")
    return value  # type: ignore[no-any-return]


def _check_name(name: str) -> None:
    if not name or len(name) > MAX_NAME_CHARS:
        raise RegionError(f"a region name has 1 to {MAX_NAME_CHARS} characters")


class RegionTable:
    """This process's view of the registered regions, system and CUDA: register, unregister, status, and bounded
    reads and writes (system regions) or references (CUDA regions, ``device_tensor``).

    Both kinds share one namespace (one store): a name is a system region's or a CUDA region's, never both, so
    that an inference request's ``shared_memory_region`` names exactly one region. ``directory``: the shared
    directory of a multi-process server (``DirectoryStore``); None: in memory. Event-loop only.
    """

    def __init__(self, max_regions: int, max_bytes: int, directory: Path | None = None,
                 cuda_max_regions: int = 0) -> None:
        self.max_regions = max_regions
        self.max_bytes = max_bytes
        self.cuda_max_regions = cuda_max_regions
        self.store: MemoryStore | DirectoryStore = DirectoryStore(directory) if directory else MemoryStore()
        self._open: dict[str, Region] = {}  # name -> the region as this process opened it

    @property
    def enabled(self) -> bool:
        """Whether clients may register system regions (``system_shm_max_regions`` > 0)."""
        return self.max_regions > 0

    # --- registration ----------------------------------------------------------------------------------------

    def register(self, name: str, key: Any, offset: Any, byte_size: Any) -> Record:
        """Register ``byte_size`` bytes at ``offset`` of object ``key`` as system region ``name``; its record.

        Raises:
            RegionError: the extension is off, a field is invalid, the object cannot be opened or is too small,
                the name is taken, or the bounds on regions and bytes would be exceeded.
        """
        if not self.enabled:
            raise RegionError("system shared memory is off on this server (DECONV_SYSTEM_SHM_MAX_REGIONS=0)")
        _check_name(name)
        if not isinstance(key, str):
            raise RegionError(f"key must be a string, got {key!r}")
        offset = _non_negative_int(offset, "offset")
        byte_size = _positive_int(byte_size, "byte_size")
        fd, st = open_object(key)
        try:
            if offset + byte_size > st.st_size:
                raise RegionError(f"region of {byte_size} bytes at offset {offset} does not fit object {key!r} "
                                  f"of {st.st_size} bytes")
            record = Record(name, key, offset, byte_size, st.st_dev, st.st_ino, uuid.uuid4().hex)
            self._add(record)
        except BaseException:
            os.close(fd)
            raise
        self._forget(name)
        self._open[name] = Region(record, fd, -1)  # read again on first use: other changes may have come between
        log.info("shared memory: registered region %r (%d bytes at offset %d of %s)", name, byte_size, offset, key)
        return record

    def mark_mapped(self, record: Record) -> bool:
        """Note that the engine maps system region ``record`` (``CudaMemory.open_system``), so that its tensors go to
        the engine by reference (``device_tensor``); False when that registration is gone meanwhile (the caller
        then unmaps it)."""
        mapped = replace(record, mapped=True)
        with self.store.locked():
            if self.store.get(record.name) != record:
                return False
            self.store.add(mapped)  # other processes see it by the store's generation
        region = self._open.get(record.name)
        if region is not None and region.record.token == record.token:
            region.record = mapped  # this process's, read already (a single process's store has no generation)
        return True

    def cuda_record(self, name: str, device_id: Any, byte_size: Any) -> Record:
        """A new CUDA region's record (not stored yet: ``add_cuda`` does, once the engine mapped its memory under
        the record's token), checked against the registrations there are now.

        Raises:
            RegionError: the extension is off, a field is invalid, the name is taken or the bound on regions is
                reached.
        """
        if self.cuda_max_regions <= 0:
            raise RegionError("CUDA shared memory is off on this server (DECONV_CUDA_SHM_MAX_REGIONS=0)")
        _check_name(name)
        device_id = _non_negative_int(device_id, "device_id")
        byte_size = _positive_int(byte_size, "byte_size")
        record = Record(name, "", 0, byte_size, 0, 0, uuid.uuid4().hex, CUDA, device_id)
        with self.store.locked():
            self._admit(record, self.store.all())
        return record

    def add_cuda(self, record: Record) -> None:
        """Store a CUDA region's record (from ``cuda_record``), checked again against the registrations now.

        Raises:
            RegionError: the name was taken or the bound reached meanwhile.
        """
        self._add(record)
        self._forget(record.name)
        log.info("shared memory: registered CUDA region %r (%d bytes on GPU %d)", record.name, record.byte_size,
                 record.device_id)

    def _add(self, record: Record) -> None:
        with self.store.locked():
            self._admit(record, self.store.all())
            self.store.add(record)

    def _admit(self, record: Record, records: list[Record]) -> None:
        """Raise unless ``record`` may join ``records``: its name free (in either kind), its kind's bounds kept."""
        taken = next((r for r in records if r.name == record.name), None)
        if taken is not None:
            also = "" if taken.kind == record.kind else f" as a {_KIND_NAMES[taken.kind]} region"
            raise RegionError(f"a shared-memory region named {record.name!r} is already registered{also}; unregister "
                              "it first")
        same = [r for r in records if r.kind == record.kind]
        limit, setting = ((self.max_regions, "DECONV_SYSTEM_SHM_MAX_REGIONS") if record.kind == SYSTEM
                          else (self.cuda_max_regions, "DECONV_CUDA_SHM_MAX_REGIONS"))
        if len(same) >= limit:
            raise RegionError(f"{len(same)} {_KIND_NAMES[record.kind]} regions are registered, the most this server "
                              f"holds ({setting}={limit}); unregister one first")
        if record.kind == SYSTEM:
            total = sum(r.byte_size for r in same)
            if total + record.byte_size > self.max_bytes:
                raise RegionError(f"registering {record.byte_size} bytes would bring the registered regions to "
                                  f"{total + record.byte_size} bytes, over the limit of {self.max_bytes} "
                                  "(DECONV_SYSTEM_SHM_MAX_BYTES)")

    def unregister(self, name: str, kind: str = SYSTEM) -> list[str]:
        """Unregister region ``name`` of ``kind`` (nothing happens when none is registered, as in Triton); the
        tokens of what the engine maps among it (a CUDA region, a mapped system region: it unmaps them by token)."""
        with self.store.locked():
            record = self.store.get(name)
            if record is not None and record.kind == kind:
                self.store.remove(name)
            else:
                record = None
        if record is None:
            return []
        self._forget(name)
        log.info("shared memory: unregistered %s region %r", _KIND_NAMES[kind], name)
        return [record.token] if _engine_maps(record) else []

    def unregister_all(self, kind: str = SYSTEM) -> list[str]:
        """Unregister every region of ``kind``; the tokens of those the engine maps."""
        with self.store.locked():
            records = [r for r in self.store.all() if r.kind == kind]
            for r in records:
                self.store.remove(r.name)
        for r in records:
            self._forget(r.name)
        if records:
            log.info("shared memory: unregistered %d %s region(s)", len(records), _KIND_NAMES[kind])
        return [r.token for r in records if _engine_maps(r)]

    def status(self, name: str | None = None, kind: str = SYSTEM) -> list[dict[str, Any]]:
        """Every region's status of ``kind``, or region ``name``'s.

        Raises:
            UnknownRegionError: no region ``name`` of ``kind``.
        """
        if name is None:
            records = self.store.all()
            for gone in set(self._open) - {r.name for r in records}:
                self._forget(gone)
            return [r.status() for r in records if r.kind == kind]
        record = self.store.get(name)
        if record is None:
            self._forget(name)
            raise UnknownRegionError(f"no shared-memory region named {name!r} is registered")
        if record.kind != kind:
            raise UnknownRegionError(f"shared-memory region {name!r} is a {_KIND_NAMES[record.kind]} region, not a "
                                     f"{_KIND_NAMES[kind]} one")
        return [record.status()]

    def close(self) -> None:
        """Close every descriptor this process holds (at shutdown; the registrations of a multi-process server
        stay for its other processes until the server's working directory is removed)."""
        for name in list(self._open):
            self._forget(name)

    @property
    def open_regions(self) -> int:
        """Regions whose object this process holds open."""
        return len(self._open)

    def _forget(self, name: str) -> None:
        region = self._open.pop(name, None)
        if region is not None and region.fd is not None:
            os.close(region.fd)

    # --- tensors -------------------------------------------------------------------------------------------

    def _region(self, name: str) -> Region:
        """Region ``name`` opened here, checked against the store (it may have changed in another process): the
        record is read again when the store's generation moved since it was last read."""
        generation = self.store.generation()
        region = self._current(name, generation)
        if region.record.kind == SYSTEM:
            _check_identity(region.record)
        return region

    def _current(self, name: str, generation: int) -> Region:
        """``_region`` without the object's identity check."""
        region = self._open.get(name)
        if region is not None and region.generation == generation:
            return region
        record = self.store.get(name)
        if record is None:
            self._forget(name)
            raise UnknownRegionError(f"no shared-memory region named {name!r} is registered")
        if region is not None and region.record.token == record.token:
            region.generation = generation
            region.record = record  # the same registration, perhaps since mapped by the engine
            return region
        self._forget(name)
        if record.kind == CUDA:
            region = self._open[name] = Region(record, None, generation)
            return region
        fd, st = open_object(record.key)
        if (st.st_dev, st.st_ino) != (record.dev, record.ino):
            os.close(fd)
            raise _replaced(record)
        region = self._open[name] = Region(record, fd, generation)
        return region

    def by_reference(self, name: str) -> bool:
        """Whether the engine maps region ``name`` (a CUDA region, or a system region it page-locked), so that its
        tensors go to the engine as references (``device_tensor``) rather than bytes.

        Raises:
            UnknownRegionError: no region ``name``.
        """
        return _engine_maps(self._region(name).record)

    def _within(self, name: str, offset: int, byte_size: int, kind: str | None) -> Region:
        """Region ``name`` (of ``kind``, when given), after checking that ``byte_size`` bytes at ``offset`` lie
        inside it."""
        region = self._region(name)
        r = region.record
        if kind is not None and r.kind != kind:
            raise RegionError(f"shared-memory region {name!r} is a {_KIND_NAMES[r.kind]} region")
        if offset + byte_size > r.byte_size:
            raise RegionError(f"{byte_size} bytes at offset {offset} reach past the end of shared-memory region "
                              f"{name!r} of {r.byte_size} bytes")
        return region

    def device_tensor(self, name: str, offset: int, byte_size: int, dtype: torch.dtype,
                      shape: tuple[int, ...]) -> DeviceTensor:
        """A tensor of ``shape`` at ``offset`` of region ``name`` (one the engine maps: ``by_reference``), whose
        ``byte_size`` bytes (at least the tensor's) are checked to lie inside it: a reference for the engine, which
        alone touches the memory (a system region's device is -1: any GPU).

        Raises:
            UnknownRegionError, RegionError: no such region, or the bytes are not all inside it.
        """
        r = self._within(name, offset, byte_size, None).record
        if not _engine_maps(r):
            raise RegionError(f"shared-memory region {name!r} is not mapped by the engine")
        return DeviceTensor(r.token, r.device_id if r.kind == CUDA else -1, offset, dtype, shape)

    def _span(self, name: str, offset: int, byte_size: int) -> tuple[Region, int]:
        """The system region and the object offset of ``byte_size`` bytes at ``offset`` of region ``name``,
        checked."""
        region = self._within(name, offset, byte_size, SYSTEM)
        r = region.record
        assert region.fd is not None
        size = os.fstat(region.fd).st_size
        if r.offset + r.byte_size > size:
            raise RegionError(f"shared-memory object {r.key!r} of region {name!r} shrank to {size} bytes after the "
                              "region was registered")
        return region, r.offset + offset

    def read(self, name: str, offset: int, byte_size: int) -> bytearray:
        """A copy of ``byte_size`` bytes at ``offset`` of region ``name``.

        Raises:
            UnknownRegionError, RegionError: no such region, or the bytes are not all inside it.
        """
        buf = bytearray(byte_size)
        self.reader(name, offset, byte_size)(memoryview(buf))
        return buf

    def reader(self, name: str, offset: int, byte_size: int) -> Callable[[memoryview], None]:
        """Checks ``byte_size`` bytes at ``offset`` of region ``name`` now (as ``read``), and returns what copies
        them into a buffer of that size, later on this event loop, so that they go straight where they are needed
        (``codec.SourceTensor``). Called after the region was unregistered or registered again here, it raises
        ``UnknownRegionError`` and reads nothing.

        Raises:
            UnknownRegionError, RegionError: no such region, or the bytes are not all inside it.
        """
        region, at = self._span(name, offset, byte_size)

        def fill(view: memoryview) -> None:
            if self._open.get(name) is not region:  # its descriptor closed (and its number perhaps reused)
                raise UnknownRegionError(f"shared-memory region {name!r} was unregistered while in use")
            done = 0
            while done < byte_size:
                n = os.preadv(region.fd, [view[done:]], at + done)
                if n == 0:
                    raise RegionError(f"shared-memory object of region {name!r} ended before {byte_size} bytes "
                                      f"at offset {offset}")
                done += n

        return fill

    def write(self, name: str, offset: int, data: memoryview) -> None:
        """Write ``data`` at ``offset`` of region ``name`` now.

        Raises:
            UnknownRegionError, RegionError: no such region, or the bytes are not all inside it.
        """
        self.writer(name, offset, data.nbytes).write(data)

    def writer(self, name: str, offset: int, byte_size: int) -> RegionWriter:
        """Check ``byte_size`` bytes at ``offset`` of region ``name`` now, and hold them for a write later (the
        request's output, once computed): a ``RegionWriter`` on a descriptor of its own, so that what it writes goes
        into the object checked now, whatever happens to the name meanwhile.

        Raises:
            UnknownRegionError, RegionError: no such region, or the bytes are not all inside it.
        """
        region, at = self._span(name, offset, byte_size)
        assert region.fd is not None
        return RegionWriter(self, region.record, os.dup(region.fd), at, byte_size)

    def check(self, name: str, offset: int, byte_size: int) -> None:
        """Raise as ``read`` or ``write`` would for these bytes, without touching them."""
        self._span(name, offset, byte_size)

    def still(self, record: Record) -> None:
        """Raise unless region ``record.name`` is still registration ``record`` and its object the one registered.

        Raises:
            UnknownRegionError: the region was unregistered, or registered again (in any process).
            RegionError: its object was replaced.
        """
        try:
            current = self._current(record.name, self.store.generation()).record
        except UnknownRegionError:
            current = None
        if current is None or current.token != record.token:
            raise UnknownRegionError(f"shared-memory region {record.name!r} was unregistered while the request ran; "
                                     "its output was not written")
        _check_identity(record)


def _replaced(record: Record) -> RegionError:
    return RegionError(f"shared-memory object {record.key!r} of region {record.name!r} was replaced or removed after "
                       "the region was registered; register it again")


def _check_identity(record: Record) -> None:
    """Raise unless the object under ``record.key`` is the one registered (device and inode): an object deleted and
    created again under its name is another object, which a descriptor opened before would not see.

    Raises:
        RegionError: the object was replaced or removed.
    """
    try:
        st = os.stat(SHM_DIR / record.key.lstrip("/"), follow_symlinks=False)
    except OSError:
        raise _replaced(record) from None
    if (st.st_dev, st.st_ino) != (record.dev, record.ino):
        raise _replaced(record)


class RegionWriter:
    """Bytes of a system region checked for a request's output (``RegionTable.writer``), on a descriptor of the
    request's own: ``write`` puts the output into the object that was checked, once, and only while the region's
    name still stands for the registration checked; the descriptor is closed after the write, or when the writer
    is dropped unused."""

    def __init__(self, table: RegionTable, record: Record, fd: int, at: int, byte_size: int) -> None:
        self._table = table
        self.record = record
        self._fd = fd
        self._at = at
        self.byte_size = byte_size
        self._close = weakref.finalize(self, os.close, fd)

    def write(self, data: memoryview) -> None:
        """Write ``data`` (at most ``byte_size`` bytes) at the checked place, then close the descriptor.

        Raises:
            UnknownRegionError: the region was unregistered or registered again since the check (nothing written).
            RegionError: its object was replaced or shrank, or the writer was used already.
        """
        if not self._close.alive:
            raise RegionError(f"the output of region {self.record.name!r} was written already")
        try:
            view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
            if view.nbytes > self.byte_size:
                raise RegionError(f"{view.nbytes} bytes do not fit the {self.byte_size} checked in shared-memory "
                                  f"region {self.record.name!r}")
            self._table.still(self.record)
            r = self.record
            size = os.fstat(self._fd).st_size
            if r.offset + r.byte_size > size:
                raise RegionError(f"shared-memory object {r.key!r} of region {r.name!r} shrank to {size} bytes after "
                                  "the region was registered")
            done = 0
            while done < view.nbytes:
                done += os.pwritev(self._fd, [view[done:]], self._at + done)
        finally:
            self._close()

    def close(self) -> None:
        """Give the descriptor back without writing."""
        self._close()


@dataclass(frozen=True)
class TensorRef:
    """A tensor's place in a region, from an input's or output's parameters."""

    region: str
    offset: int
    byte_size: int


SHM_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


def tensor_ref(params: dict[str, Any], what: str) -> TensorRef | None:
    """The shared-memory parameters of an input or output, None when it names none.

    Raises:
        RegionError: a parameter is missing (region and byte size go together) or of the wrong type.
    """
    if not any(p in params for p in SHM_PARAMETERS):
        return None
    region = params.get("shared_memory_region")
    if not isinstance(region, str) or not region:
        raise RegionError(f"{what}: shared_memory_region must name a registered region, got {region!r}")
    if "shared_memory_byte_size" not in params:
        raise RegionError(f"{what}: shared_memory_byte_size is required with shared_memory_region")
    byte_size = _non_negative_int(params["shared_memory_byte_size"], f"{what}: shared_memory_byte_size")
    offset = _non_negative_int(params.get("shared_memory_offset", 0), f"{what}: shared_memory_offset")
    return TensorRef(region, offset, byte_size)
