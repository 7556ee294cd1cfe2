"""Measured kernel choices kept on disk: a problem is measured once per GPU model, driver, torch and kernel build,
not once per process.

``kernels.tuning`` measures the kernels that can run a problem on its first call and keeps the fastest in memory.
With this store, the choice is also written to a small JSON file, one per GPU identity (``identity``: the device's
name and compute capability, the driver's version, torch's version and the key of the loaded kernel build), and a
later process (a restarted server, the next run of a script) reads it instead of measuring again. A new driver,
torch or kernel build is a new identity, so it measures anew: choices are never carried over to kernels they were
not measured on.

Where: ``DECONV_TUNE_CACHE`` names the directory; unset, ``choices`` in the kernel build cache
(``~/.cache/deconv/kernels/choices``, so that an image's cache volume keeps them too); ``off`` (or ``0``,
``false``, ``no``) keeps choices in memory only. Deleting a file forgets its choices. A file holds at most
``MAX_STORED`` problems (the oldest dropped first). Several processes may share a file: each write holds an
exclusive lock on ``<file>.lock``, reads the file again and adds its choice, then replaces the file in one rename,
so no reader ever sees half a file and no writer loses another's choices. A file that cannot be read or parsed is
ignored with a warning (and replaced by the next write); an entry that does not parse is skipped; a directory that
cannot be written turns the store off for that GPU, with one warning: the choices still hold in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import re
import threading
from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("deconv.tuning")

STORE_ENV = "DECONV_TUNE_CACHE"
MAX_STORED = 4096
FORMAT = 1  # the file's layout; a file of another format is ignored
_OFF = ("0", "off", "false", "no")
DRIVER_REPORT = Path("/proc/driver/nvidia/version")  # the NVIDIA kernel module's version line
_CHOICE_FIELDS = {"path": (str, type(None)), "config": (int, type(None)), "split": (int, type(None)),
                  "staged": (bool, type(None)), "rounded": (bool, type(None))}


def store_dir() -> Path | None:
    """The directory of the choice files (``DECONV_TUNE_CACHE``), or None when the store is off."""
    env = os.environ.get(STORE_ENV, "").strip()
    if env.lower() in _OFF:
        return None
    if env:
        return Path(env).expanduser()
    from kernels.build import cache_root

    return cache_root() / "choices"


def driver_version() -> str:
    """The NVIDIA driver's version ("580.159.04"), from the kernel module's report, else the CUDA driver API's
    version number ("cuda13000"), else "unknown"."""
    with contextlib.suppress(OSError):
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]*)",
                      DRIVER_REPORT.read_text())
        if m:
            return m.group(1)
    with contextlib.suppress(Exception):
        import ctypes

        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"cuda{version.value}"
    return "unknown"


def identity(device: torch.device, kernel_key: str) -> str:
    """The name of the file that holds the choices measured on ``device`` with the kernel build ``kernel_key``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    major, minor = torch.cuda.get_device_capability(index)
    parts = [name, f"sm{major}{minor}", f"driver{driver_version()}", f"torch{torch.__version__}", kernel_key]
    return "-".join(re.sub(r"[^A-Za-z0-9.]+", "_", p).strip("_") for p in parts)


def problem_id(key: tuple[Hashable, ...]) -> str:
    """A problem's key (``kernels.tuning.Tuner.key``) as text, without its device (a file is for one device):
    sizes, strides and flags as JSON."""
    def plain(part: Any) -> Any:
        if isinstance(part, torch.device):
            return None
        if isinstance(part, torch.dtype):
            return str(part).removeprefix("torch.")
        if dataclasses.is_dataclass(part) and not isinstance(part, type):
            return [plain(v) for v in dataclasses.astuple(part)]
        if isinstance(part, (tuple, list, torch.Size)):
            return [plain(v) for v in part]
        if part is None or isinstance(part, (bool, int, float, str)):
            return part
        return repr(part)

    return json.dumps([plain(p) for p in key if not isinstance(p, torch.device)], separators=(",", ":"))


def _choice_fields(entry: object) -> dict[str, Any] | None:
    """A stored choice's fields, or None when ``entry`` is not a well-formed choice."""
    if not isinstance(entry, dict) or set(entry) != set(_CHOICE_FIELDS):
        return None
    for field, types in _CHOICE_FIELDS.items():
        value = entry[field]
        # bool is an int: a config or split must be a real int, a flag a real bool
        if not isinstance(value, types) or (types[0] is int and isinstance(value, bool)):
            return None
    return entry


class ChoiceFile:
    """The choices of one GPU identity in one JSON file (``{"format": 1, "choices": {problem: fields}}``)."""

    def __init__(self, path: Path, max_entries: int = MAX_STORED) -> None:
        self.path = path
        self.max_entries = max_entries
        self._lock = threading.Lock()  # one writer at a time in this process (the file lock is per process)

    def read(self) -> dict[str, dict[str, Any]]:
        """Every well-formed entry of the file (an unreadable or foreign file: none, with a warning)."""
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("measured kernel choices: cannot read %s (%s); it is ignored", self.path, exc)
            return {}
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("choices"), dict):
            log.warning("measured kernel choices: %s is not a choice file of format %d; it is ignored", self.path,
                        FORMAT)
            return {}
        out = {}
        for problem, entry in doc["choices"].items():
            fields = _choice_fields(entry)
            if isinstance(problem, str) and fields is not None:
                out[problem] = fields
        return out

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock, open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def write(self, problem: str, fields: dict[str, Any]) -> None:
        """Add (or refresh) one problem's choice, keeping the others' (also those other processes wrote).

        Raises:
            OSError: the directory or file cannot be written.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            choices = self.read()
            choices.pop(problem, None)
            choices[problem] = fields
            while len(choices) > self.max_entries:
                del choices[next(iter(choices))]
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"format": FORMAT, "choices": choices}, indent=0) + "\n")
            tmp.replace(self.path)
