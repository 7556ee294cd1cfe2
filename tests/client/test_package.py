"""The client package stands alone: numpy + httpx, torch only when asked for, nothing from service/ or kernels/."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import deconv_client

PACKAGE = Path(deconv_client.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_imports_only_the_standard_library_numpy_httpx_and_torch() -> None:
    allowed = set(sys.stdlib_module_names) | {"numpy", "httpx", "torch"}
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) >= 6
    for path in files:
        imported = _imported_modules(path)
        assert imported <= allowed, (path.name, imported - allowed)
        assert not imported & {"service", "kernels", "pickle", "safetensors"}, path.name


def test_importing_the_client_imports_neither_torch_nor_the_service() -> None:
    code = (
        "import sys, deconv_client, deconv_client.cli;"
        "bad = [m for m in ('torch', 'service', 'kernels', 'safetensors') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_public_names_are_documented() -> None:
    for name in deconv_client.__all__:
        obj = getattr(deconv_client, name)
        if callable(obj):
            assert obj.__doc__, name
    for cls in (deconv_client.Client, deconv_client.AsyncClient):
        for method in ("deconv", "deconv_many", "layers", "layer", "ready"):
            assert getattr(cls, method).__doc__, (cls.__name__, method)


def test_works_without_torch() -> None:
    # torch made unimportable: numpy in, numpy out must still work end to end.
    code = """
import sys
sys.modules["torch"] = None
import io, httpx, numpy as np
from deconv_client import Client

def handler(request):
    buf = io.BytesIO()
    np.save(buf, np.ones((1, 2, 4, 4), np.float32))
    return httpx.Response(200, content=buf.getvalue(), headers={"content-type": "application/x-npy"})

with Client(transport=httpx.MockTransport(handler)) as client:
    y = client.deconv("demo", np.zeros((1, 3, 2, 2), np.float32))
assert y.shape == (1, 2, 4, 4) and float(y.sum()) == 32.0
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
