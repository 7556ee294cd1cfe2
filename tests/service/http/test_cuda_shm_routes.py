"""KServe v2 CUDA shared memory (``/v2/cudasharedmemory``) without a GPU: the routes' validation, API key and
answers on a CPU server (register is 400 there); then, with host memory standing in for the clients' GPU
allocations (``HostMemory``, an ``IpcBackend``), registration, status, limits, the one namespace of both kinds,
unmapping, and inference reading and writing the regions in place through the engine's device path on the CPU
worker; the engine's region leases; and the frames of a multi-process server. The GPU runs the real thing:
tests/service/test_cuda_shm.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import struct
import uuid
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from deconv_client import cuda_ipc

from service.codec import CudaJob, DeviceTensor, RawTensor
from service.engine.cuda_shm import CudaRegions
from service.engine.interface import Result
from service.engine.registry import Layer
from service.engine.remote import EngineClient, RemoteCudaMemory, RemoteQueue
from service.errors import RegionError, UnknownRegionError
from service.ipc import frames
from service.metrics import Metrics
from tests.numerics import rel_err

from ..conftest import reference, run, serve_app
from ..cpu_regions import cpu_regions  # noqa: F401  (a fixture)
from . import test_system_shm
from .test_system_shm import AUTH, X_BYTES, X_SHAPE, Y_BYTES, Y_SHAPE, _settings

pytestmark = pytest.mark.usefixtures("cpu_regions")  # the CPU workers compute requests in shared memory

repo = test_system_shm.repo  # the system regions' tests' layer repository (a fixture) and settings serve here too

HANDLE = bytes(range(64))


class HostMemory:
    """Host buffers standing in for GPU allocations and CUDA IPC (``service.engine.cuda_shm.IpcBackend``): an
    allocation's handle is 64 bytes naming it; the engine's CPU worker reads and writes a mapped buffer through
    the same torch views it would take of GPU memory."""

    def __init__(self) -> None:
        self.buffers: dict[bytes, bytearray] = {}
        self.mapped: dict[int, bytes] = {}  # address -> handle
        self.opens = 0
        self.closes = 0

    def allocate(self, nbytes: int, fill: int = 0) -> tuple[bytes, bytearray]:
        handle = uuid.uuid4().bytes * 4
        buf = self.buffers[handle] = bytearray([fill]) * nbytes
        return handle, buf

    def open(self, device: int, handle: bytes) -> int:
        buf = self.buffers.get(handle)
        if buf is None:
            raise cuda_ipc.CudaError("cudaIpcOpenMemHandle: invalid resource handle (CUDA error 400)")
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        self.mapped[ptr] = handle
        self.opens += 1
        return ptr

    def allocation_bytes(self, device: int, ptr: int) -> int | None:
        return len(self.buffers[self.mapped[ptr]])

    def close(self, device: int, ptr: int) -> None:
        del self.mapped[ptr]
        self.closes += 1

    def view(self, device: int, ptr: int, nbytes: int) -> torch.Tensor:
        for base, handle in self.mapped.items():
            buf = self.buffers[handle]
            if base <= ptr and ptr + nbytes <= base + len(buf):
                return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=ptr - base)
        raise AssertionError(f"{nbytes} bytes at {ptr:#x} are not mapped")


def _body(handle: bytes = HANDLE, device_id: Any = 0, byte_size: Any = 1024) -> dict[str, Any]:
    return {"raw_handle": {"b64": base64.b64encode(handle).decode()}, "device_id": device_id, "byte_size": byte_size}


def _register(client: httpx.AsyncClient, name: str, body: Any, **headers: str) -> Any:
    return client.post(f"/v2/cudasharedmemory/region/{name}/register", json=body, headers=headers or AUTH)


def _error(r: httpx.Response, status: int, text: str, kind: str = "invalid_shared_memory") -> None:
    assert r.status_code == status, r.text
    assert text in r.json()["error"], r.json()
    assert r.json()["type"] == kind, r.json()


def _x(seed: int = 0, shape: tuple[int, ...] = X_SHAPE) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# --- a server without a GPU -----------------------------------------------------------------------------------


def test_without_a_gpu_registering_is_a_400_and_the_extension_is_not_listed(repo):
    root, _ = repo

    async def main() -> None:
        async with serve_app(_settings(root)) as (app, c):
            assert not app.state.engine.cuda_memory.available
            assert "cuda_shared_memory" not in (await c.get("/v2")).json()["extensions"]
            _error(await _register(c, "r", _body()), 400, "CUDA shared memory needs a GPU")
            assert (await c.get("/v2/cudasharedmemory/status", headers=AUTH)).json() == []
            _error(await c.get("/v2/cudasharedmemory/region/r/status", headers=AUTH), 400,
                   "no shared-memory region named 'r'", "unknown_shared_memory_region")
            assert (await c.post("/v2/cudasharedmemory/region/r/unregister", headers=AUTH)).status_code == 200
            assert (await c.post("/v2/cudasharedmemory/unregister", headers=AUTH)).status_code == 200

    run(main())


def test_registration_is_validated(repo):
    root, _ = repo
    short = base64.b64encode(bytes(63)).decode()

    async def main() -> None:
        async with serve_app(_settings(root)) as (_, c):
            _error(await _register(c, "r", {**_body(), "raw_handle": {"b64": "not base64!"}}), 400,
                   "not valid base64")
            _error(await _register(c, "r", {**_body(), "raw_handle": {"b64": short}}), 400,
                   "raw_handle holds 63 bytes; a CUDA IPC handle (cudaIpcMemHandle_t) has 64")
            _error(await _register(c, "r", {**_body(), "raw_handle": base64.b64encode(HANDLE).decode()}), 400,
                   'raw_handle must be {"b64"')
            _error(await _register(c, "r", {**_body(), "raw_handle": {}}), 400, 'raw_handle must be {"b64"')
            for device_id in (-1, "0", True, 1.5, None):
                _error(await _register(c, "r", _body(device_id=device_id)), 400,
                       f"device_id must be a non-negative integer, got {device_id!r}")
            for byte_size in (0,):
                _error(await _register(c, "r", _body(byte_size=byte_size)), 400, "byte_size must be positive")
            for byte_size in (-5, "big", False):
                _error(await _register(c, "r", _body(byte_size=byte_size)), 400,
                       "byte_size must be a non-negative integer")
            _error(await _register(c, "x" * 257, _body()), 400, "a region name has 1 to 256 characters")
            for body in ([1], {"raw_handle": {"b64": ""}, "byte_size": 1}):
                _error(await _register(c, "r", body), 400, '{"raw_handle": {"b64": ...}, "device_id": ...',
                       "malformed_body")
            r = await c.post("/v2/cudasharedmemory/region/r/register", content=b"{nope", headers=AUTH)
            _error(r, 400, "not valid JSON", "malformed_body")
            r = await c.post("/v2/cudasharedmemory/region/r/register", content=b" " * (64 * 2**10 + 1), headers=AUTH)
            _error(r, 413, "at most 65536 bytes", "payload_too_large")

    run(main())


def test_every_route_needs_the_api_key(repo):
    root, _ = repo

    async def main() -> None:
        async with serve_app(_settings(root)) as (app, c):
            wrong = {"Authorization": "Bearer nope"}
            assert (await _register(c, "r", _body(), **wrong)).status_code == 401
            assert (await c.post("/v2/cudasharedmemory/region/r/register", json=_body())).status_code == 401
            assert (await c.get("/v2/cudasharedmemory/status")).status_code == 401
            assert (await c.get("/v2/cudasharedmemory/region/r/status", headers=wrong)).status_code == 401
            assert (await c.post("/v2/cudasharedmemory/region/r/unregister")).status_code == 401
            assert (await c.post("/v2/cudasharedmemory/unregister", headers=wrong)).status_code == 401
            assert app.state.regions.status(kind="cuda") == []

    run(main())


def test_the_extension_can_be_turned_off(repo):
    root, _ = repo

    async def main() -> None:
        async with serve_app(_settings(root, cuda_shm_max_regions=0)) as (app, c):
            app.state.engine.cuda_memory.configure([torch.device("cpu")], HostMemory())
            assert not app.state.engine.cuda_memory.available
            assert "cuda_shared_memory" not in (await c.get("/v2")).json()["extensions"]
            _error(await _register(c, "r", _body()), 400, "off on this server (DECONV_CUDA_SHM_MAX_REGIONS=0)")

    run(main())


# --- with host memory standing in for GPU allocations ---------------------------------------------------------


@contextlib.asynccontextmanager
async def _served(root: Path, memory: HostMemory, **overrides: Any) -> Any:
    async with serve_app(_settings(root, **overrides)) as (app, c):
        app.state.engine.cuda_memory.configure([torch.device("cpu")], memory)
        yield app, c


@pytest.fixture
def objects() -> Iterator[list[shared_memory.SharedMemory]]:
    made: list[shared_memory.SharedMemory] = []
    yield made
    for shm in made:
        shm.close()
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()


def _system_object(made: list[shared_memory.SharedMemory], size: int) -> tuple[str, shared_memory.SharedMemory]:
    shm = shared_memory.SharedMemory(f"deconv-test-{uuid.uuid4().hex[:12]}", create=True, size=size)
    made.append(shm)
    return "/" + shm.name.lstrip("/"), shm


def test_register_status_unregister_limits_and_one_namespace(repo, objects):
    root, _ = repo
    memory = HostMemory()
    handles = [memory.allocate(4096)[0] for _ in range(3)]
    key, _ = _system_object(objects, 64)

    async def main() -> CudaRegions:
        async with _served(root, memory, cuda_shm_max_regions=3) as (app, c):
            cuda: CudaRegions = app.state.engine.cuda_memory
            assert "cuda_shared_memory" in (await c.get("/v2")).json()["extensions"]
            _error(await _register(c, "r", _body(bytes(64))), 400, "the CUDA IPC handle does not open on GPU 0")
            _error(await _register(c, "r", _body(handles[0], byte_size=4097)), 400,
                   "byte_size 4097 is larger than the GPU allocation behind the handle (4096 bytes)")
            assert (cuda.mappings, memory.opens, memory.closes) == (0, 1, 1)  # mapped, refused, unmapped
            assert (await _register(c, "a", _body(handles[0], byte_size=4096))).status_code == 200
            assert (await _register(c, "b", _body(handles[1], byte_size=100))).status_code == 200
            _error(await _register(c, "a", _body(handles[2])), 400, "named 'a' is already registered")
            # one namespace for both kinds
            r = await c.post("/v2/systemsharedmemory/region/s/register", json={"key": key, "byte_size": 64},
                             headers=AUTH)
            assert r.status_code == 200
            _error(await _register(c, "s", _body(handles[2])), 400, "named 's' is already registered as a system "
                   "region")
            r = await c.post("/v2/systemsharedmemory/region/a/register", json={"key": key, "byte_size": 64},
                             headers=AUTH)
            _error(r, 400, "named 'a' is already registered as a CUDA region")
            # two registrations of one allocation share its mapping
            assert (await _register(c, "a2", _body(handles[0], byte_size=10))).status_code == 200
            assert (cuda.regions, cuda.mappings, memory.opens) == (3, 2, 3)
            _error(await _register(c, "c", _body(handles[2])), 400, "3 CUDA regions are registered, the most this "
                   "server holds (DECONV_CUDA_SHM_MAX_REGIONS=3)")
            status = (await c.get("/v2/cudasharedmemory/status", headers=AUTH)).json()
            assert status == [{"name": "a", "device_id": 0, "byte_size": 4096},
                              {"name": "b", "device_id": 0, "byte_size": 100},
                              {"name": "a2", "device_id": 0, "byte_size": 10}]
            assert [s["name"] for s in (await c.get("/v2/systemsharedmemory/status", headers=AUTH)).json()] == ["s"]
            r = await c.get("/v2/cudasharedmemory/region/b/status", headers=AUTH)
            assert r.json() == [status[1]]
            _error(await c.get("/v2/cudasharedmemory/region/s/status", headers=AUTH), 400,
                   "'s' is a system region, not a CUDA one", "unknown_shared_memory_region")
            # a system unregister leaves a CUDA region alone, and the other way round
            assert (await c.post("/v2/systemsharedmemory/region/a/unregister", headers=AUTH)).status_code == 200
            assert (await c.post("/v2/cudasharedmemory/region/s/unregister", headers=AUTH)).status_code == 200
            assert cuda.regions == 3
            assert (await c.post("/v2/cudasharedmemory/region/a/unregister", headers=AUTH)).status_code == 200
            assert (cuda.regions, cuda.mappings, memory.closes) == (2, 2, 1)  # a2 still maps the allocation
            assert (await c.post("/v2/cudasharedmemory/region/a2/unregister", headers=AUTH)).status_code == 200
            assert (cuda.mappings, memory.closes) == (1, 2)
            assert (await _register(c, "c", _body(handles[2]))).status_code == 200
            assert (await c.post("/v2/cudasharedmemory/unregister", headers=AUTH)).status_code == 200
            assert (await c.get("/v2/cudasharedmemory/status", headers=AUTH)).json() == []
            assert (cuda.regions, cuda.mappings, memory.closes) == (0, 0, 4)
            assert [s["name"] for s in (await c.get("/v2/systemsharedmemory/status", headers=AUTH)).json()] == ["s"]
            assert (await _register(c, "d", _body(handles[2]))).status_code == 200
            return cuda

    cuda = run(main())
    assert cuda.mappings == 0  # unmapped at shutdown
    assert memory.mapped == {}


def _infer_body(inp: dict[str, Any], out: dict[str, Any] | None = None, shape: tuple[int, ...] = X_SHAPE,
                **request: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"inputs": [{"name": "input", "shape": list(shape), "datatype": "FP32",
                                        "parameters": inp}], **request}
    if out is not None:
        body["outputs"] = [{"name": "output", "parameters": out}]
    return body


def test_inference_reads_and_writes_cuda_regions_in_place(repo, objects):
    root, module = repo
    memory = HostMemory()
    x = _x(1)
    ref = reference(module, torch.from_numpy(x))
    in_handle, in_buf = memory.allocate(X_BYTES + 512, fill=0x5A)
    in_buf[256:256 + X_BYTES] = x.tobytes()
    out_handle, out_buf = memory.allocate(Y_BYTES + 512, fill=0xA5)
    sys_key, sys_obj = _system_object(objects, X_BYTES)
    sys_obj.buf[:X_BYTES] = x.tobytes()

    def output(offset: int = 64, size: int = Y_BYTES) -> np.ndarray:
        return np.frombuffer(bytes(out_buf[offset:offset + size]), dtype=np.float32)

    async def main() -> None:
        async with _served(root, memory) as (_, c):
            assert (await _register(c, "in", _body(in_handle, byte_size=X_BYTES + 512))).status_code == 200
            assert (await _register(c, "out", _body(out_handle, byte_size=Y_BYTES + 512))).status_code == 200
            r = await c.post("/v2/systemsharedmemory/region/sys/register", json={"key": sys_key,
                                                                                  "byte_size": X_BYTES}, headers=AUTH)
            assert r.status_code == 200

            async def infer(body: dict[str, Any]) -> httpx.Response:
                return await c.post("/v2/models/up/infer", json=body, headers=AUTH)

            good_in = {"shared_memory_region": "in", "shared_memory_byte_size": X_BYTES, "shared_memory_offset": 256}
            good_out = {"shared_memory_region": "out", "shared_memory_byte_size": Y_BYTES,
                        "shared_memory_offset": 64}
            # refused before anything is read or written
            _error(await infer(_infer_body({**good_in, "shared_memory_byte_size": X_BYTES - 4})), 400,
                   f"needs {X_BYTES} bytes")
            _error(await infer(_infer_body({**good_in, "shared_memory_offset": 513})), 400, "reach past the end")
            _error(await infer(_infer_body(good_in, {**good_out, "shared_memory_byte_size": Y_BYTES - 4})), 400,
                   f"the output needs {Y_BYTES} bytes")
            _error(await infer(_infer_body(good_in, {**good_out, "shared_memory_offset": 513})), 400,
                   "reach past the end of shared-memory region 'out'")
            _error(await infer(_infer_body({**good_in, "shared_memory_region": "nope"})), 400,
                   "no shared-memory region named 'nope'", "unknown_shared_memory_region")
            assert bytes(out_buf) == b"\xa5" * len(out_buf)

            # input and output in CUDA regions: written in place, nothing around them touched
            r = await infer(_infer_body(good_in, good_out))
            assert r.status_code == 200, r.text
            out = r.json()["outputs"][0]
            assert "data" not in out
            assert out["shape"] == list(Y_SHAPE)
            assert out["parameters"] == {"shared_memory_region": "out", "shared_memory_byte_size": Y_BYTES,
                                         "shared_memory_offset": 64}
            assert rel_err(output().reshape(Y_SHAPE), ref) < 1e-5
            assert bytes(out_buf[:64]) == b"\xa5" * 64
            assert bytes(out_buf[64 + Y_BYTES:]) == b"\xa5" * (len(out_buf) - 64 - Y_BYTES)
            assert bytes(in_buf[:256]) == b"\x5a" * 256

            # an output region at an unaligned offset: computed, then copied in
            out_buf[:] = b"\xa5" * len(out_buf)
            r = await infer(_infer_body(good_in, {**good_out, "shared_memory_offset": 4}))
            assert r.status_code == 200, r.text
            assert rel_err(output(4).reshape(Y_SHAPE), ref) < 1e-5
            assert bytes(out_buf[:4]) == b"\xa5" * 4
            assert bytes(out_buf[4 + Y_BYTES:]) == b"\xa5" * (len(out_buf) - 4 - Y_BYTES)

            # input in a CUDA region, output as binary data; input as JSON, output in a CUDA region; input in a
            # system region, output in a CUDA region; one unbatched sample
            r = await infer(_infer_body(good_in, {"binary_data": False}))
            assert r.status_code == 200, r.text
            assert rel_err(np.array(r.json()["outputs"][0]["data"]).reshape(Y_SHAPE), ref) < 1e-5
            for inp in ({"data_json": True}, {"shared_memory_region": "sys", "shared_memory_byte_size": X_BYTES}):
                out_buf[:] = b"\xa5" * len(out_buf)
                body = _infer_body({} if "data_json" in inp else inp, good_out)
                if "data_json" in inp:
                    body["inputs"][0]["data"] = x.ravel().tolist()
                r = await infer(body)
                assert r.status_code == 200, r.text
                assert rel_err(output().reshape(Y_SHAPE), ref) < 1e-5
            one = {**good_in, "shared_memory_byte_size": X_BYTES // 3}
            r = await infer(_infer_body(one, {**good_out, "shared_memory_byte_size": Y_BYTES // 3},
                                        shape=X_SHAPE[1:]))
            assert r.status_code == 200, r.text
            assert r.json()["outputs"][0]["shape"] == list(Y_SHAPE[1:])
            assert rel_err(output(64, Y_BYTES // 3).reshape(Y_SHAPE[1:]), ref[0]) < 1e-5

            # unregistered: refused
            assert (await c.post("/v2/cudasharedmemory/region/in/unregister", headers=AUTH)).status_code == 200
            _error(await infer(_infer_body(good_in, good_out)), 400, "no shared-memory region named 'in'",
                   "unknown_shared_memory_region")
            text = (await c.get("/metrics")).text
            assert 'deconv_requests_total{api="kserve",layer="up",status="200"} 6.0' in text

    run(main())


def test_requests_in_cuda_regions_batch_together_and_each_gets_its_rows(repo):
    root, module = repo
    memory = HostMemory()
    xs = [_x(seed, (n, 4, 6, 6)) for seed, n in enumerate((1, 2, 3, 1))]
    buffers = []
    for x in xs:
        in_handle, in_buf = memory.allocate(x.nbytes)
        in_buf[:] = x.tobytes()
        out_handle, out_buf = memory.allocate(x.shape[0] * Y_BYTES // 3)
        buffers.append((in_handle, out_handle, out_buf))

    async def main() -> None:
        # A batch runs when it holds max_batch_size samples (the delay never runs out): all 7, in one call.
        async with _served(root, memory, max_queue_delay_ms=600_000.0, max_batch_size=7) as (_, c):
            for i, (in_handle, out_handle, out_buf) in enumerate(buffers):
                assert (await _register(c, f"in{i}", _body(in_handle, byte_size=xs[i].nbytes))).status_code == 200
                assert (await _register(c, f"out{i}", _body(out_handle, byte_size=len(out_buf)))).status_code == 200
            rs = await asyncio.gather(*(
                c.post("/v2/models/up/infer", headers=AUTH, json=_infer_body(
                    {"shared_memory_region": f"in{i}", "shared_memory_byte_size": x.nbytes},
                    {"shared_memory_region": f"out{i}", "shared_memory_byte_size": len(buffers[i][2])},
                    shape=x.shape)) for i, x in enumerate(xs)))
            for r in rs:
                assert r.status_code == 200, r.text
            assert {int(r.headers["x-deconv-batch-size"]) for r in rs} == {7}
            for x, (_, _, out_buf), r in zip(xs, buffers, rs, strict=True):
                y = np.frombuffer(bytes(out_buf), np.float32).reshape(r.json()["outputs"][0]["shape"])
                assert rel_err(y, reference(module, torch.from_numpy(x))) < 1e-5

    run(main())


# --- the engine's regions -------------------------------------------------------------------------------------


def test_a_region_unregistered_while_a_batch_uses_it_is_unmapped_after_the_batch():
    memory = HostMemory()
    handle, buf = memory.allocate(256)
    buf[:] = bytes(range(256))
    regions = CudaRegions(4)
    regions.configure([torch.device("cpu")], memory)
    token = uuid.uuid4().hex

    async def main() -> None:
        await regions.open(token, handle, 0, 200)
        with pytest.raises(RegionError, match="open already"):
            await regions.open(token, handle, 0, 200)
        view = regions.lease(token, 10, 4, 0)
        assert bytes(view.numpy()) == bytes(range(10, 14))
        address, nbytes = regions.place(token, 20, 6, 0)  # the GPU path's lease: where the bytes are
        assert (ctypes.string_at(address, nbytes), nbytes) == (bytes(range(20, 26)), 6)
        for lease in (regions.lease, regions.place):
            with pytest.raises(RegionError, match="reach past the end of a CUDA shared-memory region of 200 bytes"):
                lease(token, 190, 11, 0)
            with pytest.raises(RegionError, match="lies on GPU 0, not 1"):
                lease(token, 0, 4, 1)
        await regions.close([token])
        assert memory.closes == 0  # two batches still read it
        for lease in (regions.lease, regions.place):
            with pytest.raises(UnknownRegionError, match="unregistered before the request ran"):
                lease(token, 0, 4, 0)
        regions.release(token)
        assert memory.closes == 0  # one still does
        regions.release(token)
        assert (memory.closes, regions.regions, regions.mappings) == (1, 0, 0)
        await regions.close([token, "unknown"])  # nothing left: nothing happens
        assert memory.closes == 1

    run(main())


def test_the_worker_answers_a_request_whose_region_went_with_its_error_alone(repo):
    root, module = repo
    memory = HostMemory()
    x = _x(3, (1, 4, 6, 6))
    good, bad = [], []
    regions = CudaRegions(8)
    regions.configure([torch.device("cpu")], memory)

    async def main() -> None:
        from service.engine.kinds import Kind
        from service.engine.registry import BatchLimits, load_repository
        from service.engine.worker import Worker

        layer = load_repository(root, BatchLimits(8, 1 << 20, 0.0, 8)).get("up")
        worker = Worker(torch.device("cpu"), cuda=regions)
        worker.load(layer)
        try:
            for names in (good, bad):
                for nbytes in (x.nbytes, Y_BYTES // 3):
                    handle, buf = memory.allocate(nbytes)
                    token = uuid.uuid4().hex
                    await regions.open(token, handle, 0, nbytes)
                    names.append((token, buf))
            good[0][1][:] = bad[0][1][:] = x.tobytes()
            jobs = [CudaJob(DeviceTensor(ins[0], 0, 0, torch.float32, x.shape),
                            DeviceTensor(outs[0], 0, 0, torch.float32, (1, 6, 12, 12))) for ins, outs in (good, bad)]
            await regions.close([bad[1][0]])  # its output region went while it waited
            answers = await asyncio.wrap_future(worker.submit(layer, jobs, Kind.REGIONS))
            assert answers[0] is jobs[0].out
            assert isinstance(answers[1], UnknownRegionError)
            y = np.frombuffer(bytes(good[1][1]), np.float32).reshape(1, 6, 12, 12)
            assert rel_err(y, reference(module, torch.from_numpy(x))) < 1e-5
            assert bytes(bad[1][1]) == bytes(Y_BYTES // 3)
        finally:
            worker.shutdown()

    run(main())


# --- the frames of a multi-process server ---------------------------------------------------------------------


def _parts(frame: list[bytes | memoryview]) -> tuple[int, bytearray]:
    data = b"".join(bytes(p) for p in frame)
    size, kind = struct.unpack_from("<IB", data)
    assert size == len(data) - 4
    return kind, bytearray(data[5:])


def test_cuda_frames_round_trip():
    t_in, t_out = uuid.uuid4().hex, uuid.uuid4().hex
    x_dev = DeviceTensor(t_in, 1, 512, torch.float16, (2, 4, 6, 6))
    out = DeviceTensor(t_out, 1, 64, torch.float16, (2, 6, 12, 12))
    kind, body = _parts(frames.submit_frame(9, 3, CudaJob(x_dev, out), 1.5, 2.5))
    assert kind == frames.SUBMIT
    req = frames.parse_submit(body)
    job = req.x
    assert isinstance(job, CudaJob)
    assert (req.request_id, req.layer, req.received, req.deadline, req.out_offset) == (9, 3, 1.5, 2.5, None)
    assert (job.device, job.x.token, job.x.offset, job.x.dtype, job.x.shape) == (1, t_in, 512, torch.float16,
                                                                                 (2, 4, 6, 6))
    assert (job.out.token, job.out.offset, job.out.shape) == (t_out, 64, (2, 6, 12, 12))
    # an input from the host travels in the frame
    x = torch.randn(2, 4, 6, 6)
    kind, body = _parts(frames.submit_frame(10, 0, CudaJob(RawTensor(memoryview(x.numpy()).cast("B"), x.dtype,
                                                                     tuple(x.shape)), out), 0.0, None))
    job = frames.parse_submit(body).x
    assert isinstance(job.x, RawTensor)
    assert torch.equal(job.x.tensor(), x)
    assert job.out.token == t_out
    with pytest.raises(frames.ProtocolError, match="carries no input bytes"):
        frames.parse_submit(_parts(frames.submit_frame(9, 3, CudaJob(x_dev, out), 1.5, None))[1] + b"\0")
    with pytest.raises(frames.ProtocolError, match="token has 32 characters"):
        frames.submit_frame(9, 3, CudaJob(DeviceTensor("short", 0, 0, torch.float32, (1, 4, 6, 6)), None), 0, None)
    # the output in its region: a RESULT without bytes
    kind, body = _parts(frames.result_frame(9, out, 4, 2, 0.25, "cuda:1"))
    result = frames.parse_result(body, torch.float16)
    assert isinstance(result.y, DeviceTensor)
    assert (result.y.shape, result.y.dtype, result.worker, result.batch_samples) == ((2, 6, 12, 12), torch.float16,
                                                                                     "cuda:1", 4)
    # the calls
    kind, body = _parts(frames.cuda_open_frame(11, t_in, HANDLE, 2, 4096))
    assert (kind, frames.parse_cuda_open(body)) == (frames.CUDA_OPEN, (11, t_in, HANDLE, 2, 4096))
    kind, body = _parts(frames.cuda_close_frame(12, [t_in, t_out]))
    assert (kind, frames.parse_cuda_close(body)) == (frames.CUDA_CLOSE, (12, [t_in, t_out]))
    kind, body = _parts(frames.reply_frame(13))
    assert (kind, frames.result_id(body)) == (frames.REPLY, 13)
    with pytest.raises(frames.ProtocolError, match="64 bytes"):
        frames.cuda_open_frame(11, t_in, HANDLE[:8], 0, 1)
    with pytest.raises(frames.ProtocolError, match="bad CUDA_CLOSE"):
        frames.parse_cuda_close(bytearray(8) + b"abc")


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[int, bytearray]] = []

    def writelines(self, data: Any) -> None:
        buf = b"".join(bytes(p) for p in data)
        while buf:
            size, kind = struct.unpack_from("<IB", buf)
            self.sent.append((kind, bytearray(buf[5:4 + size])))
            buf = buf[4 + size:]

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def _deliver(client: Any, frame: list[bytes | memoryview]) -> None:
    kind, body = _parts(frame)
    client.frame_received(kind, body)


def test_an_http_process_calls_the_engine_and_sends_cuda_requests_by_reference(repo):
    root, _ = repo

    async def main() -> None:
        from service.engine.registry import BatchLimits, load_repository

        layer: Layer = load_repository(root, BatchLimits(8, 1 << 20, 0.0, 8)).get("up")
        metrics = Metrics()
        engine = SimpleNamespace(metrics=metrics, engine_lost=lambda exc: None)
        client = EngineClient(engine, None)  # type: ignore[arg-type]
        transport = _Transport()
        client.connection_made(transport)
        memory = RemoteCudaMemory(SimpleNamespace(client=client))  # type: ignore[arg-type]
        token = uuid.uuid4().hex

        opening = asyncio.ensure_future(memory.open(token, HANDLE, 0, 4096))
        await asyncio.sleep(0)
        client._flush()
        (kind, body), = transport.sent
        call_id, *fields = frames.parse_cuda_open(body)
        assert (kind, fields) == (frames.CUDA_OPEN, [token, HANDLE, 0, 4096])
        _deliver(client, frames.reply_frame(call_id))
        await opening
        transport.sent.clear()

        closing = asyncio.ensure_future(memory.close([token]))
        await asyncio.sleep(0)
        client._flush()
        call_id, tokens = frames.parse_cuda_close(transport.sent[0][1])
        assert tokens == [token]
        _deliver(client, frames.error_frame(call_id, RegionError("no such mapping")))
        with pytest.raises(RegionError, match="no such mapping"):
            await closing
        transport.sent.clear()

        queue = RemoteQueue(layer, 0, client)
        out = DeviceTensor(token, 0, 0, torch.float32, (1, 6, 12, 12))
        item = queue.submit(CudaJob(DeviceTensor(token, 0, 128, torch.float32, (1, 4, 6, 6)), out))
        client._flush()
        (kind, body), = transport.sent
        req = frames.parse_submit(body)
        assert (kind, req.x.x.offset, req.x.out.shape) == (frames.SUBMIT, 128, (1, 6, 12, 12))
        _deliver(client, frames.result_frame(req.request_id, out, 1, 1, 0.0, "cuda:0"))
        result: Result = item.future.result()
        assert isinstance(result.output, DeviceTensor)
        assert result.output.shape == (1, 6, 12, 12)
        assert 'deconv_ipc_requests_total{path="cuda"} 1.0' in metrics.render().decode()

        pending = asyncio.ensure_future(memory.open(token, HANDLE, 0, 4096))
        await asyncio.sleep(0)
        client.connection_lost(None)  # the engine went away
        with pytest.raises(Exception, match="engine process stopped"):
            await pending

    run(main())


def test_the_engine_process_answers_cuda_calls():
    async def main() -> None:
        from service.engine.process import EngineConnection

        memory = HostMemory()
        handle, _ = memory.allocate(1024)
        regions = CudaRegions(4)
        regions.configure([torch.device("cpu")], memory)
        server = SimpleNamespace(engine=SimpleNamespace(cuda_memory=regions), calls=set())
        conn = EngineConnection(server, None)  # type: ignore[arg-type]
        transport = _Transport()
        conn.transport = transport
        token = uuid.uuid4().hex
        for frame in (frames.cuda_open_frame(1, token, handle, 0, 1024),
                      frames.cuda_open_frame(2, uuid.uuid4().hex, HANDLE, 0, 1024)):
            _deliver(conn, frame)
        while server.calls:  # each answered by its done callback
            await asyncio.gather(*server.calls, return_exceptions=True)
            await asyncio.sleep(0)
        conn._flush()
        assert regions.regions == 1
        answers = dict((frames.result_id(body), (kind, body)) for kind, body in transport.sent)
        assert answers[1][0] == frames.REPLY
        kind, body = answers[2]
        assert kind == frames.ERROR
        assert isinstance(frames.parse_error(body)[1], RegionError)
        transport.sent.clear()
        _deliver(conn, frames.cuda_close_frame(3, [token]))
        while server.calls:  # each answered by its done callback
            await asyncio.gather(*server.calls, return_exceptions=True)
            await asyncio.sleep(0)
        conn._flush()
        assert [k for k, _ in transport.sent] == [frames.REPLY]
        assert (regions.regions, memory.closes) == (0, 1)

    run(main())


# --- tritonclient against a live CPU server, one and two HTTP processes -------------------------------------


@pytest.mark.parametrize("processes", ["1", "2"])
def test_tritonclient_s_cuda_calls_get_the_server_s_answers(repo, server_factory, processes):
    """tritonclient's CUDA shared-memory calls, as they are on the wire, against a server without a GPU: register
    is refused with the reason (from the engine process's STATE in a multi-process server), the rest answers."""
    import tritonclient.http as triton

    root, _ = repo
    proc = server_factory({"DECONV_LAYER_REPOSITORY": str(root), "DECONV_HTTP_PROCESSES": processes})
    client = triton.InferenceServerClient(proc.url.removeprefix("http://"), network_timeout=30.0)
    try:
        assert "cuda_shared_memory" not in client.get_server_metadata()["extensions"]
        with pytest.raises(triton.InferenceServerException, match="CUDA shared memory needs a GPU"):
            client.register_cuda_shared_memory("r", base64.b64encode(HANDLE), 0, 1024)
        with pytest.raises(triton.InferenceServerException, match="not valid base64"):
            client.register_cuda_shared_memory("r", b"not base64!", 0, 1024)
        assert client.get_cuda_shared_memory_status() == []
        with pytest.raises(triton.InferenceServerException, match="no shared-memory region named 'r'"):
            client.get_cuda_shared_memory_status("r")
        client.unregister_cuda_shared_memory("r")
        client.unregister_cuda_shared_memory()
    finally:
        client.close()
