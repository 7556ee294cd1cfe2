"""Workers: execution on the CPU reference, out-of-memory halving, failures, least-busy choice, self-tests."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from service.codec import CudaJob, DeviceTensor
from service.config import DEFAULT_LAYER_REPOSITORY
from service.engine.kinds import Kind
from service.engine.paths import Paths, host_batch, kernel_forward, region_stream
from service.engine.pool import WorkerPool, select_devices
from service.engine.registry import BatchLimits, Layer, load_repository
from service.engine.worker import Worker
from service.errors import InternalError
from service.metrics import Metrics
from tests.numerics import rel_err

from ..conftest import metric_value, run

LIMITS = BatchLimits(64, 1 << 28, 2.0, 256)


@pytest.fixture(scope="module")
def layers() -> dict[str, Layer]:
    reg = load_repository(DEFAULT_LAYER_REPOSITORY, LIMITS)
    return {name: reg.get(name) for name in reg.names()}


def _reference(layer: Layer, x: torch.Tensor) -> torch.Tensor:
    c = layer.config
    b = layer.bias.double() if layer.bias is not None else None
    return torch.nn.functional.conv_transpose2d(x.double(), layer.weight.double(), b, c.stride, c.padding,
                                                c.output_padding, c.groups, c.dilation)


def test_cpu_worker_splits_the_batch_back_per_request(layers):
    layer = layers["grouped_dilated"]
    worker = Worker(torch.device("cpu"))
    worker.load(layer)
    inputs = [torch.randn(n, 48, 5, 6) for n in (1, 3, 2)]
    outputs = worker.submit(layer, inputs).result()
    assert [tuple(y.shape) for y in outputs] == [(n, 24, *layer.output_hw(5, 6)) for n in (1, 3, 2)]
    for x, y in zip(inputs, outputs, strict=True):
        ref = _reference(layer, x)
        assert rel_err(y, ref) < 1e-5
    worker.shutdown()


def test_out_of_memory_retries_in_halves(layers):
    layer = layers["demo"]
    calls: list[int] = []

    def tight(x, w, b, lay):
        calls.append(int(x.shape[0]))
        if x.shape[0] > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return kernel_forward(x, w, b, lay)

    m = Metrics()
    worker = Worker(torch.device("cpu"), m, forward=tight)
    worker.load(layer)
    inputs = [torch.randn(3, 16, 4, 4), torch.randn(2, 16, 4, 4)]
    outputs = worker.submit(layer, inputs).result()
    assert calls[0] == 5  # tried whole, then halves until they fit
    assert calls[1:] == [2, 3, 1, 2]  # 5 -> 2 + 3, 3 -> 1 + 2
    for x, y in zip(inputs, outputs, strict=True):
        assert torch.allclose(y.double(), _reference(layer, x), atol=1e-5)
    assert metric_value(m.render().decode(), "deconv_worker_failures_total", worker="cpu", kind="oom_retry") == 2
    worker.shutdown()


def test_out_of_memory_for_one_sample_fails_the_batch_and_the_worker_lives_on(layers):
    layer = layers["demo"]
    budget = {"fail": True}

    def flaky(x, w, b, lay):
        if budget["fail"]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return kernel_forward(x, w, b, lay)

    worker = Worker(torch.device("cpu"), forward=flaky)
    worker.load(layer)
    with pytest.raises(InternalError, match="out of GPU memory"):
        worker.submit(layer, [torch.randn(2, 16, 4, 4)]).result()
    budget["fail"] = False
    (y,) = worker.submit(layer, [torch.randn(1, 16, 4, 4)]).result()
    assert y.shape == (1, 8, 8, 8)
    worker.shutdown()


def test_kernel_failure_gives_a_message_without_traceback(layers):
    layer = layers["demo"]

    def broken(x, w, b, lay):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\n  File secret.py, line 1")

    m = Metrics()
    worker = Worker(torch.device("cpu"), m, forward=broken)
    worker.load(layer)
    with pytest.raises(InternalError) as info:
        worker.submit(layer, [torch.randn(1, 16, 4, 4)]).result()
    assert "secret.py" not in info.value.message
    assert "RuntimeError" in info.value.message
    assert metric_value(m.render().decode(), "deconv_worker_failures_total", worker="cpu", kind="error") == 1
    worker.shutdown()


def test_pool_picks_the_least_busy_worker_with_a_free_slot(layers):
    async def main() -> None:
        a, b = Worker(torch.device("cpu")), Worker(torch.device("cpu"))
        a.name, b.name = "w0", "w1"
        pool = WorkerPool([a, b], max_inflight_batches=1)
        a.inflight_samples = 10  # a is busier
        first = await pool.acquire()
        assert first is b
        second = await pool.acquire()
        assert second is a
        waiter = asyncio.ensure_future(pool.acquire())
        for _ in range(20):  # every turn of the loop the waiter could take
            await asyncio.sleep(0)
        assert not waiter.done()  # no free slot: waits
        pool.release(b)
        assert await asyncio.wait_for(waiter, 5) is b
        pool.shutdown()

    run(main(), 10)


def test_pool_fills_the_least_busy_device_before_a_second_worker_of_a_busy_one():
    """Two GPUs with two workers each: a batch goes to a worker of the device with the fewest samples in flight, so
    that two batches at once run on two GPUs, not on two workers of one (the selection alone: stand-in workers)."""
    async def main() -> None:
        workers = [SimpleNamespace(name=f"cuda:{d}/{i}", device=torch.device("cuda", d), is_cuda=True,
                                   inflight_samples=0, inflight_batches=0) for d in (0, 1) for i in (0, 1)]
        pool = WorkerPool(workers, max_inflight_batches=1)  # type: ignore[arg-type]
        first = await pool.acquire()
        first.inflight_samples = 8
        second = await pool.acquire()
        assert (first.name, second.name) == ("cuda:0/0", "cuda:1/0")
        second.inflight_samples = 2
        assert (await pool.acquire()).name == "cuda:1/1"  # the device with fewer samples in flight
        assert (await pool.acquire(0)).name == "cuda:0/1"  # a batch in GPU 0's CUDA shared memory

    run(main(), 10)


def test_pool_gives_the_workers_of_each_gpu_one_stream_for_its_cuda_shared_memory(monkeypatch):
    """``WorkerPool.load``: one stream a GPU, shared by that GPU's workers, made once (stand-in workers and streams:
    no GPU here)."""
    made: list[torch.device] = []

    class Stream:
        def __init__(self, device: torch.device) -> None:
            made.append(device)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    loaded: list[str] = []
    workers = [SimpleNamespace(name=f"cuda:{d}/{i}", device=torch.device("cuda", d), is_cuda=True, gpu_stream=None,
                               load=lambda layer, n=f"cuda:{d}/{i}": loaded.append(n)) for d in (0, 1) for i in (0, 1)]
    cpu = SimpleNamespace(name="cpu", device=torch.device("cpu"), is_cuda=False, gpu_stream=None,
                          load=lambda layer: loaded.append("cpu"))
    pool = WorkerPool([*workers, cpu])  # type: ignore[list-item]
    pool.load(object())  # type: ignore[arg-type]
    pool.load(object())  # type: ignore[arg-type]
    assert made == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert workers[0].gpu_stream is workers[1].gpu_stream is not None
    assert workers[2].gpu_stream is workers[3].gpu_stream is not None
    assert workers[0].gpu_stream is not workers[2].gpu_stream
    assert cpu.gpu_stream is None
    assert loaded == ["cuda:0/0", "cuda:0/1", "cuda:1/0", "cuda:1/1", "cpu"] * 2


def test_a_batch_in_cuda_shared_memory_runs_on_the_gpu_stream_one_in_system_regions_on_the_workers_own():
    worker = Worker(torch.device("cpu"))
    own, shared = object(), object()
    worker.stream, worker.gpu_stream = own, shared  # type: ignore[assignment]

    def job(device: int) -> CudaJob:
        return CudaJob(DeviceTensor("region", device, 0, torch.float32, (1, 2, 4, 4)), None)

    assert region_stream(worker, [job(0), job(0)]) is shared
    assert region_stream(worker, [job(-1)]) is own
    worker.gpu_stream = None  # a worker outside a pool: its own stream for everything
    assert region_stream(worker, [job(0)]) is own
    worker.shutdown()


def test_pool_runs_batches_off_the_event_loop(layers):
    layer = layers["demo"]

    async def main() -> None:
        pool = WorkerPool([Worker(torch.device("cpu"))])
        pool.load(layer)
        worker = await pool.acquire()
        x = torch.randn(2, 16, 8, 8)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        (y,) = await pool.run(worker, layer, [x])
        t.cancel()
        assert ticks > 0  # the loop kept running while the batch executed
        assert torch.allclose(y.double(), _reference(layer, x), atol=1e-5)
        assert worker.inflight_batches == 0
        assert worker.inflight_samples == 0
        pool.shutdown()

    run(main(), 10)


def test_self_test_catches_a_wrong_kernel(layers):
    layer = layers["unet_up"]

    def wrong(x, w, b, lay):
        return kernel_forward(x, w, b, lay) * 1.001  # 1e-3 off: more than exact fp32 allows

    async def main() -> None:
        good = WorkerPool([Worker(torch.device("cpu"))])
        good.load(layer)
        assert await good.self_test(layer) == []
        bad = WorkerPool([Worker(torch.device("cpu"), forward=wrong)])
        bad.load(layer)
        problems = await bad.self_test(layer)
        assert len(problems) == 1
        assert "unet_up" in problems[0]
        assert "exceeds 1e-05" in problems[0]
        good.shutdown()
        bad.shutdown()

    run(main(), 20)


def test_select_devices_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    devs, why = select_devices("auto")
    assert devs == [torch.device("cpu")]
    assert why == "no CUDA device visible: serving on CPU with the PyTorch reference"
    assert select_devices("cpu")[0] == [torch.device("cpu")]
    for spec in ("all", [0]):
        with pytest.raises(RuntimeError, match="no CUDA device is visible"):
            select_devices(spec)


def test_a_dead_worker_thread_is_replaced_and_its_batches_fail(layers, caplog):
    from service.faults import WorkerCrash

    layer = layers["demo"]
    gate = asyncio.Event()  # set on the loop once the first batch is executing
    queued = threading.Event()  # set once the second batch is in the thread's queue, behind the first

    def dies_on_three(x, w, b, lay):
        if x.shape[0] == 3:
            loop.call_soon_threadsafe(gate.set)
            queued.wait(60)  # (the bound only limits how long a second batch that never comes is waited for)
            raise WorkerCrash("simulated thread death")
        return kernel_forward(x, w, b, lay)

    async def main() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        m = Metrics()
        worker = Worker(torch.device("cpu"), m, forward=dies_on_three)
        worker.load(layer)
        submit = worker.submit

        def submit_and_tell(lay: Layer, inputs: list[torch.Tensor], kind: Kind = Kind.HOST) -> Any:
            future = submit(lay, inputs, kind)
            if inputs[0].shape[0] == 1:
                queued.set()
            return future

        worker.submit = submit_and_tell  # type: ignore[method-assign]
        pool = WorkerPool([worker], m)
        try:
            first = asyncio.ensure_future(pool.run(await pool.acquire(), layer, [torch.randn(3, 16, 4, 4)]))
            await gate.wait()
            second = asyncio.ensure_future(pool.run(await pool.acquire(), layer, [torch.randn(1, 16, 4, 4)]))
            for task in (first, second):
                with pytest.raises(InternalError, match="died while holding this batch"):
                    await asyncio.wait_for(task, 10)
            (y,) = await pool.run(await pool.acquire(), layer, [torch.randn(2, 16, 4, 4)])
            assert y.shape == (2, 8, 8, 8)
            assert metric_value(m.render().decode(), "deconv_worker_restarts_total", worker="cpu", reason="died") == 1
            assert "thread died; 2 batch(es) it held failed" in caplog.text
            assert worker.inflight_batches == 0
        finally:
            pool.shutdown()

    loop: asyncio.AbstractEventLoop
    run(main())


def test_a_stalled_worker_thread_is_replaced_by_the_watchdog(layers):
    layer = layers["demo"]
    release = threading.Event()

    def hangs_on_three(x, w, b, lay):
        if x.shape[0] == 3:
            release.wait(120)  # set only at the end of the test: until then this batch is stalled
        return kernel_forward(x, w, b, lay)

    async def main() -> None:
        m = Metrics()
        worker = Worker(torch.device("cpu"), m, forward=hangs_on_three)
        worker.load(layer)
        pool = WorkerPool([worker], m, worker_timeout_s=0.3)
        watchdog = asyncio.ensure_future(pool.watch(period_s=0.05))
        try:
            t0 = time.monotonic()
            # The batch never finishes by itself (release is set in finally), so an answer at all shows the watchdog
            # replaced the worker; the bound only limits how long a broken watchdog is waited for.
            with pytest.raises(InternalError, match="stalled"):
                await asyncio.wait_for(pool.run(await pool.acquire(), layer, [torch.randn(3, 16, 4, 4)]), 60)
            assert time.monotonic() - t0 >= 0.3  # not before the worker timeout (a lower bound: no slow-machine risk)
            (y,) = await pool.run(await pool.acquire(), layer, [torch.randn(1, 16, 4, 4)])
            assert y.shape == (1, 8, 8, 8)
            assert metric_value(m.render().decode(), "deconv_worker_restarts_total", worker="cpu",
                                reason="stalled") == 1
        finally:
            watchdog.cancel()
            release.set()  # the abandoned thread finishes; shutdown joins it
            pool.shutdown()

    run(main())


def test_several_workers_a_device_each_hold_the_layers_and_answer(layers):
    """``workers_per_device=2``: two workers on the one device, named apart, each with every layer; concurrent
    requests are answered with the reference's numbers whichever worker ran them."""
    from service.config import Settings

    from ..conftest import NPY, load_npy, npy_bytes, serve_app

    layer = layers["demo"]
    xs = [torch.randn(n, layer.config.in_channels, 6, 5) for n in (1, 2, 3, 1, 2, 4)]

    async def main_() -> None:
        settings = Settings(layer_repository=DEFAULT_LAYER_REPOSITORY, devices="cpu", workers_per_device=2)
        async with serve_app(settings) as (app, client):
            pool = app.state.engine.pool
            assert [w.name for w in pool.workers] == ["cpu/0", "cpu/1"]
            assert (pool.parallelism, pool.devices) == (2, 1)  # a layer's full batches may use both
            assert all(set(w.weights) == set(layers) for w in pool.workers)
            answers = await asyncio.gather(*(
                client.post("/deconv?layer=demo", content=npy_bytes(x.numpy()), headers={"content-type": NPY})
                for x in xs))
        for x, r in zip(xs, answers, strict=True):
            assert r.status_code == 200, r.text[:300]
            y = torch.from_numpy(load_npy(r.content))
            torch.testing.assert_close(y.double(), _reference(layer, x), rtol=1e-4, atol=1e-5)

    run(main_())


def test_a_batch_takes_the_path_its_worker_chose_for_its_kind(layers):
    """The worker picks a path per kind once, when made; each batch runs the one of the kind it came with."""
    layer = layers["demo"]
    taken: list[str] = []

    def path(name: str) -> Any:
        def run(w: Any, lay: Layer, inputs: Any, turn: Any) -> list[Any]:
            taken.append(name)
            return host_batch(w, lay, inputs, turn)
        return run

    worker = Worker(torch.device("cpu"), paths=Paths(host=path("host"), slots=path("slots"), regions=path("regions")))
    worker.load(layer)
    try:
        x = torch.randn(2, 16, 4, 4)
        for kind in (Kind.SLOTS, Kind.HOST, Kind.REGIONS):
            (y,) = worker.submit(layer, [x], kind).result(timeout=30)
            torch.testing.assert_close(y, kernel_forward(x, layer.weight, layer.bias, layer))
        assert taken == ["slots", "host", "regions"]
    finally:
        worker.shutdown()


def test_a_cpu_worker_refuses_requests_in_shared_memory(layers):
    """A CPU server maps no shared memory; a batch of such requests that reached a CPU worker fails, and the worker
    keeps serving."""
    layer = layers["demo"]
    worker = Worker(torch.device("cpu"))
    worker.load(layer)
    try:
        job = CudaJob(DeviceTensor("region", -1, 0, torch.float32, (1, 16, 4, 4)), None)
        with pytest.raises(InternalError, match="need a GPU"):
            worker.submit(layer, [job], Kind.REGIONS).result(timeout=30)
        x = torch.randn(1, 16, 4, 4)
        (y,) = worker.submit(layer, [x]).result(timeout=30)
        torch.testing.assert_close(y, kernel_forward(x, layer.weight, layer.bias, layer))
    finally:
        worker.shutdown()
