"""The pool of workers: which devices serve (``select_devices``), which worker gets the next batch, and the checks
every worker passes before the server is ready (``WorkerPool.self_test``, ``WorkerPool.warm_up``).

``WorkerPool`` hands each batch to the least busy worker (fewest samples in flight) that has room for another
batch (a *reservation*: ``acquire``, given back when the batch is done), and restarts a worker whose batch runs
past ``worker_timeout_s`` (``watch``, the watchdog; the restart itself is ``service.engine.worker.Worker.restart``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from service.engine.kinds import Kind, Output, Request
from service.engine.paths import sample_count
from service.engine.registry import Layer
from service.engine.worker import Worker
from service.errors import InternalError
from service.metrics import Metrics

log = logging.getLogger("deconv.service")

# Batches one worker holds at once: one executing and one waiting in its thread's queue, so that the thread need
# not idle for an event-loop round trip between batches. A layer's batcher packs late (service.engine.batcher) and keeps
# at most one of its batches per worker; the second place serves other layers and layers of one-sample batches.
MAX_INFLIGHT_BATCHES = 2

# Default longest execution of one batch before its worker thread counts as stalled (Settings.worker_timeout_s).
WORKER_TIMEOUT_S = 120.0


def batch_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes ``serving_choice`` measures at: powers of two below the max batch, and the max batch."""
    out = [1 << i for i in range(max_batch_size.bit_length()) if 1 << i < max_batch_size]
    return [*out, max_batch_size]


def relative_error(y: torch.Tensor, y_ref: torch.Tensor) -> float:
    """Norm-wise relative error ``||y - y_ref|| / ||y_ref||`` in float64."""
    y, y_ref = y.double().cpu(), y_ref.double().cpu()
    denom = float(torch.linalg.vector_norm(y_ref))
    diff = float(torch.linalg.vector_norm(y - y_ref))
    return diff / denom if denom > 0 else diff


class WorkerPool:
    """The workers, and which of them gets the next batch."""

    def __init__(self, workers: list[Worker], metrics: Metrics | None = None,
                 max_inflight_batches: int = MAX_INFLIGHT_BATCHES, worker_timeout_s: float = WORKER_TIMEOUT_S) -> None:
        if not workers:
            raise ValueError("a worker pool needs at least one worker")
        self.workers = workers
        self.metrics = metrics
        self.max_inflight_batches = max_inflight_batches
        self.worker_timeout_s = worker_timeout_s
        self._freed: asyncio.Event | None = None

    @property
    def parallelism(self) -> int:
        """Batches executing at once when every worker is busy: one per worker."""
        return len(self.workers)

    @property
    def devices(self) -> int:
        """Batches executing at once with one on each device: the devices the workers run on."""
        return len({w.device for w in self.workers})

    def load(self, layer: Layer) -> None:
        """Put the layer's weights on every worker (blocking: call it off the loop). The first call gives the workers
        of each GPU one stream for the batches in its CUDA shared memory (``Worker.gpu_stream``)."""
        streams: dict[torch.device, torch.cuda.Stream] = {}
        for w in self.workers:
            if w.is_cuda and w.gpu_stream is None:
                if w.device not in streams:
                    streams[w.device] = torch.cuda.Stream(w.device)
                w.gpu_stream = streams[w.device]
        for w in self.workers:
            w.load(layer)

    async def acquire(self, device: int | None = None) -> Worker:
        """Wait for a worker with room for another batch and reserve it: on the device with the fewest samples in
        flight, the worker there with the fewest (with ``device``, among the workers of that GPU: a batch in its CUDA
        shared memory)."""
        if self._freed is None:
            self._freed = asyncio.Event()
        candidates = self.workers
        if device is not None:
            candidates = [w for w in self.workers if w.is_cuda and w.device.index == device] or self.workers
        while True:
            free = [w for w in candidates if w.inflight_batches < self.max_inflight_batches]
            if free:
                on_device: dict[torch.device, int] = {}
                for w in self.workers:
                    on_device[w.device] = on_device.get(w.device, 0) + w.inflight_samples
                worker = min(free, key=lambda w: (on_device[w.device], w.inflight_samples, w.inflight_batches))
                worker.inflight_batches += 1
                return worker
            self._freed.clear()
            await self._freed.wait()

    def release(self, worker: Worker) -> None:
        """Give back a reservation made with ``acquire`` (after its batch finished, or when it was not used)."""
        worker.inflight_batches -= 1
        if self._freed is not None:
            self._freed.set()

    async def run(self, worker: Worker, layer: Layer, inputs: Sequence[Request],
                  kind: Kind = Kind.HOST) -> list[Output]:
        """Execute a batch of ``kind`` on ``worker`` (reserved with ``acquire``; released here) off the event loop:
        one answer per input."""
        n = sample_count(inputs)
        worker.inflight_samples += n
        self._report(worker)
        try:
            return await asyncio.wrap_future(worker.submit(layer, inputs, kind))
        finally:
            worker.inflight_samples -= n
            self._report(worker)
            self.release(worker)

    def _report(self, worker: Worker) -> None:
        if self.metrics is not None:
            self.metrics.worker_inflight.labels(worker.name).set(worker.inflight_samples)

    async def self_test(self, layer: Layer, seed: int = 0) -> list[str]:
        """Run ``layer`` on a small random input on every worker; compare with float64 on the CPU.

        Returns one problem line per worker whose norm-wise relative error exceeds the layer's tolerance.
        """
        c = layer.config
        g = torch.Generator().manual_seed(seed)
        h, w = min(7, c.max_height), min(5, c.max_width)
        x = torch.randn(2, c.in_channels, h, w, generator=g, dtype=torch.float64).to(layer.dtype)
        y_ref = F.conv_transpose2d(x.double(), layer.weight.double(),
                                   None if layer.bias is None else layer.bias.double(),
                                   c.stride, c.padding, c.output_padding, c.groups, c.dilation)
        problems = []
        for worker in self.workers:
            t0 = time.perf_counter()
            reserved = await self.acquire_specific(worker)
            try:
                (y,) = await self.run(reserved, layer, [x])
            except InternalError as exc:
                problems.append(f"layer {layer.name!r} on {worker.name}: {exc.message}")
                continue
            assert isinstance(y, torch.Tensor)  # a batch of one torch tensor: answered with a slice of the output
            err = relative_error(y, y_ref)
            ok = bool(torch.isfinite(y).all()) and err <= layer.tolerance
            log.info("self-test %s on %s: relative error %.2e (tolerance %.0e) %s in %.0f ms", layer.name,
                     worker.name, err, layer.tolerance, "ok" if ok else "FAILED", 1e3 * (time.perf_counter() - t0))
            if not ok:
                problems.append(f"layer {layer.name!r} on {worker.name}: relative error {err:.2e} exceeds "
                                f"{layer.tolerance:.0e} ({c.dtype}, precision {c.precision})")
        return problems

    async def warm_up(self, layer: Layer, seed: int = 1) -> int:
        """Run random batches of each of the layer's ``warm_shapes`` at every batch-size bucket (``batch_buckets``)
        on every worker, so that the kernels are loaded and, with measured choice on, measured before the first
        request of that size. Buckets whose output would pass twice the layer's max batch bytes (the batcher never
        builds them) are skipped. Returns the batches run.

        Raises:
            InternalError: a batch failed (the server log has the details).
        """
        c = layer.config
        g = torch.Generator().manual_seed(seed)
        runs = 0
        for h, w in c.warm_shapes:
            h_out, w_out = layer.output_hw(h, w)
            sample_bytes = c.out_channels * h_out * w_out * layer.dtype.itemsize
            for n in batch_buckets(layer.limits.max_batch_size):
                if n > 1 and n * sample_bytes > 2 * layer.limits.max_batch_bytes:
                    break
                x = torch.randn(n, c.in_channels, h, w, generator=g).to(layer.dtype)
                for worker in self.workers:
                    reserved = await self.acquire_specific(worker)
                    await self.run(reserved, layer, [x])
                    runs += 1
        return runs

    async def acquire_specific(self, worker: Worker) -> Worker:
        """Reserve room for a batch on this particular worker (self-tests check every device)."""
        if self._freed is None:
            self._freed = asyncio.Event()
        while worker.inflight_batches >= self.max_inflight_batches:
            self._freed.clear()
            await self._freed.wait()
        worker.inflight_batches += 1
        return worker

    async def watch(self, period_s: float | None = None) -> None:
        """Restart every worker whose batch runs past ``worker_timeout_s`` or whose thread is gone (run as a task).

        A thread that dies restarts itself at once; this catches the ones that hang.
        """
        period = period_s if period_s is not None else min(1.0, self.worker_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            for worker in self.workers:
                if worker.stalled(self.worker_timeout_s):
                    worker.restart("stalled")

    def shutdown(self) -> None:
        """Stop every worker thread."""
        for w in self.workers:
            w.shutdown()


def select_devices(spec: str | list[int]) -> tuple[list[torch.device], str]:
    """Devices for ``Settings.devices`` (already parsed) and a sentence saying which backend runs and why.

    Raises:
        RuntimeError: GPUs were asked for ("all" or indices) but are not visible.
    """
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec == "cpu":
        return [torch.device("cpu")], "devices=cpu: serving on CPU with the PyTorch reference"
    if spec == "auto":
        if available == 0:
            return [torch.device("cpu")], "no CUDA device visible: serving on CPU with the PyTorch reference"
        devs = [torch.device("cuda", i) for i in range(available)]
        return devs, f"serving on {available} GPU(s) with the deconv CUDA kernels: {_names(devs)}"
    if available == 0:
        raise RuntimeError(f"devices={spec!r} asks for GPUs but no CUDA device is visible "
                           "(set DECONV_DEVICES=auto or cpu to serve on the CPU)")
    indices = list(range(available)) if spec == "all" else list(spec)
    missing = [i for i in indices if i >= available]
    if missing:
        raise RuntimeError(f"devices asks for GPU(s) {missing} but only {available} are visible")
    devs = [torch.device("cuda", i) for i in indices]
    return devs, f"serving on {len(devs)} GPU(s) with the deconv CUDA kernels: {_names(devs)}"


def _names(devs: list[torch.device]) -> str:
    return ", ".join(f"{d} ({torch.cuda.get_device_name(d)})" for d in devs)
