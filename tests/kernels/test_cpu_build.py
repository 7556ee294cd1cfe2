"""``kernels.build`` without a GPU or a compiler: architectures, flags, cache directory, build key."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
import torch

import kernels.build as kb
from kernels.build import KernelBuildError


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.delenv("DECONV_CUDA_ARCH", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8.0", (8, 0, "")),
        ("80", (8, 0, "")),
        ("8.6", (8, 6, "")),
        ("86", (8, 6, "")),
        ("9.0", (9, 0, "")),
        ("9.0a", (9, 0, "a")),
        ("90a", (9, 0, "a")),
        ("sm_90", (9, 0, "")),
        ("sm_90a", (9, 0, "a")),
        ("sm_80", (8, 0, "")),
        ("compute_89", (8, 9, "")),
        ("8.9+PTX", (8, 9, "")),
        ("10.0", (10, 0, "")),
        ("100", (10, 0, "")),
        ("12.0a", (12, 0, "a")),
        (" 8.0 ", (8, 0, "")),
    ],
)
def test_parse_arch(text, expected):
    assert kb._parse_arch(text) == expected


@pytest.mark.parametrize(
    "text", ["", "8", "sm_", "8.0.0", "eight", "8.x", "9.0ab", "sm90", "8.0;9.0", "8.10", "-8.0"]
)
def test_parse_arch_rejects(text):
    with pytest.raises(KernelBuildError, match=r"cannot read CUDA architecture .*'8.0', '9.0' or '9.0a'"):
        kb._parse_arch(text)


def test_kernel_build_error_is_runtime_error():
    assert issubclass(KernelBuildError, RuntimeError)


def test_gencode_flags_sass_for_each_ptx_for_the_newest():
    assert kb.gencode_flags([(8, 0, ""), (9, 0, "a")]) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_90a,code=compute_90a",
    ]
    assert kb.gencode_flags([(8, 6, "")]) == [
        "-gencode=arch=compute_86,code=sm_86",
        "-gencode=arch=compute_86,code=compute_86",
    ]


def test_sm90_machine_code_is_sm90a_with_portable_ptx():
    """CC 9.0 SASS is built as sm_90a (the wgmma tiles) and says so to the host; PTX stays plain compute_90."""
    assert kb.gencode_flags([(8, 0, ""), (9, 0, "")]) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_90,code=compute_90",
    ]
    assert kb.arch_defines([(9, 0, "")]) == ["-DDECONV_SM90A_SASS"]
    assert kb.arch_defines([(8, 0, ""), (9, 0, "a")]) == ["-DDECONV_SM90A_SASS"]
    assert kb.arch_defines([(8, 0, ""), (8, 6, ""), (10, 0, "")]) == []


def test_cache_root_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DECONV_KERNEL_CACHE", str(tmp_path / "cache"))
    assert kb.cache_root() == tmp_path / "cache"
    monkeypatch.setenv("DECONV_KERNEL_CACHE", "~/deconv-cache")
    assert kb.cache_root() == Path.home() / "deconv-cache"  # ~ expanded


def test_cache_root_default(monkeypatch, tmp_path):
    monkeypatch.delenv("DECONV_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kb.cache_root() == tmp_path / "deconv" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert kb.cache_root() == Path.home() / ".cache" / "deconv" / "kernels"
    monkeypatch.setenv("DECONV_KERNEL_CACHE", "")  # empty counts as unset
    assert kb.cache_root() == Path.home() / ".cache" / "deconv" / "kernels"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ("8.0;9.0", [(8, 0, ""), (9, 0, "")]),
        ("9.0, 8.0", [(8, 0, ""), (9, 0, "")]),  # sorted
        ("8.0 8.6  9.0a", [(8, 0, ""), (8, 6, ""), (9, 0, "a")]),
        ("8.0;80;sm_80", [(8, 0, "")]),  # deduplicated
        ("sm_90a;", [(9, 0, "a")]),
        (" 12.0 ", [(12, 0, "")]),
    ],
)
def test_cuda_archs_from_env(monkeypatch, env, expected):
    monkeypatch.setenv("DECONV_CUDA_ARCH", env)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kb.cuda_archs() == expected


@pytest.mark.parametrize("env", ["7.5", "8.0;7.5", "sm_70", "6.1"])
def test_cuda_archs_rejects_old_architectures(monkeypatch, env):
    monkeypatch.setenv("DECONV_CUDA_ARCH", env)
    with pytest.raises(KernelBuildError, match=r"compute capability \d\.\d is too old: .*sm_80"):
        kb.cuda_archs()


def test_cuda_archs_rejects_unreadable_env(monkeypatch):
    monkeypatch.setenv("DECONV_CUDA_ARCH", "8.0;ampere")
    with pytest.raises(KernelBuildError, match="cannot read CUDA architecture 'ampere'"):
        kb.cuda_archs()


@pytest.mark.parametrize("env", [";", " , ", ";;"])
def test_cuda_archs_env_without_any_architecture_is_an_error(monkeypatch, env):
    # KNOWN BUG: kernels/build.py cuda_archs returns [] for a DECONV_CUDA_ARCH made of separators only (the
    # value is non-blank, so the GPU fallback is skipped, and every split part is empty); build_key then fails
    # with an IndexError in gencode_flags instead of a KernelBuildError that names the variable.
    monkeypatch.setenv("DECONV_CUDA_ARCH", env)
    with pytest.raises(KernelBuildError, match="DECONV_CUDA_ARCH"):
        kb.cuda_archs()


def test_cuda_archs_without_gpu_and_env_explains(no_gpu):
    with pytest.raises(KernelBuildError, match=r"no CUDA GPU is visible and DECONV_CUDA_ARCH is not set"):
        kb.cuda_archs()


def test_cuda_archs_blank_env_means_unset(monkeypatch):
    monkeypatch.setenv("DECONV_CUDA_ARCH", "   ")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(KernelBuildError, match="no CUDA GPU is visible"):
        kb.cuda_archs()


def test_cuda_archs_uses_visible_gpus(monkeypatch):
    monkeypatch.delenv("DECONV_CUDA_ARCH", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    capabilities = {0: (9, 0), 1: (8, 0), 2: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: capabilities[i])
    assert kb.cuda_archs() == [(8, 0, ""), (9, 0, "")]
    capabilities[1] = (7, 5)
    with pytest.raises(KernelBuildError, match=r"7\.5 is too old"):
        kb.cuda_archs()


def test_load_without_gpu_raises_build_error(no_gpu):
    if kb._module is not None:  # pragma: no cover - only where the extension was built in this process
        pytest.skip("the extension is already loaded")
    with pytest.raises(KernelBuildError, match="no CUDA GPU is visible"):
        kb.load()
    assert kb._module is None


def test_sources_are_the_csrc_files():
    sources = kb._sources()
    assert "binding.cpp" in sources  # load() hands this one to load_inline as the C++ source
    assert any(name.endswith(".cu") for name in sources)
    assert list(sources) == list(kb._sources())  # a stable order, for a stable build key
    for name, text in sources.items():
        assert text == (kb.CSRC / name).read_text()
        assert text.strip(), name


def test_sources_cover_every_local_include():
    # Every file that a source #includes from csrc must be in the build key, or editing it would load a stale
    # cached library (this caught *.cuh headers missing from the key).
    sources = kb._sources()
    for name, text in sources.items():
        for included in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, flags=re.MULTILINE):
            if (kb.CSRC / included).exists():
                assert included in sources, f"{name} includes {included}, which the build key leaves out"


def test_package_data_ships_every_source():
    # A wheel must carry every file that the run-time build reads.
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(kb.__file__).resolve().parent.parent / "pyproject.toml"
    if not pyproject.exists():  # pragma: no cover - an installed package, not a checkout
        pytest.skip("no pyproject.toml beside the kernels package")
    patterns = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["kernels"]
    for name in kb._sources():
        assert any(fnmatch.fnmatch(f"csrc/{name}", pattern) for pattern in patterns), name


def test_no_fast_math_in_flags():
    # Exact fp32 must stay exact.
    for flag in kb.CXX_FLAGS + kb.CUDA_FLAGS:
        assert "fast-math" not in flag
        assert "fast_math" not in flag


# build_key with fake sources and a fake nvcc, so that it needs no compiler.

FAKE_SOURCES = {
    "kernel.h": "#pragma once\n",
    "kernel.cu": "__global__ void k() {}\n",
    "binding.cpp": "int x;\n",
}


@pytest.fixture
def fake_toolchain(monkeypatch):
    state = {"sources": dict(FAKE_SOURCES), "nvcc": "Build cuda_12.4.r12.4/compiler.34097967_0"}
    monkeypatch.setattr(kb, "_sources", lambda: dict(state["sources"]))
    monkeypatch.setattr(kb, "_nvcc_version", lambda: state["nvcc"])
    return state


ARCHS = [(8, 0, ""), (9, 0, "")]


def test_build_key_is_stable(fake_toolchain):
    key = kb.build_key(ARCHS)
    assert re.fullmatch(r"[0-9a-f]{16}", key)
    assert kb.build_key(list(ARCHS)) == key
    assert kb.build_key([(8, 0, ""), (9, 0, "")]) == key


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["sources"].update({"kernel.cu": "__global__ void k() { }\n"}),  # one character
        lambda s: s["sources"].update({"kernel.h": "#pragma once\n\n"}),
        lambda s: s["sources"].update({"extra.cu": ""}),  # a new file, even empty
        lambda s: s["sources"].pop("kernel.h"),
        lambda s: s["sources"].update({"kernel2.cu": s["sources"].pop("kernel.cu")}),  # renamed
        lambda s: s.update(nvcc="Build cuda_12.6.r12.6/compiler.35059454_0"),
    ],
    ids=["source-text", "header-text", "new-file", "removed-file", "renamed-file", "nvcc-version"],
)
def test_build_key_changes_with_inputs(fake_toolchain, change):
    key = kb.build_key(ARCHS)
    change(fake_toolchain)
    assert kb.build_key(ARCHS) != key


@pytest.mark.parametrize(
    "archs",
    [[(8, 0, "")], [(9, 0, "")], [(8, 0, ""), (9, 0, "a")], [(8, 0, ""), (8, 6, ""), (9, 0, "")]],
    ids=["80", "90", "80+90a", "80+86+90"],
)
def test_build_key_changes_with_architectures(fake_toolchain, archs):
    assert kb.build_key(archs) != kb.build_key(ARCHS)


def test_build_key_changes_with_torch_version(fake_toolchain, monkeypatch):
    key = kb.build_key(ARCHS)
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert kb.build_key(ARCHS) != key


def test_build_key_changes_with_flags(fake_toolchain, monkeypatch):
    key = kb.build_key(ARCHS)
    monkeypatch.setattr(kb, "CUDA_FLAGS", [*kb.CUDA_FLAGS, "-G"])
    assert kb.build_key(ARCHS) != key
    monkeypatch.setattr(kb, "CUDA_FLAGS", kb.CUDA_FLAGS[:-1])
    assert kb.build_key(ARCHS) == key
    monkeypatch.setattr(kb, "CXX_FLAGS", [*kb.CXX_FLAGS, "-g"])
    assert kb.build_key(ARCHS) != key


def test_nvcc_missing_raises_build_error(monkeypatch):
    monkeypatch.setattr(kb.shutil, "which", lambda name: None)
    monkeypatch.setenv("CUDA_HOME", "/nonexistent/cuda")
    with pytest.raises(KernelBuildError, match="nvcc was not found or failed"):
        kb._nvcc_version()


def test_ptx_only_when_the_architectures_are_named(monkeypatch):
    """A build for the visible GPUs is machine code only; one for named architectures (an image) carries PTX, and
    the two have different cache keys."""
    assert kb.gencode_flags([(9, 0, "")], ptx=False) == ["-gencode=arch=compute_90a,code=sm_90a"]
    monkeypatch.delenv("DECONV_CUDA_ARCH", raising=False)
    assert not kb.archs_named()
    monkeypatch.setenv("DECONV_CUDA_ARCH", " 9.0 ")
    assert kb.archs_named()
    monkeypatch.setattr(kb, "_nvcc_version", lambda: "Cuda compilation tools, release 13.0, V13.0.88")
    assert kb.build_key([(9, 0, "")], ptx=True) != kb.build_key([(9, 0, "")], ptx=False)


@pytest.fixture
def fresh_load(monkeypatch, tmp_path, fake_toolchain):
    """``kb.load`` in a state where nothing is loaded, with an empty cache and a recording fake ``load_inline``."""
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(kb, "_module", None)
    monkeypatch.setattr(kb, "_module_key", None)
    monkeypatch.setattr(kb, "cuda_archs", lambda: [(9, 0, "a")])
    monkeypatch.delenv("DECONV_CUDA_ARCH", raising=False)
    monkeypatch.setenv("DECONV_KERNEL_CACHE", str(tmp_path))
    built = []

    def fake_load_inline(name, build_directory, **kwargs):
        built.append(name)
        return f"compiled {name}"

    monkeypatch.setattr(cpp, "load_inline", fake_load_inline)
    key = kb.build_key([(9, 0, "a")], ptx=False)
    library = tmp_path / key / f"deconv_kernels_{key}.so"
    return built, library


def test_a_cached_library_is_imported_without_the_build_tool(fresh_load, monkeypatch):
    built, library = fresh_load
    library.parent.mkdir(parents=True)
    library.write_bytes(b"\x7fELF")
    imported = []
    monkeypatch.setattr(kb, "_import_built", lambda name, path: imported.append((name, path)) or f"imported {name}")
    module = kb.load()
    assert imported == [(library.stem, library)]
    assert module == f"imported {library.stem}"
    assert built == []
    assert kb.loaded_key() == library.parent.name


def test_a_cached_library_that_cannot_be_imported_is_built_again(fresh_load, caplog):
    built, library = fresh_load
    library.parent.mkdir(parents=True)
    library.write_bytes(b"not a shared object")  # a build cut short
    with caplog.at_level("WARNING", logger="deconv.kernels"):
        module = kb.load()
    assert "could not be loaded" in caplog.text
    assert not library.exists(), "the damaged library is removed, so that the build tool links it again"
    assert built == [library.stem]
    assert module == f"compiled {library.stem}"


def test_without_a_cached_library_the_kernels_are_built(fresh_load, monkeypatch):
    built, library = fresh_load
    monkeypatch.setattr(kb, "_import_built", lambda name, path: pytest.fail("nothing to import"))
    assert kb.load() == f"compiled {library.stem}"
    assert built == [library.stem]
