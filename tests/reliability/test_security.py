"""Security: no pickle anywhere, the API key on every inference route (compared in constant time), layer names that
cannot leave the repository, weights only from safetensors, no tracebacks or internal paths in responses.
"""

from __future__ import annotations

import ast
import hmac
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.routing import APIRoute

from service.config import Settings
from service.engine import paths as paths_module
from service.engine import pool as pool_module
from service.engine.registry import BatchLimits, RepositoryError, load_repository
from service.http import kserve_routes, model_routes, native_routes, routes, shm_routes
from service.http.app import create_app
from tests.service.conftest import NPY, npy_bytes, run, serve_app, started, write_layer

from .conftest import REPO_ROOT, leaks_internals

# Every Python file of the project that ships or runs (tests build malicious inputs on purpose, so they are out).
SOURCES = sorted(p for d in ("service", "kernels", "client/deconv_client", "bench", "layers", "deploy")
                 for p in (REPO_ROOT / d).rglob("*.py"))
PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
# torch.load's one use: the offline export tool reading the operator's own checkpoint with torch's restricted
# unpickler (weights_only=True: tensors and containers, no code). The server never imports it.
TORCH_LOAD_ALLOWED = {REPO_ROOT / "service" / "export.py"}
DEFAULTS = BatchLimits(8, 1 << 24, 1.0, 16)


def _calls(tree: ast.AST) -> Iterator[tuple[str, ast.Call]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield ast.unparse(node.func), node


def _keyword(call: ast.Call, name: str) -> Any:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value.value if isinstance(kw.value, ast.Constant) else "<not a constant>"
    return None


def test_no_pickle_anywhere():
    assert len(SOURCES) > 20
    problems = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            problems += [f"{path}: imports {n}" for n in names if n.split(".")[0] in PICKLING_MODULES]
            if isinstance(node, ast.ImportFrom) and node.module == "torch" and "load" in {a.name for a in node.names}:
                problems.append(f"{path}: imports torch.load")
        for func, call in _calls(tree):
            if _keyword(call, "allow_pickle") not in (None, False):
                problems.append(f"{path}:{call.lineno}: {func}(allow_pickle=...) is not False")
            if func in ("np.load", "numpy.load") and _keyword(call, "allow_pickle") is not False:
                problems.append(f"{path}:{call.lineno}: {func} without allow_pickle=False")
            if func.endswith("torch.load") and (path not in TORCH_LOAD_ALLOWED
                                                or _keyword(call, "weights_only") is not True):
                problems.append(f"{path}:{call.lineno}: torch.load (pickle)")
            if func.endswith(("pickle.loads", "pickle.load", "torch.jit.load")):
                problems.append(f"{path}:{call.lineno}: {func}")
    assert not problems, "\n".join(problems)


def test_the_server_never_imports_the_export_tool():
    code = ("import sys; from service.http.app import create_app; from service.http import routes; "
            "from service import codec; from service.engine import registry; "
            "create_app(); print('service.export' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          check=True, env={**os.environ, "DECONV_DEVICES": "cpu"})
    assert done.stdout.strip() == "False"


def test_weights_load_only_from_safetensors(tmp_path):
    write_layer(tmp_path, "a")
    weights = tmp_path / "a.safetensors"
    state = {"weight": torch.zeros(4, 6, 3, 3), "bias": torch.zeros(6)}
    torch.save(state, tmp_path / "a.pt")  # a pickle beside the layer is ignored...
    load_repository(tmp_path, DEFAULTS)
    weights.unlink()  # ...and never taken instead of the safetensors file
    with pytest.raises(RepositoryError, match=r"a\.safetensors: missing"):
        load_repository(tmp_path, DEFAULTS)
    weights.write_bytes((tmp_path / "a.pt").read_bytes())  # a pickle under the safetensors name
    with pytest.raises(RepositoryError, match="cannot read as safetensors"):
        load_repository(tmp_path, DEFAULTS)


# --- the API key -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("layers")
    write_layer(root, "small", 4, 6, 3, stride=2, padding=1)
    return root


def _inference_requests() -> list[tuple[str, dict[str, Any]]]:
    x = np.ones((1, 4, 5, 5), np.float32)
    kserve = json.dumps({"inputs": [{"name": "input", "shape": [1, 4, 5, 5], "datatype": "FP32",
                                     "data": x.ravel().tolist()}]}).encode()
    return [("/deconv?layer=small", {"content": npy_bytes(x), "headers": {"content-type": NPY}}),
            ("/v2/models/small/infer", {"content": kserve}),
            ("/v2/models/small/versions/1/infer", {"content": kserve})]


def test_every_inference_route_needs_the_key(repo, monkeypatch):
    api = [r for r in native_routes.router.routes + kserve_routes.router.routes + model_routes.router.routes
           if isinstance(r, APIRoute)]
    documented = create_app(Settings(layer_repository=repo, devices="cpu")).openapi()["paths"]
    # The routers hold every FastAPI route the app serves but the shared-memory ones, which check the key
    # themselves, status included (tests/service/http/test_system_shm.py and test_cuda_shm_routes.py:
    # test_every_route_needs_the_api_key); the inference routes, which the app answers itself, are the only POST
    # routes, but the repository index (a read: its body only filters the list).
    shm = [r for r in shm_routes.router.routes if isinstance(r, APIRoute)]
    inference = {r.path for r in routes.INFERENCE_ROUTES.routes}
    assert {r.path for r in api + shm} | inference == set(documented)
    assert all(r.path.startswith(("/v2/systemsharedmemory/", "/v2/cudasharedmemory/")) for r in shm)
    assert inference == {"/deconv", "/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"}
    assert [r.path for r in api if "POST" in r.methods] == ["/v2/repository/index"]
    for path in inference:
        assert set(documented[path]) == {"post"}, path
    for r in api:  # the app answers the inference routes' paths, and only those
        example = r.path.replace("{name}", "small").replace("{version}", "1")
        assert routes.INFERENCE_ROUTES.match(example) is None, r.path
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)

    async def main() -> None:
        settings = Settings(layer_repository=repo, devices="cpu", api_key="s3cret")
        async with serve_app(settings) as (_, client):
            for path, kw in _inference_requests():
                for auth in (None, "Bearer wrong", "Bearer s3cre", "Basic s3cret", "Bearer s3cret "):
                    headers = {**kw.get("headers", {}), **({"authorization": auth} if auth else {})}
                    r = await client.post(path, content=kw["content"], headers=headers)
                    expected = 200 if auth == "Bearer s3cret " else 401
                    assert r.status_code == expected, (path, auth, r.text[:200])
                r = await client.post(path.replace("small", "no-such-layer"), content=kw["content"],
                                      headers=kw.get("headers", {}))
                assert r.status_code == 401  # the key is checked first: the same answer whatever the name

    run(main())
    assert compared  # the token went through hmac.compare_digest (constant time), not ==
    assert all(b == b"s3cret" for _, b in compared)


def test_the_key_protects_computation_and_every_read_route_stays_open(repo):
    # What docs/operations.md and docs/reliability.md say: the key guards what costs compute (the inference POSTs);
    # descriptions, metadata, health and metrics answer without it (probes and scrapers need no secret), so layer
    # names and shapes are not secret.
    async def main() -> None:
        settings = Settings(layer_repository=repo, devices="cpu", api_key="s3cret")
        async with serve_app(settings) as (_, client):
            for path in ("/v1/layers", "/v1/layers/small", "/v2", "/v2/models/small", "/v2/models/small/ready",
                         "/v2/models/small/versions/1", "/health/live", "/health/ready", "/v2/health/live",
                         "/v2/health/ready", "/metrics", "/openapi.json", "/v2/models/small/config",
                         "/v2/models/small/versions/1/config", "/v2/models/stats", "/v2/models/small/stats",
                         "/v2/models/small/versions/1/stats"):
                r = await client.get(path)
                assert r.status_code == 200, (path, r.text[:200])
            assert (await client.post("/v2/repository/index")).status_code == 200
            for path, kw in _inference_requests():
                r = await client.post(path, content=kw["content"], headers=kw.get("headers", {}))
                assert r.status_code == 401, path

    run(main())


# --- names and paths -------------------------------------------------------------------------------------------


def test_layer_names_cannot_reach_outside_the_repository(repo):
    async def main() -> None:
        async with serve_app(Settings(layer_repository=repo, devices="cpu")) as (_, client):
            x = npy_bytes(np.ones((1, 4, 5, 5), np.float32))
            for name in ("../small", "..%2Fsmall", "/etc/passwd", "..\\small", "small%2F..%2Fsmall", "small%00",
                         "../../layers/demo"):
                for method, path, kw in (
                    ("POST", f"/deconv?layer={name}", {"content": x, "headers": {"content-type": NPY}}),
                    ("GET", f"/v1/layers/{name}", {}),
                    ("GET", f"/v2/models/{name}", {}),
                    ("POST", f"/v2/models/{name}/infer", {"content": b"{}"}),
                ):
                    r = await client.request(method, path, **kw)
                    assert r.status_code == 404, (path, r.status_code, r.text[:200])
                    assert str(repo) not in r.text
                    assert "passwd" not in r.text or "no layer named" in r.text

    run(main())


def test_repository_entries_cannot_point_outside_it(tmp_path):
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    repo.mkdir()
    outside.mkdir()
    write_layer(outside, "evil")
    write_layer(repo, "good")
    (repo / "evil.json").symlink_to(outside / "evil.json")
    (repo / "evil.safetensors").symlink_to(outside / "evil.safetensors")
    with pytest.raises(RepositoryError) as info:
        load_repository(repo, DEFAULTS)
    assert "evil.json: resolves to outside the layer repository" in str(info.value)
    (repo / "evil.json").unlink()
    (repo / "evil.json").write_text((outside / "evil.json").read_text())  # a real config, weights still a link
    with pytest.raises(RepositoryError, match=r"evil\.safetensors: resolves to outside the layer repository"):
        load_repository(repo, DEFAULTS)
    for entry in ("evil.json", "evil.safetensors"):
        (repo / entry).unlink()
    cfg = json.loads((repo / "good.json").read_text())
    (repo / "good.json").write_text(json.dumps({**cfg, "name": "../outside/evil"}))
    with pytest.raises(RepositoryError, match="field 'name'"):
        load_repository(repo, DEFAULTS)


# --- what responses may say ------------------------------------------------------------------------------------


def test_no_traceback_or_internal_path_in_any_response(repo, monkeypatch):
    def crash(x, w, b, layer):
        raise KeyError(f"{REPO_ROOT}/service/engine/worker.py line 1: internal state")

    monkeypatch.setattr(paths_module, "kernel_forward", crash)

    async def main() -> None:
        async with serve_app(Settings(layer_repository=repo, devices="cpu", self_test=False)) as (_, client):
            responses = [await client.post(path, **kw) for path, kw in _inference_requests()]
            responses.append(await client.post("/deconv?layer=small", content=b"\x93NUMPY\x01\x00\xff\xff{",
                                               headers={"content-type": NPY}))
            for r in responses:
                assert r.status_code in (400, 500), r.text[:200]
                assert not leaks_internals(r.text), r.text[:300]
                assert "internal state" not in r.text

    run(main())


def test_a_failed_warm_up_says_why_without_internals(repo, monkeypatch):
    def broken_load(self, layer):
        raise OSError(f"{REPO_ROOT}/secret/weights.bin: device lost")

    monkeypatch.setattr(pool_module.WorkerPool, "load", broken_load)

    async def main() -> None:
        async with serve_app(Settings(layer_repository=repo, devices="cpu"), wait_ready=False) as (app, client):
            assert await started(app) == "failed"
            r = await client.get("/health/ready")
            assert r.status_code == 503
            assert "warm-up failed (OSError)" in r.text
            assert str(REPO_ROOT) not in r.text

    run(main())
