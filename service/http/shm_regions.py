"""KServe v2 system shared memory (Triton's ``systemsharedmemory`` extension): the clients' registered regions.

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
- Every access happens on the event loop, between two awaits, so a region cannot be unregistered (its descriptor
  closed, the number reused) while it is read or written.
- The number of regions and their total bytes are bounded (``Settings.system_shm_max_regions``,
  ``system_shm_max_bytes``); names are unique; descriptors are closed on unregister and at shutdown.

Multi-process server (``DECONV_HTTP_PROCESSES`` > 1): a client's connections may land on different HTTP processes,
so the regions are kept where every process sees them, a directory in the server's private working directory
(``DirectoryStore``): one record file per region, changed under an exclusive ``flock``, so that uniqueness and the
bounds hold across processes. Each process opens its own descriptor for a region when first used and checks, on
every use, that the record is still there and still the same registration (a token), and that the object is the
one registered (device and inode), so an unregistered or re-registered name never reaches stale memory. A single
process keeps its regions in memory (``MemoryStore``).

That check costs no file read per request: every change of the records (register, unregister) also adds one to a
generation counter, 8 bytes of a file in the directory that every process maps (``DirectoryStore.generation``),
after the change and under the lock. A process reads the record again only when the counter moved since it last
read it; a request that comes after an unregister was answered, in whichever process, sees the new count and so
the record gone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import re
import stat
import struct
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from service.errors import ServiceError

log = logging.getLogger("deconv.service")

SHM_DIR = Path("/dev/shm")
MAX_NAME_CHARS = 256
# A key names one object directly under /dev/shm; leading slashes are dropped as shm_open drops them.
_KEY = re.compile(r"/*([^/\x00]{1,255})")
# The generation counter of a multi-process server's records (DirectoryStore.generation).
_GENERATION = struct.Struct("<Q")


class RegionError(ServiceError):
    """A region request or a tensor in a region that cannot be honoured (400, as Triton answers)."""

    status, type = 400, "invalid_shared_memory"


class UnknownRegionError(RegionError):
    """No region of that name is registered."""

    type = "unknown_shared_memory_region"


@dataclass(frozen=True)
class Record:
    """One registration as the store keeps it (``dev``/``ino``: the object registered; ``token``: this
    registration, so that a name unregistered and registered again is never taken for the old one)."""

    name: str
    key: str
    offset: int
    byte_size: int
    dev: int
    ino: int
    token: str

    def status(self) -> dict[str, Any]:
        """The region's entry in a status answer (Triton's fields)."""
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
    """A registered region opened by this process: its record, the object's descriptor, and the store's generation
    when the record was last read (``DirectoryStore.generation``)."""

    __slots__ = ("fd", "generation", "record")

    def __init__(self, record: Record, fd: int, generation: int) -> None:
        self.record = record
        self.fd = fd
        self.generation = generation


def _object_path(key: str) -> Path:
    m = _KEY.fullmatch(key)
    if m is None or m.group(1) in (".", ".."):
        raise RegionError(f"key {key!r} does not name a POSIX shared-memory object (one name under /dev/shm, as "
                          "shm_open takes it, e.g. '/my_region')")
    return SHM_DIR / m.group(1)


def _open_object(key: str) -> tuple[int, os.stat_result]:
    """The descriptor and ``fstat`` of the shared-memory object ``key`` (a regular file under /dev/shm).

    Raises:
        RegionError: no such object, not one this server may open read-write, or not a regular file.
    """
    path = _object_path(key)
    try:
        # O_NONBLOCK: a FIFO planted under that name must not stall the event loop; the check below refuses it.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise RegionError(f"no shared-memory object {key!r} (create it with shm_open before registering)") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RegionError(f"shared-memory key {key!r} is a symbolic link; name the object itself") from None
        raise RegionError(f"cannot open shared-memory object {key!r} read-write: "
                          f"{os.strerror(exc.errno or 0)}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise RegionError(f"shared-memory key {key!r} is not a memory object")
    return fd, st


def _non_negative_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RegionError(f"{what} must be a non-negative integer, got {value!r}")
    return value


class RegionTable:
    """This process's view of the registered regions: register, unregister, status, and bounded reads and writes.

    ``directory``: the shared directory of a multi-process server (``DirectoryStore``); None: in memory.
    Event-loop only.
    """

    def __init__(self, max_regions: int, max_bytes: int, directory: Path | None = None) -> None:
        self.max_regions = max_regions
        self.max_bytes = max_bytes
        self.store: MemoryStore | DirectoryStore = DirectoryStore(directory) if directory else MemoryStore()
        self._open: dict[str, Region] = {}  # name -> the region as this process opened it

    @property
    def enabled(self) -> bool:
        """Whether clients may register regions (``system_shm_max_regions`` > 0)."""
        return self.max_regions > 0

    # --- registration ----------------------------------------------------------------------------------------

    def register(self, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        """Register ``byte_size`` bytes at ``offset`` of object ``key`` as region ``name``.

        Raises:
            RegionError: the extension is off, a field is invalid, the object cannot be opened or is too small,
                the name is taken, or the bounds on regions and bytes would be exceeded.
        """
        if not self.enabled:
            raise RegionError("system shared memory is off on this server (DECONV_SYSTEM_SHM_MAX_REGIONS=0)")
        if not name or len(name) > MAX_NAME_CHARS:
            raise RegionError(f"a region name has 1 to {MAX_NAME_CHARS} characters")
        if not isinstance(key, str):
            raise RegionError(f"key must be a string, got {key!r}")
        offset = _non_negative_int(offset, "offset")
        byte_size = _non_negative_int(byte_size, "byte_size")
        if byte_size == 0:
            raise RegionError("byte_size must be positive")
        fd, st = _open_object(key)
        try:
            if offset + byte_size > st.st_size:
                raise RegionError(f"region of {byte_size} bytes at offset {offset} does not fit object {key!r} "
                                  f"of {st.st_size} bytes")
            with self.store.locked():
                records = self.store.all()
                if any(r.name == name for r in records):
                    raise RegionError(f"a shared-memory region named {name!r} is already registered; unregister "
                                      "it first")
                if len(records) >= self.max_regions:
                    raise RegionError(f"{len(records)} regions are registered, the most this server holds "
                                      f"(DECONV_SYSTEM_SHM_MAX_REGIONS={self.max_regions}); unregister one first")
                total = sum(r.byte_size for r in records)
                if total + byte_size > self.max_bytes:
                    raise RegionError(f"registering {byte_size} bytes would bring the registered regions to "
                                      f"{total + byte_size} bytes, over the limit of {self.max_bytes} "
                                      "(DECONV_SYSTEM_SHM_MAX_BYTES)")
                record = Record(name, key, offset, byte_size, st.st_dev, st.st_ino, uuid.uuid4().hex)
                self.store.add(record)
        except BaseException:
            os.close(fd)
            raise
        self._forget(name)
        self._open[name] = Region(record, fd, -1)  # read again on first use: other changes may have come between
        log.info("shared memory: registered region %r (%d bytes at offset %d of %s)", name, byte_size, offset, key)

    def unregister(self, name: str) -> None:
        """Unregister region ``name`` (nothing happens when none is registered, as in Triton)."""
        with self.store.locked():
            found = self.store.get(name) is not None
            self.store.remove(name)
        self._forget(name)
        if found:
            log.info("shared memory: unregistered region %r", name)

    def unregister_all(self) -> None:
        """Unregister every region."""
        with self.store.locked():
            names = [r.name for r in self.store.all()]
            for name in names:
                self.store.remove(name)
        self.close()
        if names:
            log.info("shared memory: unregistered %d region(s)", len(names))

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        """Every region's status, or region ``name``'s.

        Raises:
            UnknownRegionError: no region ``name``.
        """
        if name is None:
            records = self.store.all()
            for gone in set(self._open) - {r.name for r in records}:
                self._forget(gone)
            return [r.status() for r in records]
        record = self.store.get(name)
        if record is None:
            self._forget(name)
            raise UnknownRegionError(f"no shared-memory region named {name!r} is registered")
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
        if region is not None:
            os.close(region.fd)

    # --- tensors -------------------------------------------------------------------------------------------

    def _region(self, name: str) -> Region:
        """Region ``name`` opened here, checked against the store (it may have changed in another process): the
        record is read again when the store's generation moved since it was last read."""
        generation = self.store.generation()
        region = self._open.get(name)
        if region is not None and region.generation == generation:
            return region
        record = self.store.get(name)
        if record is None:
            self._forget(name)
            raise UnknownRegionError(f"no shared-memory region named {name!r} is registered")
        if region is not None and region.record.token == record.token:
            region.generation = generation
            return region
        self._forget(name)
        fd, st = _open_object(record.key)
        if (st.st_dev, st.st_ino) != (record.dev, record.ino):
            os.close(fd)
            raise RegionError(f"shared-memory object {record.key!r} of region {name!r} was replaced after the region "
                              "was registered; register it again")
        region = self._open[name] = Region(record, fd, generation)
        return region

    def _span(self, name: str, offset: int, byte_size: int) -> tuple[Region, int]:
        """The region and the object offset of ``byte_size`` bytes at ``offset`` of region ``name``, checked."""
        region = self._region(name)
        r = region.record
        if offset + byte_size > r.byte_size:
            raise RegionError(f"{byte_size} bytes at offset {offset} reach past the end of shared-memory region "
                              f"{name!r} of {r.byte_size} bytes")
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
        """Write ``data`` at ``offset`` of region ``name``.

        Raises:
            UnknownRegionError, RegionError: no such region, or the bytes are not all inside it.
        """
        region, at = self._span(name, offset, data.nbytes)
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        done = 0
        while done < view.nbytes:
            done += os.pwritev(region.fd, [view[done:]], at + done)

    def check(self, name: str, offset: int, byte_size: int) -> None:
        """Raise as ``read`` or ``write`` would for these bytes, without touching them."""
        self._span(name, offset, byte_size)


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
