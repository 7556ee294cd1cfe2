"""The in-process engine: ``LocalEngine`` holds the layer registry, the workers, one batcher per layer, the metrics,
the readiness and the clients' CUDA shared-memory regions (``service.engine.cuda_shm``), and runs their life cycle
(one of the two ``service.engine.interface.Engine``\\ s).

``start()`` loads and checks the layer repository (an invalid one stops the server before it accepts anything),
starts the batchers, and starts a background task that builds the kernels (GPU) and self-tests every layer, so
that ``/health/live`` answers at once while ``/health/ready`` says 503 until the self-tests pass. ``stop()`` (on
SIGTERM) refuses new work, lets every queued request finish, then stops the workers. A server of one process serves
HTTP on one; the engine process of a multi-process server (``service.engine.process``) serves its HTTP processes
with one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping

from service.config import Settings, parse_devices
from service.engine.batcher import Batcher
from service.engine.cuda_shm import CudaRegions
from service.engine.interface import LayerQueue, Readiness
from service.engine.pool import WorkerPool, select_devices
from service.engine.registry import Registry, load_registry
from service.engine.worker import Worker
from service.faults import Faults
from service.metrics import Metrics

log = logging.getLogger("deconv.service")

# Worker threads a GPU unless Settings.workers_per_device says otherwise: the second takes a layer's full batches
# while the first runs one (service.engine.batcher), so that transfers overlap kernels (bench/NOTES.md). The CPU has
# one: two CPU convolutions at once would only share its cores.
GPU_WORKERS = 2


class LocalEngine:
    """The layers computed in this process: batchers on the event loop, worker threads on the devices.

    ``observe_queue_time`` False (the engine process): the HTTP processes observe each request's queue time, from
    the RESULT frame, in parallel and off the engine's event loop.
    """

    def __init__(self, settings: Settings, *, observe_queue_time: bool = True) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.readiness = Readiness(self.metrics, "starting: kernels and self-tests have not finished")
        self.registry: Registry | None = None
        self.pool: WorkerPool | None = None
        # available once start() found GPUs
        self.cuda_memory = CudaRegions(settings.cuda_shm_max_regions, settings.system_shm_pinned)
        self.batchers: dict[str, Batcher] = {}
        self.backend = ""
        self.drained = False
        self.observe_queue_time = observe_queue_time
        self.faults = Faults.from_spec(settings.faults) if settings.test_mode else Faults()
        self._warm_up: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def queues(self) -> Mapping[str, LayerQueue]:
        """Each layer's batcher, by name."""
        return self.batchers

    @property
    def idle(self) -> bool:
        """Whether no request is queued and no batch is executing."""
        queued = any(b.depth for b in self.batchers.values())
        return not queued and (self.pool is None or not any(w.inflight_batches for w in self.pool.workers))

    def body_buffer(self, nbytes: int) -> memoryview | None:
        """None: the workers take a request's tensor from any host memory (``Engine.body_buffer``)."""
        return None

    def begin_drain(self) -> None:
        """Refuse new work (503 from now on); queued requests still run, at once (``Engine.begin_drain``)."""
        if self.readiness.begin_drain():
            self.faults.begin_drain()
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._drain_now)

    def _drain_now(self) -> None:
        # On the event loop: queued requests go now instead of waiting out their delay.
        queued = sum(b.depth for b in self.batchers.values())
        log.info("draining: not ready any more; executing %d queued request(s) now", queued)
        for batcher in self.batchers.values():
            batcher.begin_drain()
        self.readiness.notify()  # (not from the signal handler)

    async def start(self) -> None:
        """Load the repository, pick the devices, start the batchers and the warm-up task.

        Raises:
            RepositoryError: the layer repository is invalid (the server must not start).
            RuntimeError: the devices asked for are not there.
        """
        s = self.settings
        self._loop = asyncio.get_running_loop()
        if self.faults:
            log.critical("TEST MODE: injecting faults once ready (DECONV_FAULTS=%s); never run this in production",
                         self.faults.describe())
        self.registry = load_registry(s)
        devices, why = select_devices(parse_devices(s.devices))
        self.backend = "cuda" if devices[0].type == "cuda" else "cpu"
        log.info("%s", why)
        log.info("layer repository %s: %d layer(s): %s", self.registry.root, len(self.registry),
                 ", ".join(self.registry.names()))
        self.cuda_memory.configure(devices)
        per = s.workers_per_device or (GPU_WORKERS if self.backend == "cuda" else 1)
        workers = [Worker(d, self.metrics, faults=self.faults, cuda=self.cuda_memory,
                          name=str(d) if per == 1 else f"{d}/{i}")
                   for d in devices for i in range(per)]
        self.pool = WorkerPool(workers, self.metrics, worker_timeout_s=s.worker_timeout_s)
        self._watchdog = asyncio.create_task(self.pool.watch(), name="deconv-worker-watchdog")
        if self.backend == "cuda":
            self.metrics.watch_gpus([d.index for d in devices if d.index is not None])
        for layer in self.registry:
            batcher = Batcher(layer, self.pool, self.metrics, observe_queue_time=self.observe_queue_time)
            batcher.start()
            self.batchers[layer.name] = batcher
        self.metrics.http_processes.set(1)  # a multi-process server's engine counts its connections instead
        self._warm_up = asyncio.create_task(self._prepare(), name="deconv-warm-up")

    async def _warm_layers(self) -> None:
        """Measured kernel choice on or off (Settings.tune), then every layer's warm_shapes run on every worker."""
        assert self.registry is not None
        assert self.pool is not None
        from kernels import tuning

        tuning.enable(self.settings.tune)
        t0 = time.perf_counter()
        runs = 0
        for layer in self.registry:
            runs += await self.pool.warm_up(layer)
        log.info("warm-up: %d batch(es) of the layers' warm_shapes in %.1f s (measured kernel choice %s, %d "
                 "problem(s) measured)", runs, time.perf_counter() - t0, "on" if self.settings.tune else "off",
                 len(tuning.TUNER))

    async def _prepare(self) -> None:
        assert self.registry is not None
        assert self.pool is not None
        t0 = time.perf_counter()
        try:
            if self.backend == "cuda":
                from kernels.build import KernelBuildError
                from kernels.build import load as load_kernels

                try:
                    await asyncio.to_thread(load_kernels)
                except KernelBuildError as exc:
                    log.error("building the CUDA kernels failed: %s", exc)
                    self._fail("building the CUDA kernels failed; the server log has the compiler's output")
                    return
            for layer in self.registry:
                await asyncio.to_thread(self.pool.load, layer)
            problems: list[str] = []
            if self.settings.self_test:
                for layer in self.registry:
                    problems += await self.pool.self_test(layer)
            if problems:
                self._fail("self-test failed: " + "; ".join(problems))
                return
            if self.backend == "cuda":
                await self._warm_layers()
        except Exception as exc:
            log.exception("warm-up failed")
            self._fail(f"warm-up failed ({type(exc).__name__}); the server log has the details")
            return
        if self.readiness.state == "starting":
            self.readiness.set("ready", "ready")
            self.faults.arm()
            log.info("ready: %d layer(s) on %s passed their self-tests in %.1f s", len(self.registry),
                     self.backend, time.perf_counter() - t0)

    def _fail(self, reason: str) -> None:
        log.error("not ready: %s", reason)
        if self.readiness.state == "starting":
            self.readiness.set("failed", reason)

    async def stop(self) -> None:
        """Refuse new work, finish every queued request (bounded by the request timeout), stop the workers."""
        self.begin_drain()
        if self._warm_up is not None and not self._warm_up.done():
            self._warm_up.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._warm_up
        drained = True
        if self.batchers:
            drains = asyncio.gather(*(b.drain() for b in self.batchers.values()))
            try:
                await asyncio.wait_for(drains, timeout=self.settings.request_timeout_s)
            except asyncio.TimeoutError:
                drained = False
                log.error("draining took longer than %.0f s; failing what is left", self.settings.request_timeout_s)
            for b in self.batchers.values():
                await b.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        if self.pool is not None:
            await asyncio.to_thread(self.pool.shutdown)
        await asyncio.to_thread(self.cuda_memory.close_all)  # the clients' allocations, once no batch runs
        self.drained = drained
        log.info("stopped" if drained else "stopped; the drain was incomplete")
