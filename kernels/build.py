"""Run-time build of the CUDA kernels: the one place that calls ``torch.utils.cpp_extension.load_inline``.

The sources are the real files in ``kernels/csrc``; their text is handed to ``load_inline``. Builds are cached
in a stable directory (``DECONV_KERNEL_CACHE``, default ``~/.cache/deconv/kernels``) under a key made of the
sources, the torch version, the CUDA version (torch's and nvcc's), the target architectures and the compiler
flags: a change to any of them builds anew, anything else loads the cached library in about a second. A cached
library is imported directly, without running the build tool again, so that a process that finds its build (an image,
a copied cache) needs neither ninja nor a compiler to start; one that cannot be imported is built again.

Target architectures: ``DECONV_CUDA_ARCH`` (for example ``"8.0;9.0"``, as in ``TORCH_CUDA_ARCH_LIST``) or,
when unset, those of the visible GPUs. Naming them explicitly lets an image be built on a machine without a GPU:
``python -m kernels.build --arch "8.0;9.0"``; such a build also carries PTX for the newest named architecture, so
that a newer GPU can compile the kernels when it loads them. A build for the visible GPUs carries machine code
only: it is for those GPUs, and PTX would cost a third of the build (the compiler's front end runs once more for
it; bench/NOTES.md v25). nvcc compiles the targets of one build in parallel (``--threads``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("deconv.kernels")

CSRC = Path(__file__).resolve().parent / "csrc"
MIN_ARCH = (8, 0)  # mma.sync with TF32/BF16 operands needs sm_80

# Flags that change the generated code, and so belong in the cache key. No fast-math: exact fp32 must stay exact.
CXX_FLAGS = ["-O3", "-std=c++17"]
CUDA_FLAGS = ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr"]
# Not in the key (the code is the same): nvcc compiles a build's targets (SASS per architecture, PTX) in parallel.
NVCC_THREADS = ["--threads", "0"]

_lock = threading.Lock()
_module: ModuleType | None = None
_module_key: str | None = None


class KernelBuildError(RuntimeError):
    """The CUDA kernels could not be built or loaded."""


def _parse_arch(text: str) -> tuple[int, int, str]:
    """'8.0' / '80' / '9.0a' / 'sm_90' -> (8, 0, '') / (9, 0, 'a')."""
    m = re.fullmatch(r"(?:sm_|compute_)?(\d+)\.?(\d)([a-z]?)(?:\+PTX)?", text.strip())
    if m is None:
        raise KernelBuildError(f"cannot read CUDA architecture {text!r}; write it like '8.0', '9.0' or '9.0a'")
    return int(m.group(1)), int(m.group(2)), m.group(3)


def cuda_archs() -> list[tuple[int, int, str]]:
    """The architectures to build for: ``DECONV_CUDA_ARCH`` if set, else every visible GPU's."""
    env = os.environ.get("DECONV_CUDA_ARCH", "").strip()
    if env:
        archs = [_parse_arch(a) for a in re.split(r"[;, ]+", env) if a]
        if not archs:
            raise KernelBuildError(f"DECONV_CUDA_ARCH={env!r} names no architecture; write e.g. '8.0;9.0'")
    elif torch.cuda.is_available():
        archs = [(*torch.cuda.get_device_capability(i), "") for i in range(torch.cuda.device_count())]
    else:
        raise KernelBuildError(
            "no CUDA GPU is visible and DECONV_CUDA_ARCH is not set; set it (e.g. '8.0;9.0') to build without a GPU"
        )
    for major, minor, _ in archs:
        if (major, minor) < MIN_ARCH:
            raise KernelBuildError(
                f"compute capability {major}.{minor} is too old: the kernels need sm_80 (Ampere) or newer"
            )
    return sorted(set(archs))


def _sass_suffix(major: int, minor: int, suffix: str) -> str:
    """sm_90 machine code is built as sm_90a, which every compute capability 9.0 GPU runs: it holds the wgmma
    tiles (conv_transpose2d_wgmma.cu)."""
    return "a" if (major, minor) == (9, 0) else suffix


def gencode_flags(archs: list[tuple[int, int, str]], ptx: bool = True) -> list[str]:
    """SASS for every architecture (9.0 as 9.0a) plus, with ``ptx``, PTX for the newest as named, so that newer
    GPUs can still JIT the kernels."""
    flags = []
    for ma, mi, s in archs:
        sa = _sass_suffix(ma, mi, s)
        flags.append(f"-gencode=arch=compute_{ma}{mi}{sa},code=sm_{ma}{mi}{sa}")
    if ptx:
        ma, mi, s = archs[-1]
        flags.append(f"-gencode=arch=compute_{ma}{mi}{s},code=compute_{ma}{mi}{s}")
    return flags


def archs_named() -> bool:
    """Whether the architectures are named (``DECONV_CUDA_ARCH``: an image for GPUs not seen here, which gets PTX
    too) rather than those of the visible GPUs."""
    return bool(os.environ.get("DECONV_CUDA_ARCH", "").strip())


def arch_defines(archs: list[tuple[int, int, str]]) -> list[str]:
    """``-DDECONV_SM90A_SASS`` when the build holds sm_90a code: the host then launches the wgmma tiles on
    compute capability 9.0 GPUs (everywhere else they fall back to mma.sync tiles)."""
    return ["-DDECONV_SM90A_SASS"] if any((ma, mi) == (9, 0) for ma, mi, _ in archs) else []


def cache_root() -> Path:
    """Directory that holds one sub-directory per build key."""
    env = os.environ.get("DECONV_KERNEL_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "deconv" / "kernels"


def _sources() -> dict[str, str]:
    files = [f for ext in ("h", "cuh", "cu", "cpp") for f in sorted(CSRC.glob(f"*.{ext}"))]
    return {f.name: f.read_text() for f in files}


def _nvcc_version() -> str:
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"nvcc was not found or failed ({exc}); the kernels are compiled at run time") from exc
    return out.strip().splitlines()[-1]


def build_key(archs: list[tuple[int, int, str]], ptx: bool = True) -> str:
    """Hash of everything that changes the built library."""
    h = hashlib.sha256()
    for name, text in _sources().items():
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    for part in (torch.__version__, str(torch.version.cuda), _nvcc_version(), *gencode_flags(archs, ptx),
                 *arch_defines(archs), *CXX_FLAGS, *CUDA_FLAGS):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def loaded() -> ModuleType | None:
    """The kernels extension if this process has loaded it already, else None (never builds)."""
    return _module


def loaded_key() -> str | None:
    """The build key (``build_key``) of the extension this process loaded, else None."""
    return _module_key


def _import_built(name: str, path: Path) -> ModuleType:
    """Import the extension library ``path`` as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not an importable extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(verbose: bool = False) -> ModuleType:
    """Build (first time) or load (cache hit) the kernels extension; thread-safe, once per process."""
    global _module, _module_key
    with _lock:
        if _module is not None:
            return _module
        from torch.utils.cpp_extension import load_inline

        archs = cuda_archs()
        ptx = archs_named()
        key = build_key(archs, ptx)
        name = f"deconv_kernels_{key}"
        build_dir = cache_root() / key
        build_dir.mkdir(parents=True, exist_ok=True)
        arch_text = ", ".join(f"sm_{ma}{mi}{s}" for ma, mi, s in archs)
        t0 = time.perf_counter()
        built = sorted(build_dir.glob(f"{name}*.so"))
        if built:
            try:
                module = _import_built(name, built[0])
            except (ImportError, OSError) as exc:  # a damaged or partial library: link it again
                log.warning("the cached kernels in %s could not be loaded (%s); building them again", build_dir, exc)
                built[0].unlink(missing_ok=True)
            else:
                log.info("loaded kernels for %s from the build cache in %.2f s", arch_text, time.perf_counter() - t0)
                _module, _module_key = module, key
                return module
        log.info("compiling kernels for %s into %s (two to three minutes; later starts load them)", arch_text,
                 build_dir)
        src = _sources()
        try:
            module = load_inline(
                name=name,
                cpp_sources=[src["binding.cpp"]],
                cuda_sources=[text for fname, text in src.items() if fname.endswith(".cu")],
                extra_cflags=CXX_FLAGS,
                extra_cuda_cflags=[*CUDA_FLAGS, *NVCC_THREADS, *gencode_flags(archs, ptx), *arch_defines(archs)],
                extra_include_paths=[str(CSRC)],
                build_directory=str(build_dir),
                verbose=verbose,
            )
        except Exception as exc:  # compiler output is in the exception text
            raise KernelBuildError(f"building the CUDA kernels failed: {exc}") from exc
        log.info("compiled kernels for %s in %.1f s", arch_text, time.perf_counter() - t0)
        _module, _module_key = module, key
        return module


def main() -> None:
    """``python -m kernels.build [--arch LIST]``: build the kernels now (e.g. while building an image).

    What stops the build (a CPU build of torch, no architecture, nvcc missing, a compiler error) ends the command
    with its message and exit status 1, no traceback."""
    import sys

    prog = "python -m kernels.build"
    parser = argparse.ArgumentParser(prog=prog, description="Build the deconv CUDA kernels into the build cache.")
    parser.add_argument("--arch", help="architectures, e.g. '8.0;9.0' (default: DECONV_CUDA_ARCH or the GPUs')")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's command lines")
    args = parser.parse_args()
    if torch.version.cuda is None:
        sys.exit(f"{prog}: torch {torch.__version__} is a CPU build; building the kernels needs a CUDA build of torch "
                 "(e.g. torch==2.13.0 from PyPI or https://download.pytorch.org/whl/cu128) and the CUDA toolkit's "
                 "nvcc (CUDA_HOME)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.arch:
        os.environ["DECONV_CUDA_ARCH"] = args.arch
    try:
        load(verbose=args.verbose)
    except KernelBuildError as exc:
        sys.exit(f"{prog}: {exc}")
    log.info("build cache: %s", cache_root())


if __name__ == "__main__":
    main()
