"""KServe system shared memory mapped by the engine (a GPU server): the engine maps a registered region and
page-locks it, and its tensors go to the engine by reference, so that the GPU's copy engines move them and the HTTP
processes copy nothing. Without a GPU the page lock is stood in for by the identity (``pin``), and the CPU worker
reads and writes the mapping through the same device path; the GPU runs the real thing (tests/service/test_cuda_shm.py).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from service.codec import CudaJob, DeviceTensor
from service.engine.cuda_shm import CudaRegions
from service.errors import InternalError, RegionError, UnknownRegionError
from service.http.shm_regions import RegionTable
from service.ipc import frames
from tests.numerics import rel_err

from ..conftest import reference, run, serve_app
from ..cpu_regions import cpu_regions  # noqa: F401  (a fixture)
from ..http import test_system_shm
from ..http.test_cuda_shm_routes import HostMemory, _body, _deliver, _infer_body, _parts, _Transport
from ..http.test_system_shm import AUTH, X_BYTES, X_SHAPE, Y_BYTES, Y_SHAPE, Objects, _settings

repo = test_system_shm.repo  # the system regions' tests' layer repository (a fixture)
pytestmark = pytest.mark.usefixtures("cpu_regions")  # the CPU workers compute requests in shared memory


@pytest.fixture
def objects() -> Iterator[Objects]:
    made = Objects()
    yield made
    made.close()


def _identity(view: memoryview) -> memoryview:
    return view  # the page lock's stand-in without a GPU


def _regions(**kw: Any) -> CudaRegions:
    regions = CudaRegions(4, **kw)
    regions.configure([torch.device("cpu")], HostMemory(), pin=_identity)
    return regions


def _identity_of(key: str) -> tuple[int, int]:
    st = os.stat("/dev/shm/" + key.lstrip("/"))
    return st.st_dev, st.st_ino


# --- the engine's side ----------------------------------------------------------------------------------------


def test_the_engine_maps_a_system_region_and_leases_exactly_its_bytes(objects: Objects) -> None:
    key, shm = objects.new(3 * 4096)
    shm.buf[:] = bytes(i % 251 for i in range(3 * 4096))
    dev, ino = _identity_of(key)
    regions = _regions()
    token = uuid.uuid4().hex
    offset = 4096 + 100  # not on a page boundary: the mapping starts at the page, the region at its offset

    async def main() -> None:
        assert regions.system_available
        await regions.open_system(token, key, offset, 512, dev, ino)
        with pytest.raises(RegionError, match="open already"):
            await regions.open_system(token, key, offset, 512, dev, ino)
        t = regions.lease(token, 8, 16, 0)
        assert t.device.type == "cpu"
        assert bytes(t.numpy()) == bytes(shm.buf[offset + 8:offset + 24])
        t[:] = 7  # the engine's copies land in the client's object
        assert bytes(shm.buf[offset + 8:offset + 24]) == b"\x07" * 16
        address, nbytes = regions.place(token, 32, 8, 0)  # the GPU path's lease: where the bytes are
        assert (ctypes.string_at(address, nbytes), nbytes) == (bytes(shm.buf[offset + 32:offset + 40]), 8)
        for lease in (regions.lease, regions.place):
            with pytest.raises(RegionError, match="reach past the end"):
                lease(token, 500, 16, 0)
        await regions.close([token])  # leased: unmapped once released, and no new lease meanwhile
        for lease in (regions.lease, regions.place):
            with pytest.raises(UnknownRegionError, match="unregistered"):
                lease(token, 0, 4, 0)
        regions.release(token)
        assert regions.regions == 1  # the second lease holds it still
        regions.release(token)
        assert regions.regions == 0

    run(main())


def test_the_engine_maps_only_the_object_registered_and_whole(objects: Objects) -> None:
    key, _ = objects.new(4096)
    dev, ino = _identity_of(key)
    regions = _regions()

    async def main() -> None:
        with pytest.raises(RegionError, match="replaced"):
            await regions.open_system(uuid.uuid4().hex, key, 0, 64, dev, ino + 1)
        with pytest.raises(RegionError, match="fewer than the region's"):
            await regions.open_system(uuid.uuid4().hex, key, 4000, 200, dev, ino)
        with pytest.raises(RegionError, match="does not name"):
            await regions.open_system(uuid.uuid4().hex, "/a/b", 0, 64, dev, ino)
        with pytest.raises(RegionError, match="no shared-memory object"):
            await regions.open_system(uuid.uuid4().hex, "/deconv-test-missing-" + uuid.uuid4().hex, 0, 64, dev, ino)
        assert regions.regions == 0

    run(main())


def test_without_a_gpu_or_with_the_setting_off_system_regions_are_not_mapped(objects: Objects) -> None:
    key, _ = objects.new(4096)
    dev, ino = _identity_of(key)
    cpu = CudaRegions(4)
    cpu.configure([torch.device("cpu")], HostMemory())  # no GPU: nothing to lock for
    off = _regions(system=False)
    assert not cpu.system_available
    assert not off.system_available

    async def main() -> None:
        for regions in (cpu, off):
            with pytest.raises(RegionError, match="does not map system shared memory"):
                await regions.open_system(uuid.uuid4().hex, key, 0, 64, dev, ino)

    run(main())


def test_a_lock_the_driver_refuses_is_a_region_error(objects: Objects) -> None:
    key, _ = objects.new(4096)
    dev, ino = _identity_of(key)

    def refuse(view: memoryview) -> memoryview:
        raise RuntimeError("host_register: cudaHostRegister of 4096 bytes failed: out of memory.")

    regions = CudaRegions(4)
    regions.configure([torch.device("cpu")], HostMemory(), pin=refuse)
    with pytest.raises(RegionError, match="cannot page-lock"):
        run(regions.open_system(uuid.uuid4().hex, key, 0, 64, dev, ino))


# --- the registrations' side ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [False, True], ids=["memory", "directory"])
def test_a_region_marked_mapped_goes_by_reference_from_then_on(objects: Objects, tmp_path: Any,
                                                               shared: bool) -> None:
    key, _ = objects.new(4096)
    directory = tmp_path / "regions" if shared else None
    table = RegionTable(4, 1 << 20, directory)
    other = RegionTable(4, 1 << 20, directory) if shared else table  # another HTTP process on the same records
    try:
        record = table.register("r", key, 0, 4096)
        assert not table.by_reference("r")  # read (and kept) before the engine mapped it
        assert not other.by_reference("r")
        assert table.mark_mapped(record)
        assert table.by_reference("r")
        assert other.by_reference("r")
        t = other.device_tensor("r", 64, 256, torch.float32, (64,))
        assert (t.token, t.device, t.offset) == (record.token, -1, 64)
        assert table.unregister("r") == [record.token]  # the engine unmaps it by its token
        again = table.register("r", key, 0, 4096)
        assert not table.mark_mapped(record)  # an old registration is never marked: the caller unmaps it
        assert not table.by_reference("r")
        assert table.unregister("r") == []  # not mapped: nothing for the engine to do
        assert again.token != record.token
    finally:
        table.close()
        if other is not table:
            other.close()


# --- requests through the server ------------------------------------------------------------------------------


def _no_copies(app: Any) -> None:
    """Fail any copy of a region's bytes by the HTTP side: mapped regions travel as references."""
    def copy(*args: Any) -> None:
        raise AssertionError("the HTTP side copied a region the engine maps")

    app.state.regions.reader = copy
    app.state.regions.write = copy


async def _register_system(c: Any, name: str, key: str, size: int) -> None:
    r = await c.post(f"/v2/systemsharedmemory/region/{name}/register", json={"key": key, "byte_size": size},
                     headers=AUTH)
    assert r.status_code == 200, r.text


def test_requests_in_mapped_system_regions_batch_together_by_reference(repo, objects: Objects) -> None:
    root, module = repo
    xs = [np.random.default_rng(seed).standard_normal(X_SHAPE).astype(np.float32) for seed in range(3)]
    in_key, in_obj = objects.new(3 * X_BYTES + 4096)
    out_key, out_obj = objects.new(3 * Y_BYTES + 4096)
    for i, x in enumerate(xs):
        in_obj.buf[64 + i * X_BYTES:64 + (i + 1) * X_BYTES] = x.tobytes()
    out_obj.buf[:] = b"\xa5" * len(out_obj.buf)

    async def main() -> None:
        # A batch runs when it holds max_batch_size samples (the delay never runs out): all 9, in one call.
        async with serve_app(_settings(root, max_queue_delay_ms=600_000.0, max_batch_size=9)) as (app, c):
            engine_regions: CudaRegions = app.state.engine.cuda_memory
            engine_regions.configure([torch.device("cpu")], HostMemory(), pin=_identity)
            await _register_system(c, "in", in_key, 3 * X_BYTES + 64)
            await _register_system(c, "out", out_key, 3 * Y_BYTES + 4096)
            assert app.state.regions.by_reference("in")
            assert app.state.regions.by_reference("out")
            assert engine_regions.regions == 2
            _no_copies(app)
            rs = await asyncio.gather(*(c.post("/v2/models/up/infer", headers=AUTH, json=_infer_body(
                {"shared_memory_region": "in", "shared_memory_byte_size": X_BYTES,
                 "shared_memory_offset": 64 + i * X_BYTES},
                {"shared_memory_region": "out", "shared_memory_byte_size": Y_BYTES,
                 "shared_memory_offset": 64 + i * Y_BYTES})) for i in range(3)))
            for i, (x, r) in enumerate(zip(xs, rs, strict=True)):
                assert r.status_code == 200, r.text
                assert r.headers["x-deconv-batch-size"] == "9"
                out = r.json()["outputs"][0]
                assert out["parameters"] == {"shared_memory_region": "out", "shared_memory_byte_size": Y_BYTES,
                                             "shared_memory_offset": 64 + i * Y_BYTES}
                y = np.frombuffer(bytes(out_obj.buf[64 + i * Y_BYTES:64 + (i + 1) * Y_BYTES]), np.float32)
                assert rel_err(y.reshape(Y_SHAPE), reference(module, torch.from_numpy(x))) < 1e-5
            assert bytes(out_obj.buf[:64]) == b"\xa5" * 64
            tail = 64 + 3 * Y_BYTES
            assert bytes(out_obj.buf[tail:]) == b"\xa5" * (len(out_obj.buf) - tail)

    run(main())


def test_mapped_system_regions_with_other_inputs_and_outputs_and_unregistered(repo, objects: Objects) -> None:
    root, module = repo
    x = np.random.default_rng(3).standard_normal(X_SHAPE).astype(np.float32)
    ref = reference(module, torch.from_numpy(x))
    in_key, in_obj = objects.new(X_BYTES)
    in_obj.buf[:] = x.tobytes()
    out_key, out_obj = objects.new(Y_BYTES)
    memory = HostMemory()
    cuda_handle, cuda_out = memory.allocate(Y_BYTES, fill=0xA5)
    inp = {"shared_memory_region": "in", "shared_memory_byte_size": X_BYTES}
    out = {"shared_memory_region": "out", "shared_memory_byte_size": Y_BYTES}

    def system_output() -> np.ndarray:
        return np.frombuffer(bytes(out_obj.buf), np.float32).reshape(Y_SHAPE)

    async def main() -> None:
        async with serve_app(_settings(root)) as (app, c):
            engine_regions: CudaRegions = app.state.engine.cuda_memory
            engine_regions.configure([torch.device("cpu")], memory, pin=_identity)
            await _register_system(c, "in", in_key, X_BYTES)
            await _register_system(c, "out", out_key, Y_BYTES)
            r = await c.post("/v2/cudasharedmemory/region/cuda/register", json=_body(cuda_handle, byte_size=Y_BYTES),
                             headers=AUTH)
            assert r.status_code == 200, r.text
            _no_copies(app)

            async def infer(body: dict[str, Any]) -> Any:
                r = await c.post("/v2/models/up/infer", headers=AUTH, json=body)
                assert r.status_code == 200, r.text
                return r.json()["outputs"][0]

            # into a CUDA region; as JSON; from JSON data into the system region
            await infer(_infer_body(inp, {"shared_memory_region": "cuda", "shared_memory_byte_size": Y_BYTES}))
            assert rel_err(np.frombuffer(bytes(cuda_out), np.float32).reshape(Y_SHAPE), ref) < 1e-5
            got = await infer(_infer_body(inp, {"binary_data": False}))
            assert rel_err(np.array(got["data"]).reshape(Y_SHAPE), ref) < 1e-5
            body = _infer_body({}, out)
            body["inputs"][0]["data"] = x.ravel().tolist()
            await infer(body)
            assert rel_err(system_output(), ref) < 1e-5

            # unregistered: unmapped by the engine, and refused
            assert (await c.post("/v2/systemsharedmemory/region/in/unregister", headers=AUTH)).status_code == 200
            assert engine_regions.regions == 2
            r = await c.post("/v2/models/up/infer", headers=AUTH, json=_infer_body(inp))
            assert r.status_code == 400
            assert r.json()["type"] == "unknown_shared_memory_region"
            assert (await c.post("/v2/systemsharedmemory/unregister", headers=AUTH)).status_code == 200
            assert engine_regions.regions == 1

    run(main())


def test_a_region_the_engine_cannot_map_is_served_by_copies(repo, objects: Objects) -> None:
    root, module = repo
    x = np.random.default_rng(5).standard_normal(X_SHAPE).astype(np.float32)
    in_key, in_obj = objects.new(X_BYTES)
    in_obj.buf[:] = x.tobytes()

    def refuse(view: memoryview) -> memoryview:
        raise RuntimeError("host_register: cudaHostRegister failed: operation not supported.")

    async def main() -> None:
        async with serve_app(_settings(root)) as (app, c):
            app.state.engine.cuda_memory.configure([torch.device("cpu")], HostMemory(), pin=refuse)
            r = await c.post("/v2/systemsharedmemory/region/in/register", json={"key": in_key, "byte_size": X_BYTES},
                             headers=AUTH)
            assert r.status_code == 200, r.text
            assert not app.state.regions.by_reference("in")
            r = await c.post("/v2/models/up/infer", headers=AUTH, json=_infer_body(
                {"shared_memory_region": "in", "shared_memory_byte_size": X_BYTES}, {"binary_data": False}))
            assert r.status_code == 200, r.text
            y = np.array(r.json()["outputs"][0]["data"]).reshape(Y_SHAPE)
            assert rel_err(y, reference(module, torch.from_numpy(x))) < 1e-5

    run(main())


def test_a_replacement_leaves_the_batch_writing_clients_regions_to_the_old_thread(repo, objects: Objects) -> None:
    """A client told that its request failed could reuse its output region: the batch the GPU writes into it is not
    failed by a replacement (watchdog: stalled) but answered by the old thread once written; one queued behind it
    fails, and the new thread serves the next."""
    from service.engine.kinds import Kind
    from service.engine.paths import kernel_forward
    from service.engine.registry import BatchLimits, load_repository
    from service.engine.worker import Worker

    root, module = repo
    layer = load_repository(root, BatchLimits(8, 1 << 20, 0.0, 8)).get("up")
    x = np.random.default_rng(9).standard_normal((1, 4, 6, 6)).astype(np.float32)
    in_key, in_obj = objects.new(x.nbytes)
    in_obj.buf[:] = x.tobytes()
    out_key, out_obj = objects.new(Y_BYTES // 3)
    started, go = threading.Event(), threading.Event()

    def stalling(xs: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, lay: Any) -> torch.Tensor:
        started.set()
        assert go.wait(30)
        return kernel_forward(xs, w, b, lay)

    regions = _regions()
    worker = Worker(torch.device("cpu"), forward=stalling, cuda=regions)
    worker.load(layer)

    async def main() -> None:
        tokens = []
        for key, size in ((in_key, x.nbytes), (out_key, Y_BYTES // 3)):
            tokens.append(uuid.uuid4().hex)
            await regions.open_system(tokens[-1], key, 0, size, *_identity_of(key))
        job = CudaJob(DeviceTensor(tokens[0], -1, 0, torch.float32, x.shape),
                      DeviceTensor(tokens[1], -1, 0, torch.float32, (1, 6, 12, 12)))
        assert job.device == -1  # system regions only: any GPU
        writing = worker.submit(layer, [job], Kind.REGIONS)
        assert await asyncio.to_thread(started.wait, 30)
        queued = worker.submit(layer, [job], Kind.REGIONS)
        assert worker.restart("stalled")
        with pytest.raises(InternalError, match="stalled"):
            await asyncio.wrap_future(queued)
        assert not writing.done()
        go.set()
        (answer,) = await asyncio.wrap_future(writing)
        assert answer is job.out
        y = np.frombuffer(bytes(out_obj.buf), np.float32).reshape(1, 6, 12, 12)
        assert rel_err(y, reference(module, torch.from_numpy(x))) < 1e-5
        (again,) = await asyncio.wrap_future(worker.submit(layer, [job], Kind.REGIONS))  # the new thread serves
        assert again is job.out

    try:
        run(main())
    finally:
        go.set()
        worker.shutdown()


# --- a multi-process server's frames --------------------------------------------------------------------------


def test_system_open_frames_round_trip_and_the_engine_process_answers_them(objects: Objects) -> None:
    key, _ = objects.new(8192)
    dev, ino = _identity_of(key)
    token = uuid.uuid4().hex
    kind, body = _parts(frames.system_open_frame(7, token, key, 100, 4000, dev, ino))
    assert (kind, frames.parse_system_open(body)) == (frames.SYSTEM_OPEN, (7, token, key, 100, 4000, dev, ino))
    with pytest.raises(frames.ProtocolError, match="bad SYSTEM_OPEN"):
        frames.parse_system_open(bytearray(10))
    state = frames.parse_state(_parts(frames.state_frame("ready", "", "cuda", ["up"], True, "", True))[1])
    assert state["system_shm"] is True

    async def main() -> None:
        from service.engine.process import EngineConnection

        regions = _regions()
        server = SimpleNamespace(engine=SimpleNamespace(cuda_memory=regions), calls=set())
        conn = EngineConnection(server, None)  # type: ignore[arg-type]
        transport = _Transport()
        conn.transport = transport
        _deliver(conn, frames.system_open_frame(1, token, key, 100, 4000, dev, ino))
        _deliver(conn, frames.system_open_frame(2, uuid.uuid4().hex, key, 100, 4000, dev, ino + 1))
        while server.calls:  # each answered by its done callback
            await asyncio.gather(*server.calls, return_exceptions=True)
            await asyncio.sleep(0)
        conn._flush()
        answers = {frames.result_id(body): (kind, body) for kind, body in transport.sent}
        assert answers[1][0] == frames.REPLY
        assert answers[2][0] == frames.ERROR
        assert isinstance(frames.parse_error(answers[2][1])[1], RegionError)
        assert regions.regions == 1

    run(main())

