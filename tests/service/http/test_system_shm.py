"""KServe v2 system shared memory (``/v2/systemsharedmemory``, service/http/shm_regions.py).

tritonclient against a real server in both modes (one process; two HTTP processes, where registering, inferring
and unregistering go through different connections and so through different processes), numbers against
``F.conv_transpose2d`` in float64; then the validation, bounds, API-key and life-cycle cases in-process, and the
shared store of a multi-process server through two tables on one directory.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from service.config import Settings
from service.http.shm_regions import RegionError, RegionTable, UnknownRegionError
from tests.numerics import rel_err

from ..conftest import ServerProcess, reference, run, serve_app, write_layer

API_KEY = "shm-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
X_SHAPE = (3, 4, 6, 6)
Y_SHAPE = (3, 6, 12, 12)
X_BYTES = int(np.prod(X_SHAPE)) * 4
Y_BYTES = int(np.prod(Y_SHAPE)) * 4


def _x(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(X_SHAPE).astype(np.float32)


class Objects:
    """POSIX shared-memory objects made for one test, unlinked at its end."""

    def __init__(self) -> None:
        self.made: list[shared_memory.SharedMemory] = []

    def new(self, size: int) -> tuple[str, shared_memory.SharedMemory]:
        """A new object of ``size`` bytes and its key (as shm_open takes it)."""
        shm = shared_memory.SharedMemory(f"deconv-test-{uuid.uuid4().hex[:12]}", create=True, size=size)
        self.made.append(shm)
        return "/" + shm.name.lstrip("/"), shm

    def close(self) -> None:
        for shm in self.made:
            shm.close()
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()


@pytest.fixture
def objects() -> Iterator[Objects]:
    made = Objects()
    yield made
    made.close()


# --- tritonclient against a live server, one and two HTTP processes -----------------------------------------


@pytest.fixture(scope="module", params=["1", "2"], ids=["single", "multi"])
def live(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    root = tmp_path_factory.mktemp("layers")
    module = write_layer(root, "up", in_channels=4, out_channels=6, kernel_size=4, stride=2, padding=1)
    proc = ServerProcess({"DECONV_LAYER_REPOSITORY": str(root), "DECONV_HTTP_PROCESSES": request.param,
                          "DECONV_API_KEY": API_KEY}, root / "server.log")
    try:
        proc.wait_ready()
        yield proc, module
    finally:
        assert proc.stop() == 0, proc.log()


def _triton(proc: ServerProcess) -> Any:
    """A new tritonclient client: a new connection (a multi-process server hands connections out in turn)."""
    import tritonclient.http as triton

    return triton.InferenceServerClient(proc.url.removeprefix("http://"), network_timeout=30.0)


def test_tritonclient_infers_through_system_shared_memory(live):
    import tritonclient.http as triton
    import tritonclient.utils.shared_memory as shm

    proc, module = live
    tag = uuid.uuid4().hex[:8]
    x = _x(1)
    ref = reference(module, torch.from_numpy(x))
    ins = shm.create_shared_memory_region(f"in-{tag}", f"/deconv-in-{tag}", X_BYTES)
    outs = shm.create_shared_memory_region(f"out-{tag}", f"/deconv-out-{tag}", Y_BYTES + 64)
    clients = [_triton(proc) for _ in range(4)]
    try:
        shm.set_shared_memory_region(ins, [x])
        register = clients[0]
        assert "system_shared_memory" in register.get_server_metadata()["extensions"]
        with pytest.raises(triton.InferenceServerException, match="API key"):
            register.register_system_shared_memory(f"in-{tag}", f"/deconv-in-{tag}", X_BYTES)
        register.register_system_shared_memory(f"in-{tag}", f"/deconv-in-{tag}", X_BYTES, headers=AUTH)
        register.register_system_shared_memory(f"out-{tag}", f"/deconv-out-{tag}", Y_BYTES + 64, headers=AUTH)
        # every other connection (both HTTP processes of a multi-process server) sees both regions
        for client in clients[1:]:
            status = client.get_system_shared_memory_status(headers=AUTH)
            assert {(s["name"], s["byte_size"]) for s in status} >= {(f"in-{tag}", X_BYTES),
                                                                   (f"out-{tag}", Y_BYTES + 64)}
        for offset, client in zip((0, 64, 0), clients[1:], strict=True):
            inp = triton.InferInput("input", list(X_SHAPE), "FP32")
            inp.set_shared_memory(f"in-{tag}", X_BYTES)
            out = triton.InferRequestedOutput("output", binary_data=True)
            out.set_shared_memory(f"out-{tag}", Y_BYTES, offset=offset)
            result = client.infer("up", [inp], outputs=[out], headers=AUTH)
            output = result.get_output("output")
            assert "data" not in output  # no data in the answer
            params = output["parameters"]
            assert params["shared_memory_region"] == f"out-{tag}"
            assert params["shared_memory_byte_size"] == Y_BYTES
            y = shm.get_contents_as_numpy(outs, np.float32, list(Y_SHAPE), offset=offset)
            assert rel_err(y, ref) < 1e-5
        # unregistered through one connection: no connection can use it any more
        clients[0].unregister_system_shared_memory(f"in-{tag}", headers=AUTH)
        for client in clients[1:]:
            inp = triton.InferInput("input", list(X_SHAPE), "FP32")
            inp.set_shared_memory(f"in-{tag}", X_BYTES)
            with pytest.raises(triton.InferenceServerException, match="no shared-memory region"):
                client.infer("up", [inp], headers=AUTH)
        clients[1].unregister_system_shared_memory(headers=AUTH)
        for client in clients:
            assert client.get_system_shared_memory_status(headers=AUTH) == []
    finally:
        for client in clients:
            client.close()
        shm.destroy_shared_memory_region(ins)
        shm.destroy_shared_memory_region(outs)


# --- validation, bounds, API key, life cycle (in-process) ---------------------------------------------------


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    root = tmp_path_factory.mktemp("layers")
    return root, write_layer(root, "up", in_channels=4, out_channels=6, kernel_size=4, stride=2, padding=1)


def _settings(root: Path, **overrides: Any) -> Settings:
    return Settings(layer_repository=root, devices="cpu", log_level="warning", api_key=API_KEY, **overrides)


def _register(client: httpx.AsyncClient, name: str, key: str, byte_size: int, offset: int = 0,
              **headers: str) -> Any:
    return client.post(f"/v2/systemsharedmemory/region/{name}/register",
                       json={"key": key, "offset": offset, "byte_size": byte_size}, headers=headers or AUTH)


def _infer_body(inp: dict[str, Any], out: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"inputs": [{"name": "input", "shape": list(X_SHAPE), "datatype": "FP32",
                                        "parameters": inp}]}
    if out is not None:
        body["outputs"] = [{"name": "output", "parameters": out}]
    return body


def _error(r: httpx.Response, status: int, text: str) -> None:
    assert r.status_code == status, r.text
    assert text in r.json()["error"], r.json()


def test_registration_is_validated(repo, objects):
    root, _ = repo
    key, _ = objects.new(1024)
    link = Path("/dev/shm") / f"deconv-test-link-{uuid.uuid4().hex[:8]}"
    link.symlink_to(Path("/dev/shm") / key.lstrip("/"))

    async def main() -> None:
        async with serve_app(_settings(root, system_shm_max_regions=2, system_shm_max_bytes=1500)) as (_, c):
            _error(await _register(c, "r", "/no-such-object-here", 16), 400, "no shared-memory object")
            _error(await _register(c, "r", "/../etc/passwd", 16), 400, "does not name")
            _error(await _register(c, "r", "/" + link.name, 16), 400, "symbolic link")
            _error(await _register(c, "r", key, 1024, offset=1), 400, "does not fit")
            _error(await _register(c, "r", key, 0), 400, "positive")
            _error(await _register(c, "r", key, 16, offset=-1), 400, "non-negative")
            r = await c.post("/v2/systemsharedmemory/region/r/register", content=b"[1]", headers=AUTH)
            _error(r, 400, "register request")
            assert (await _register(c, "a", key, 1000)).status_code == 200
            _error(await _register(c, "a", key, 16), 400, "already registered")
            _error(await _register(c, "b", key, 1000), 400, "over the limit of 1500")
            assert (await _register(c, "b", key, 500, offset=500)).status_code == 200
            _error(await _register(c, "c", key, 1), 400, "the most this server holds")
            status = (await c.get("/v2/systemsharedmemory/status", headers=AUTH)).json()
            assert status == [{"name": "a", "key": key, "offset": 0, "byte_size": 1000},
                              {"name": "b", "key": key, "offset": 500, "byte_size": 500}]
            r = await c.get("/v2/systemsharedmemory/region/b/status", headers=AUTH)
            assert r.json() == [status[1]]
            _error(await c.get("/v2/systemsharedmemory/region/zz/status", headers=AUTH), 400, "no shared-memory")

    try:
        run(main())
    finally:
        link.unlink()


def test_every_route_needs_the_api_key(repo, objects):
    root, _ = repo
    key, _ = objects.new(64)

    async def main() -> None:
        async with serve_app(_settings(root)) as (app, c):
            wrong = {"Authorization": "Bearer nope"}
            assert (await _register(c, "r", key, 64, **wrong)).status_code == 401
            assert (await c.get("/v2/systemsharedmemory/status")).status_code == 401
            assert (await c.get("/v2/systemsharedmemory/region/r/status", headers=wrong)).status_code == 401
            assert (await c.post("/v2/systemsharedmemory/region/r/unregister")).status_code == 401
            assert (await c.post("/v2/systemsharedmemory/unregister", headers=wrong)).status_code == 401
            assert app.state.regions.status() == []

    run(main())


def test_tensors_stay_inside_their_regions(repo, objects):
    """Each tensor's offset + byte size is checked against its region; bytes around a region are never touched."""
    root, module = repo
    x = _x(2)
    ref = reference(module, torch.from_numpy(x))
    in_key, in_obj = objects.new(X_BYTES + 256)
    out_key, out_obj = objects.new(Y_BYTES + 256)
    in_obj.buf[:] = b"\x5a" * len(in_obj.buf)
    in_obj.buf[128:128 + X_BYTES] = x.tobytes()
    out_obj.buf[:] = b"\xa5" * len(out_obj.buf)

    async def main() -> None:
        async with serve_app(_settings(root)) as (_, c):
            assert (await _register(c, "in", in_key, X_BYTES, offset=128)).status_code == 200
            assert (await _register(c, "out", out_key, Y_BYTES, offset=128)).status_code == 200

            async def infer(inp: dict[str, Any], out: dict[str, Any] | None = None) -> httpx.Response:
                return await c.post("/v2/models/up/infer", json=_infer_body(inp, out), headers=AUTH)

            good_in = {"shared_memory_region": "in", "shared_memory_byte_size": X_BYTES}
            good_out = {"shared_memory_region": "out", "shared_memory_byte_size": Y_BYTES}
            _error(await infer({**good_in, "shared_memory_byte_size": X_BYTES - 4}), 400, f"needs {X_BYTES} bytes")
            _error(await infer({**good_in, "shared_memory_offset": 4}), 400, "reach past the end")
            _error(await infer({"shared_memory_region": "in"}), 400, "shared_memory_byte_size is required")
            _error(await infer({**good_in, "shared_memory_region": "nope"}), 400, "no shared-memory region")
            _error(await infer(good_in, {**good_out, "shared_memory_byte_size": Y_BYTES - 4}), 400,
                   f"needs {Y_BYTES} bytes")
            _error(await infer(good_in, {**good_out, "shared_memory_offset": 4}), 400, "reach past the end")
            r = await c.post("/v2/models/up/infer", json={"inputs": [{**_infer_body(good_in)["inputs"][0],
                                                                      "data": [1.0]}]}, headers=AUTH)
            _error(r, 400, "neither 'data'")
            assert bytes(out_obj.buf) == b"\xa5" * len(out_obj.buf)  # nothing written by a refused request

            r = await infer(good_in, good_out)
            assert r.status_code == 200, r.text
            out = r.json()["outputs"][0]
            assert "data" not in out
            assert out["parameters"] == {"shared_memory_region": "out", "shared_memory_byte_size": Y_BYTES}
            y = np.frombuffer(bytes(out_obj.buf[128:128 + Y_BYTES]), dtype=np.float32).reshape(Y_SHAPE)
            assert rel_err(y, ref) < 1e-5
            assert bytes(out_obj.buf[:128]) == b"\xa5" * 128
            assert bytes(out_obj.buf[128 + Y_BYTES:]) == b"\xa5" * 128
            # the input from shared memory, the output as usual
            r = await infer(good_in)
            assert r.status_code == 200, r.text
            assert rel_err(np.array(r.json()["outputs"][0]["data"]).reshape(Y_SHAPE), ref) < 1e-5

    run(main())


def test_a_truncated_object_is_a_400_not_a_crash(repo, objects):
    root, _ = repo
    key, _ = objects.new(X_BYTES)

    async def main() -> None:
        async with serve_app(_settings(root)) as (_, c):
            assert (await _register(c, "in", key, X_BYTES)).status_code == 200
            os.truncate(Path("/dev/shm") / key.lstrip("/"), X_BYTES // 2)
            body = _infer_body({"shared_memory_region": "in", "shared_memory_byte_size": X_BYTES})
            _error(await c.post("/v2/models/up/infer", json=body, headers=AUTH), 400, "shrank")

    run(main())


def test_unregister_on_request_and_at_shutdown(repo, objects):
    root, _ = repo
    keys = [objects.new(X_BYTES)[0] for _ in range(3)]

    def opened() -> list[str]:
        """The keys of the /dev/shm objects open in this process, once per descriptor."""
        links = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
        return sorted(k for k in keys for link in links if link == f"/dev/shm/{k.lstrip('/')}")

    before = opened()  # the test's own descriptors (multiprocessing keeps one per object)

    def held() -> list[str]:
        """The keys the server holds open."""
        now = opened()
        for k in before:
            now.remove(k)
        return now

    async def main() -> RegionTable:
        async with serve_app(_settings(root)) as (app, c):
            for i, key in enumerate(keys):
                assert (await _register(c, f"r{i}", key, X_BYTES)).status_code == 200
            assert held() == sorted(keys)
            assert (await c.post("/v2/systemsharedmemory/region/r0/unregister", headers=AUTH)).status_code == 200
            assert held() == sorted(keys[1:])
            assert (await c.post("/v2/systemsharedmemory/region/r0/unregister", headers=AUTH)).status_code == 200
            body = _infer_body({"shared_memory_region": "r0", "shared_memory_byte_size": X_BYTES})
            _error(await c.post("/v2/models/up/infer", json=body, headers=AUTH), 400, "no shared-memory region")
            assert [s["name"] for s in (await c.get("/v2/systemsharedmemory/status", headers=AUTH)).json()] == [
                "r1", "r2"]
            assert held() == sorted(keys[1:])
            return app.state.regions  # type: ignore[no-any-return]

    table = run(main())
    assert table.open_regions == 0
    assert held() == []


def test_the_extension_can_be_turned_off(repo, objects):
    root, _ = repo
    key, _ = objects.new(64)

    async def main() -> None:
        async with serve_app(_settings(root, system_shm_max_regions=0)) as (_, c):
            assert "system_shared_memory" not in (await c.get("/v2")).json()["extensions"]
            _error(await _register(c, "r", key, 64), 400, "off on this server")

    run(main())


# --- the store of a multi-process server: two processes' tables on one directory -----------------------------


def test_processes_share_registrations(tmp_path, objects):
    key, obj = objects.new(64)
    obj.buf[:64] = bytes(range(64))
    a = RegionTable(8, 2**20, tmp_path / "regions")
    b = RegionTable(8, 2**20, tmp_path / "regions")
    try:
        a.register("r", key, 0, 32)
        assert bytes(b.read("r", 8, 8)) == bytes(range(8, 16))
        with pytest.raises(RegionError, match="already registered"):
            b.register("r", key, 0, 16)
        b.write("r", 0, memoryview(b"\xff" * 4))
        assert bytes(obj.buf[:5]) == b"\xff\xff\xff\xff\x04"
        with pytest.raises(RegionError, match="reach past the end"):
            b.read("r", 30, 4)
        a.unregister("r")
        with pytest.raises(UnknownRegionError):
            b.read("r", 0, 4)
        assert b.open_regions == 0
        # the name registered again, at another offset: the other process follows the new registration
        a.register("r", key, 32, 32)
        assert bytes(b.read("r", 0, 4)) == bytes(range(32, 36))
        # the object replaced under the same key: refused, never read
        b_regions = RegionTable(8, 2**20, tmp_path / "regions")
        path = Path("/dev/shm") / key.lstrip("/")
        path.unlink()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, 64)
        os.close(fd)
        with pytest.raises(RegionError, match="was replaced"):
            b_regions.read("r", 0, 4)
        a.unregister_all()
        assert b.status() == []
        assert b.open_regions == 0
    finally:
        a.close()
        b.close()


def test_a_record_is_read_again_only_after_a_change_in_any_process(tmp_path, objects, monkeypatch):
    key, _ = objects.new(64)
    a = RegionTable(8, 2**20, tmp_path / "regions")
    b = RegionTable(8, 2**20, tmp_path / "regions")
    reads: list[str] = []
    get = b.store.get
    monkeypatch.setattr(b.store, "get", lambda name: reads.append(name) or get(name))
    try:
        a.register("r", key, 0, 32)
        a.register("s", key, 32, 32)
        for _ in range(3):
            b.read("r", 0, 4)
        assert reads == ["r"]  # once, then nothing changed
        a.unregister("s")  # any change counts, in any process
        b.read("r", 0, 4)
        assert reads == ["r", "r"]
        a.unregister("r")
        with pytest.raises(UnknownRegionError, match="no shared-memory region named 'r'"):
            b.read("r", 0, 4)
        assert b.open_regions == 0
    finally:
        a.close()
        b.close()


# --- a request holds what it checked; a replaced object is refused ---------------------------------------------


@pytest.mark.parametrize("shared", [False, True], ids=["single", "multi"])
def test_a_writer_never_writes_into_an_object_registered_after_its_check(tmp_path, objects, shared):
    # Before: the output was written by name when the result came back, into whatever object the name stood for.
    x_key, x_obj = objects.new(64)
    y_key, y_obj = objects.new(64)
    directory = tmp_path / "regions" if shared else None
    a = RegionTable(8, 2**20, directory)
    b = RegionTable(8, 2**20, directory) if shared else a  # the re-registration comes through another process
    try:
        a.register("r", x_key, 0, 64)
        writer = a.writer("r", 8, 16)  # checked now, written later
        b.unregister("r")
        b.register("r", y_key, 0, 64)
        with pytest.raises(UnknownRegionError, match="was unregistered while the request ran"):
            writer.write(memoryview(b"\xee" * 16))
        assert bytes(y_obj.buf[:64]) == bytes(64)
        assert bytes(x_obj.buf[:64]) == bytes(64)
        with pytest.raises(RegionError, match="written already"):
            writer.write(memoryview(b"\xee" * 16))
        # the same registration all along: written into its object
        writer = b.writer("r", 8, 16)
        writer.write(memoryview(b"\xee" * 16))
        assert bytes(y_obj.buf[8:24]) == b"\xee" * 16
    finally:
        a.close()
        b.close()


def test_a_writer_holds_its_own_descriptor(tmp_path, objects):
    # The region's descriptor is closed when the name is unregistered and its number may be reused; the writer's
    # own stays on the object it checked until it is written or dropped.
    key, _ = objects.new(64)
    table = RegionTable(8, 2**20)
    try:
        table.register("r", key, 0, 64)
        before = len(os.listdir("/proc/self/fd"))
        writer = table.writer("r", 0, 8)
        assert len(os.listdir("/proc/self/fd")) == before + 1
        writer.close()
        assert len(os.listdir("/proc/self/fd")) == before
        writer = table.writer("r", 0, 8)
        del writer
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        table.close()


@pytest.mark.parametrize("shared", [False, True], ids=["single", "multi"])
def test_an_object_replaced_under_its_key_is_refused_on_every_use(tmp_path, objects, shared):
    # Before: a process that had opened the object kept serving the deleted one (every request of a single
    # process; with several, those that had opened it).
    key, obj = objects.new(64)
    obj.buf[:64] = bytes(range(64))
    table = RegionTable(8, 2**20, tmp_path / "regions" if shared else None)
    try:
        table.register("r", key, 0, 64)
        assert bytes(table.read("r", 0, 4)) == bytes(range(4))
        path = Path("/dev/shm") / key.lstrip("/")
        path.unlink()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, 64)
        os.close(fd)
        for use in (lambda: table.read("r", 0, 4), lambda: table.check("r", 0, 4),
                    lambda: table.write("r", 0, memoryview(b"\x01"))):
            with pytest.raises(RegionError, match="was replaced or removed"):
                use()
        path.unlink()
        with pytest.raises(RegionError, match="was replaced or removed"):
            table.read("r", 0, 4)
    finally:
        table.close()
