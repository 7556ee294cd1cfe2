"""The Dockerfile against the Makefile (one way to install), the .dockerignore, and the health check script.

No Docker engine is needed: the Dockerfile is read as instructions and the facts it relies on are checked here.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.deploy.conftest import (
    REPO_ROOT,
    Instruction,
    build_args,
    dockerfile_instructions,
    dockerignore_patterns,
    is_ignored,
)

DOCKERFILE = REPO_ROOT / "Dockerfile"
MAKEFILE = REPO_ROOT / "Makefile"
VENV = "/opt/deconv/venv"
IMAGE_CONSTRAINTS = "/opt/deconv/constraints.txt"
KERNEL_CACHE = "/opt/deconv/kernel-cache"

# The CUDA version of the torch wheels on PyPI (no local version tag). Bumping torch: look up its CUDA build
# (e.g. `pip install --dry-run --report` shows its nvidia/cuda requirements) and pick a matching BASE_IMAGE.
PYPI_TORCH_CUDA_MAJOR = {"2.13.0": 13}


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return dockerfile_instructions(DOCKERFILE.read_text())


def _runs(instructions: list[Instruction]) -> list[str]:
    return [i.args for i in instructions if i.keyword == "RUN"]


def _index(instructions: list[Instruction], predicate) -> int:
    matches = [n for n, i in enumerate(instructions) if predicate(i)]
    assert matches, "no such instruction"
    return matches[0]


def _make_invocations(run: str) -> list[str]:
    # Each `make ...` command within a RUN line (up to the next `;`, `&&`, `||` or line end).
    return [m.group(0) for m in re.finditer(r"\bmake\b[^;&|]*", run)]


def _makefile_recipe(target: str) -> str:
    text = MAKEFILE.read_text()
    m = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", text, re.MULTILINE)
    assert m, f"no recipe for {target} in the Makefile"
    return m.group(1)


def _torch_pin(constraints: str) -> str:
    pins = [line.strip() for line in constraints.splitlines() if re.match(r"torch\s*==", line.strip())]
    assert len(pins) == 1, f"constraints.txt should pin torch exactly once, found {pins}"
    return pins[0].split("==", 1)[1].strip()


# --- one source of truth for installing -----------------------------------------------------------------------


def test_dockerfile_installs_through_the_makefile(instructions):
    runs = _runs(instructions)
    makes = [m for run in runs for m in _make_invocations(run)]
    install = [m for m in makes if re.search(r"\binstall\b", m)]
    kernels = [m for m in makes if re.search(r"\bkernels\b", m)]
    assert len(install) == 1, makes
    assert len(kernels) == 1, makes
    for call in (install[0], kernels[0]):
        assert f"VENV={VENV}" in call
        assert f"CONSTRAINTS={IMAGE_CONSTRAINTS}" in call
        assert 'PIP_ARGS="${PIP_ARGS}"' in call
    assert 'EXTRAS="${EXTRAS}"' in install[0]
    # Nothing is installed behind the Makefile's back.
    for run in runs:
        assert not re.search(r"\bpip3?\s+install\b|-m\s+pip\s+install", run), run


def test_makefile_takes_what_the_dockerfile_passes():
    text = MAKEFILE.read_text()
    for variable in ("VENV", "CONSTRAINTS", "PIP_ARGS", "PYTHON"):
        assert re.search(rf"^{variable}\s*\?=", text, re.MULTILINE), f"{variable} must be overridable (?=)"
    recipe = _makefile_recipe("$(VENV)/.installed")
    assert "-c $(CONSTRAINTS)" in recipe
    assert "$(PIP_ARGS)" in recipe
    assert re.search(r"-e \S*\.", recipe)
    assert "-e ./client" in recipe
    assert "$(PY) -m kernels.build" in _makefile_recipe("kernels")
    assert re.search(r"^kernels:\s*install\b", text, re.MULTILINE)


def test_image_constraints_are_constraints_txt_with_torch_replaced(instructions):
    run = next(r for r in _runs(instructions) if IMAGE_CONSTRAINTS in r and "TORCH_SPEC" in r)
    assert "constraints.txt" in run
    m = re.search(r"grep -v -E '([^']+)' constraints\.txt", run)
    assert m, run
    dropped = re.compile(m.group(1))
    constraints = (REPO_ROOT / "constraints.txt").read_text().splitlines()
    kept = [line for line in constraints if not dropped.search(line)]
    assert all(not line.strip().startswith("torch") for line in kept), "the CPU torch pin must be replaced"
    assert len(kept) == len(constraints) - 1, "exactly the torch pin is dropped; every other line is kept"
    assert re.search(r'echo "\$\{TORCH_SPEC\}" >> ' + re.escape(IMAGE_CONSTRAINTS), run)


def test_torch_in_the_image_matches_the_base_image_cuda(instructions):
    args = build_args(instructions)
    base = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-devel-ubuntu[\d.]+", args["BASE_IMAGE"])
    assert base, f"BASE_IMAGE must be an nvidia/cuda *devel* image (nvcc): {args['BASE_IMAGE']}"
    spec = re.fullmatch(r"torch==([\d.]+)(?:\+cu(\d+))?", args["TORCH_SPEC"])
    assert spec, args["TORCH_SPEC"]
    version, cu = spec.groups()
    assert version == _torch_pin((REPO_ROOT / "constraints.txt").read_text()).split("+")[0], \
        "the image runs the torch version CI tests"
    major = int(cu[:-1]) if cu else PYPI_TORCH_CUDA_MAJOR.get(version)
    assert major is not None, f"which CUDA is torch {version} on PyPI built with? add it to PYPI_TORCH_CUDA_MAJOR"
    assert major == int(base.group(1)), "nvcc's CUDA major must be torch's (torch.utils.cpp_extension checks it)"


def test_dependencies_are_installed_before_the_source_is_copied(instructions):
    copies = [(n, i.args) for n, i in enumerate(instructions) if i.keyword == "COPY"]
    install_at = _index(instructions, lambda i: i.keyword == "RUN" and "make install" in i.args)
    kernels_at = _index(instructions, lambda i: i.keyword == "RUN" and re.search(r"make\b.*\bkernels\b", i.args))
    source_at = next(n for n, args in copies if args.split()[:2] == [".", "."])
    early = [args for n, args in copies if n < install_at]
    assert early, "the dependency layer copies the install inputs first"
    early_files = {src for args in early for src in args.split()[:-1]}
    assert early_files == {"Makefile", "pyproject.toml", "constraints.txt", "client/pyproject.toml"}
    assert install_at < source_at < kernels_at


def test_dependency_layer_has_every_file_make_install_reads(instructions):
    # The recipe's prerequisites and what pyproject names (its readme) exist before `make install` runs.
    prerequisites = re.search(r"^\$\(VENV\)/\.installed:(.*)$", MAKEFILE.read_text(), re.MULTILINE).group(1)
    needed = {p.replace("$(CONSTRAINTS)", "constraints.txt") for p in prerequisites.split()}
    install_at = _index(instructions, lambda i: i.keyword == "RUN" and "make install" in i.args)
    before = " ".join(i.args for i in instructions[:install_at])
    for path in needed:
        assert path in before, f"{path} is a prerequisite of make install"
    readme = re.search(r'^readme\s*=\s*"([^"]+)"', (REPO_ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert readme
    assert readme.group(1) in before
    # Stand-ins for the packages that pyproject's package discovery and the client's look for.
    for package in ("kernels/__init__.py", "service/__init__.py", "client/deconv_client/__init__.py"):
        assert package in before
        assert (REPO_ROOT / package).is_file()


def test_kernels_are_compiled_into_the_image_cache_for_the_build_arg_archs(instructions):
    args = build_args(instructions)
    assert args["CUDA_ARCHS"] == "8.0;9.0"
    kernels_run = next(r for r in _runs(instructions) if re.search(r"make\b.*\bkernels\b", r))
    assert 'DECONV_CUDA_ARCH="${CUDA_ARCHS}"' in kernels_run
    env = " ".join(i.args for i in instructions if i.keyword == "ENV")
    assert f"DECONV_KERNEL_CACHE={KERNEL_CACHE}" in env
    # The same arch list at run time: it is part of the build cache key, so the container loads, not compiles.
    assert "DECONV_CUDA_ARCH=${CUDA_ARCHS}" in env
    assert f"PATH={VENV}/bin:" in env


def test_runs_as_a_non_root_user_that_owns_the_kernel_cache(instructions):
    users = [i.args.split(":")[0] for i in instructions if i.keyword == "USER"]
    assert users
    assert users[-1] not in ("root", "0")
    setup = " ".join(_runs(instructions))
    assert re.search(rf"chown \S*{users[-1]}\S* {KERNEL_CACHE}", setup)
    user_at = _index(instructions, lambda i: i.keyword == "USER")
    kernels_at = _index(instructions, lambda i: i.keyword == "RUN" and re.search(r"make\b.*\bkernels\b", i.args))
    assert user_at < kernels_at, "the kernels are built as the user that loads them"


def test_health_check_port_and_command(instructions):
    (healthcheck,) = [i.args for i in instructions if i.keyword == "HEALTHCHECK"]
    assert "deploy/healthcheck.py" in healthcheck
    assert "--start-period=" in healthcheck
    assert "/health/ready" in (REPO_ROOT / "deploy" / "healthcheck.py").read_text()
    assert [i.args for i in instructions if i.keyword == "EXPOSE"] == ["8000"]
    env = " ".join(i.args for i in instructions if i.keyword == "ENV")
    assert "DECONV_HOST=0.0.0.0" in env
    assert "DECONV_PORT=8000" in env
    (cmd,) = [i.args for i in instructions if i.keyword == "CMD"]
    assert cmd == '["python", "-m", "service"]'  # exec form: the server itself gets SIGTERM and drains


def test_dockerignore_keeps_what_the_image_needs_and_drops_the_rest():
    rules = dockerignore_patterns((REPO_ROOT / ".dockerignore").read_text())
    needed = ["Makefile", "pyproject.toml", "constraints.txt", "README.md", "client/pyproject.toml",
              "client/deconv_client/__init__.py", "kernels/build.py", "kernels/csrc/binding.cpp",
              "service/http/app.py", "service/ray_serve.py", "layers/demo.json", "layers/demo.safetensors",
              "deploy/healthcheck.py"]
    for path in needed:
        assert (REPO_ROOT / path).exists(), path
        assert not is_ignored(path, rules), f"{path} must reach the build context"
    for path in [".git/HEAD", ".venv/bin/python", "kernels/__pycache__/build.cpython-311.pyc",
                 "deconv.egg-info/PKG-INFO", "client/deconv_client.egg-info/PKG-INFO", ".env", "tests/conftest.py"]:
        assert is_ignored(path, rules), f"{path} should stay out of the build context"


def test_dockerignore_matcher_follows_docker_semantics():
    rules = dockerignore_patterns("**/__pycache__\nbuild\n*.md\n!README.md\n")
    assert is_ignored("a/b/__pycache__/x.pyc", rules)
    assert is_ignored("__pycache__/x.pyc", rules)
    assert is_ignored("build/lib/x.py", rules)
    assert not is_ignored("kernels/build.py", rules)
    assert is_ignored("NOTES.md", rules)
    assert not is_ignored("README.md", rules)
    assert not is_ignored("docs/x.md", rules)  # "*" stays within one directory


# --- deploy/healthcheck.py ------------------------------------------------------------------------------------


class _Ready(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        body = b'{"status":"ready"}' if self.status == 200 else b'{"error":{"type":"not_ready","message":"x"}}'
        self.send_response(self.status if self.path == "/health/ready" else 404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def ready_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _healthcheck(port: int) -> subprocess.CompletedProcess[str]:
    env = {"DECONV_PORT": str(port), "PATH": "/usr/bin:/bin", "HTTP_PROXY": "http://127.0.0.1:9",
           "http_proxy": "http://127.0.0.1:9"}  # a proxy in the environment must be ignored
    return subprocess.run([sys.executable, str(REPO_ROOT / "deploy" / "healthcheck.py")], env=env,
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(("status", "rc"), [(200, 0), (503, 1)])
def test_healthcheck_script_follows_readiness(ready_server, monkeypatch, status, rc):
    monkeypatch.setattr(_Ready, "status", status)
    result = _healthcheck(ready_server.server_address[1])
    assert result.returncode == rc, result.stderr
    if rc:
        assert "503" in result.stderr
        assert "not_ready" in result.stderr


def test_healthcheck_script_fails_when_nothing_listens(ready_server):
    port = ready_server.server_address[1]
    ready_server.shutdown()
    ready_server.server_close()
    result = _healthcheck(port)
    assert result.returncode == 1
    assert str(port) in result.stderr


def test_image_paths_exist_in_the_repository():
    # Paths the Dockerfile and compose file point into the image at, relative to /opt/deconv/app.
    for rel in ("deploy/healthcheck.py", "layers"):
        assert (REPO_ROOT / rel).exists(), rel
    assert Path(REPO_ROOT / "service" / "__main__.py").is_file()
