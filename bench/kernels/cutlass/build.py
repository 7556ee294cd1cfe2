"""The CUTLASS peer's build: where CUTLASS's headers are, and the extension compiled from this folder's sources
(bench/kernels/cutlass/peer.py documents the kernels and is what callers use).

Headers: ``DECONV_CUTLASS_INCLUDE`` (a directory: the include directory itself, or one holding
``cutlass_library/source/include``, such as an unpacked wheel or a ``pip install --target`` directory), else the
installed ``cutlass_library`` package (found without importing it), else an ``nvidia_cutlass-*.whl`` in
``DECONV_CUTLASS_WHEEL`` or the repository's ``.whl/`` (its headers are extracted into the cache).

The build: ``torch.utils.cpp_extension.load`` of SOURCES for every visible GPU's architecture (or
``DECONV_CUTLASS_ARCH``, e.g. "8.0;9.0"), in a folder of ``DECONV_CUTLASS_CACHE`` (default
``~/.cache/deconv/cutlass``) named by a hash of the sources, the headers' version and place, torch and the flags.
The files compile in parallel: 32 s on a 16-core H200 machine, 2.5 min a file on a 2-core one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
SOURCES = ("binding.cpp", "dgrad.cu", "dgrad_bf16.cu", "dgrad_fp16.cu", "dgrad_tf32.cu")
HEADERS = ("dgrad.cuh",)
EXTENSION_NAME = "deconv_cutlass_peer"
INCLUDE_IN_PACKAGE = ("source", "include")
UTIL_INCLUDE_IN_PACKAGE = ("source", "tools", "util", "include")
CXX_FLAGS = ["-O3", "-std=c++17"]
CUDA_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]


class CutlassNotFoundError(RuntimeError):
    """No CUTLASS headers were found (the message lists where they were looked for)."""


def log_stderr(text: str) -> None:
    print(f"[cutlass-peer] {text}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Headers:
    include: Path  # holds cutlass/cutlass.h
    util_include: Path | None  # holds cutlass/util/ (CUTLASS's tools/util/include), not needed by the kernels
    version: str
    source: str  # where they were found


def _version(include: Path) -> str:
    text = (include / "cutlass" / "version.h").read_text(errors="replace")
    parts = [re.search(rf"#define CUTLASS_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) if m else "?" for m in parts)


def _headers_in(root: Path, source: str) -> Headers | None:
    """Headers under ``root``: the include directory itself, a ``cutlass_library`` package directory, or a
    directory holding one (an unpacked wheel, a ``pip install --target`` directory)."""
    for base in (root, root / "cutlass_library"):
        for inc, util in ((base, None), (base.joinpath(*INCLUDE_IN_PACKAGE), base.joinpath(*UTIL_INCLUDE_IN_PACKAGE)),
                          (base / "include", base / "tools" / "util" / "include")):
            if (inc / "cutlass" / "cutlass.h").is_file():
                u = util if util is not None and util.is_dir() else None
                return Headers(inc, u, _version(inc), source)
    return None


def cache_root() -> Path:
    return Path(os.environ.get("DECONV_CUTLASS_CACHE") or Path.home() / ".cache" / "deconv" / "cutlass")


def _wheel_candidates() -> list[Path]:
    env = os.environ.get("DECONV_CUTLASS_WHEEL", "").strip()
    if env:
        return [Path(env)]
    return sorted((REPO_ROOT / ".whl").glob("nvidia_cutlass-*.whl"), reverse=True)


def _extract_wheel(wheel: Path) -> Path:
    """The wheel's header trees extracted (once) under the cache; returns the directory holding cutlass_library."""
    digest = hashlib.sha256(f"{wheel.resolve()}:{wheel.stat().st_size}:{wheel.stat().st_mtime_ns}".encode())
    dest = cache_root() / "headers" / f"{wheel.stem}-{digest.hexdigest()[:12]}"
    done = dest / ".complete"
    if not done.is_file():
        prefixes = ("/".join(("cutlass_library", *INCLUDE_IN_PACKAGE)) + "/",
                    "/".join(("cutlass_library", *UTIL_INCLUDE_IN_PACKAGE)) + "/")
        with zipfile.ZipFile(wheel) as z:
            members = [m for m in z.namelist() if m.startswith(prefixes) and ".." not in m.split("/")]
            z.extractall(dest, members)
        done.write_text(str(len(members)))
    return dest


def find_headers() -> Headers:
    """Where CUTLASS's headers are (see the module docstring for the order); ``CutlassNotFoundError`` otherwise."""
    tried: list[str] = []
    env = os.environ.get("DECONV_CUTLASS_INCLUDE", "").strip()
    if env:
        found = _headers_in(Path(env), f"DECONV_CUTLASS_INCLUDE={env}")
        if found:
            return found
        tried.append(f"DECONV_CUTLASS_INCLUDE={env} (no cutlass/cutlass.h in it, in cutlass_library/source/include "
                     "or in include/ under it)")
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            found = _headers_in(Path(loc), f"the installed cutlass_library package ({loc})")
            if found:
                return found
        tried.append(f"the cutlass_library package at {list(spec.submodule_search_locations)} (no source/include)")
    else:
        tried.append("an installed cutlass_library package (none is importable: pip install nvidia-cutlass, or "
                     "pip install --target DIR and put DIR on PYTHONPATH)")
    wheels = _wheel_candidates()
    for wheel in wheels:
        if wheel.is_file():
            found = _headers_in(_extract_wheel(wheel), f"the wheel {wheel}")
            if found:
                return found
        tried.append(f"the wheel {wheel} (missing or without cutlass_library/source/include)")
    if not wheels:
        tried.append(f"an nvidia_cutlass-*.whl in DECONV_CUTLASS_WHEEL or {REPO_ROOT / '.whl'} (none)")
    raise CutlassNotFoundError("CUTLASS headers not found; looked in: " + "; ".join(tried))



def cuda_arch_flags() -> list[str]:
    """``-gencode`` flags: ``DECONV_CUTLASS_ARCH`` (e.g. "8.0;9.0") or every visible GPU's architecture. SASS only:
    the kernels are mma.sync (sm_80 and later); Hopper runs its own sm_90 build of them."""
    env = os.environ.get("DECONV_CUTLASS_ARCH", "").strip()
    if env:
        archs = {tuple(int(p) for p in a.split(".")) for a in re.split(r"[;, ]+", env) if a}
    elif torch.cuda.is_available():
        archs = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    else:
        raise RuntimeError("no CUDA GPU is visible and DECONV_CUTLASS_ARCH is not set")
    low = [a for a in archs if a < (8, 0)]
    if low:
        raise RuntimeError(f"the CUTLASS peer's kernels need sm_80 or newer, not {low}")
    return [f"-gencode=arch=compute_{ma}{mi},code=sm_{ma}{mi}" for ma, mi in sorted(archs)]


def build_key(headers: Headers, arch_flags: Sequence[str]) -> str:
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    h.update(repr((torch.__version__, torch.version.cuda, headers.version, str(headers.include), list(arch_flags),
                   CXX_FLAGS, CUDA_FLAGS)).encode())
    return h.hexdigest()[:16]



def compile_extension(log: Callable[[str], None] | None = log_stderr, kernels: int | None = None) -> Any:
    """The extension, compiled on first use (cached: later calls load it); ``kernels`` only names the count in the
    log line."""
    from torch.utils.cpp_extension import load as load_extension

    say = log or (lambda _text: None)
    headers = find_headers()
    arch = cuda_arch_flags()
    build_dir = cache_root() / f"build-{build_key(headers, arch)}"
    build_dir.mkdir(parents=True, exist_ok=True)
    include = [str(HERE), str(headers.include)] + ([str(headers.util_include)] if headers.util_include else [])
    cached = (build_dir / f"{EXTENSION_NAME}.so").is_file()
    count = f"{kernels} kernels, " if kernels else ""
    say(f"{'loading' if cached else 'compiling'} CUTLASS {headers.version} dgrad peer ({count}"
        f"{' '.join(a.split('=')[-1] for a in arch)}) from {headers.source} in {build_dir}"
        + ("" if cached else "; this takes a few minutes"))
    t0 = time.perf_counter()
    stop = threading.Event()

    def progress() -> None:
        while not stop.wait(30.0):
            say(f"still compiling ({time.perf_counter() - t0:.0f} s)")

    ticker = threading.Thread(target=progress, daemon=True)
    if not cached:
        ticker.start()
    try:
        ext = load_extension(name=EXTENSION_NAME, sources=[str(HERE / s) for s in SOURCES],
                             extra_include_paths=include, extra_cflags=CXX_FLAGS,
                             extra_cuda_cflags=[*CUDA_FLAGS, *arch], build_directory=str(build_dir),
                             verbose=False)
    finally:
        stop.set()
    say(f"CUTLASS peer ready in {time.perf_counter() - t0:.1f} s")
    return ext
