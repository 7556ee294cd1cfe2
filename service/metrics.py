"""Prometheus metrics of one app, in a registry of its own (several apps in one process do not clash).

Served at ``GET /metrics``; every name is listed in docs/operations.md.

A multi-process server (``DECONV_HTTP_PROCESSES`` > 1) runs prometheus-client's multiprocess mode: the supervisor
sets ``PROMETHEUS_MULTIPROC_DIR`` for every process it starts, each process writes its series there, and
``/metrics`` in any HTTP process reports the sum over all of them (gauges as the ``multiprocess_mode`` below says).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    generate_latest,
    values,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

# Set by the supervisor of a multi-process server before it starts the processes (prometheus-client reads it).
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess() -> bool:
    """Whether this process reports through prometheus-client's multiprocess mode."""
    return bool(os.environ.get(MULTIPROCESS_ENV))


# Multiprocess mode asks for the process id on every update, to notice a fork (a child writes its own file). That
# is a system call per update, several per request (~3% of an HTTP process's CPU). The same id, kept up to date
# across forks by os.register_at_fork instead.
_pid = os.getpid()


def _refresh_pid() -> None:
    global _pid
    _pid = os.getpid()


def process_id() -> int:
    """This process's id as of its last fork."""
    return _pid


os.register_at_fork(after_in_child=_refresh_pid)
if multiprocess():  # before any metric exists: prometheus-client reads ValueClass when one is made
    values.ValueClass = values.MultiProcessValue(process_id)


def update_lock() -> AbstractContextManager[Any] | None:
    """The lock prometheus-client holds while it creates or updates any metric of this process in multiprocess mode
    (one for all of them, not reentrant, kept in a closure of its value class); None in single-process mode.

    Only the test-mode start-up hold takes it (``service.faults``), to stand where a signal can interrupt a metric
    update."""
    if not getattr(values.ValueClass, "_multiprocess", False):
        return None
    for cell in values.ValueClass.set.__closure__ or ():
        lock = cell.cell_contents
        if hasattr(lock, "acquire") and hasattr(lock, "release") and not isinstance(lock, type):
            return lock  # type: ignore[no-any-return]
    return None

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """Every metric of the service. Label ``layer`` is a configured layer name or ``"unknown"``."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "deconv_requests", "Inference requests answered, by layer, API and HTTP status.",
            ["layer", "api", "status"], registry=r)
        self.latency = Histogram(
            "deconv_request_latency_seconds", "Time from receipt to response of successful inference requests.",
            ["layer"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(
            "deconv_queue_time_seconds", "Time a request waited in its layer's queue before its batch ran.",
            ["layer"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_time = Histogram(
            "deconv_batch_seconds", "Time from a batch's start to its outputs: waiting for a busy worker thread, "
            "staging, the kernel and the copies.", ["layer"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(
            "deconv_batch_size", "Samples per kernel call.", ["layer"], buckets=BATCH_BUCKETS, registry=r)
        self.batch_requests = Histogram(
            "deconv_batch_requests", "Requests per kernel call.", ["layer"], buckets=BATCH_BUCKETS, registry=r)
        self.failed_time = Counter(
            "deconv_failed_request_seconds", "Time from receipt to response of failed inference requests (answered "
            "with a status other than 200), summed.", ["layer"], registry=r)
        self.batch_compute = Summary(
            "deconv_batch_compute_seconds", "Batches executed and their time (as deconv_batch_seconds), by layer and "
            "samples in the batch (at most the layer's max_batch_size series).", ["layer", "batch_size"], registry=r)
        self.request_compute = Counter(
            "deconv_request_compute_seconds", "Each executed batch's time once for every request in it, summed.",
            ["layer"], registry=r)
        self.computed_requests = Counter(
            "deconv_computed_requests", "Requests in executed batches.", ["layer"], registry=r)
        self.last_inference = Gauge(
            "deconv_last_inference_timestamp_seconds", "When the layer's last executed batch finished (Unix time).",
            ["layer"], registry=r, multiprocess_mode="max")
        self.queue_depth = Gauge(
            "deconv_queue_depth", "Requests waiting in the layer's queue.", ["layer"], registry=r,
            multiprocess_mode="livesum")
        self.dropped = Counter(
            "deconv_requests_dropped",
            "Queued requests dropped before execution: client disconnected or cancelled, or deadline passed.",
            ["layer", "reason"], registry=r)
        self.worker_batches = Counter(
            "deconv_worker_batches", "Batches executed, by worker.", ["worker"], registry=r)
        self.worker_direct_batches = Counter(
            "deconv_worker_direct_batches", "Batches a GPU worker took from and put into page-locked shared "
            "memory in one call (multi-process server: requests in their slots), by worker.", ["worker"],
            registry=r)
        self.worker_busy = Gauge(
            "deconv_worker_busy", "1 while the worker executes a batch.", ["worker"], registry=r,
            multiprocess_mode="livesum")
        self.worker_inflight = Gauge(
            "deconv_worker_inflight_samples", "Samples handed to the worker and not finished.", ["worker"],
            registry=r, multiprocess_mode="livesum")
        self.worker_failures = Counter(
            "deconv_worker_failures",
            "Batch failures by worker and kind: 'oom_retry' (split in halves and retried), 'oom', 'error'.",
            ["worker", "kind"], registry=r)
        self.worker_restarts = Counter(
            "deconv_worker_restarts",
            "Worker threads replaced, by worker and reason: 'died' (the thread ended), 'stalled' (a batch ran "
            "longer than the worker timeout).", ["worker", "reason"], registry=r)
        self.gpu_memory = Gauge(
            "deconv_gpu_memory_bytes", "GPU memory held by PyTorch's allocator, by device and kind.",
            ["device", "kind"], registry=r, multiprocess_mode="livesum")
        self.http_processes = Gauge(
            "deconv_http_processes", "Processes serving HTTP: 1 in a single-process server; in a multi-process "
            "server, the HTTP processes connected to the engine.", registry=r, multiprocess_mode="livesum")
        self.ipc_requests = Counter(
            "deconv_ipc_requests", "Multi-process server: requests an HTTP process sent to the engine, by the way "
            "their tensors went: 'shared' (the HTTP process's shared memory), 'inline' (the engine socket) or "
            "'cuda' (a client's CUDA shared memory, named in the request).",
            ["path"], registry=r)
        self.inflight_bytes = Gauge(
            "deconv_inflight_bytes", "Bytes of inference requests in flight: bodies being read, requests queued or "
            "executing, answers being written (DECONV_MAX_INFLIGHT_BYTES bounds it).", registry=r,
            multiprocess_mode="livesum")
        self.inflight_limit = Gauge(
            "deconv_inflight_limit_bytes", "The bound on deconv_inflight_bytes (over every HTTP process).",
            registry=r, multiprocess_mode="livesum")
        self.inflight_refused = Counter(
            "deconv_inflight_refused", "Inference requests answered 429 because the bytes in flight would exceed "
            "the bound.", registry=r)
        # Multi-process: 1 only while every process (the engine and each HTTP process) says 1.
        self.ready = Gauge("deconv_ready", "1 once every layer passed its self-test and while not draining.",
                           registry=r, multiprocess_mode="livemin")
        self._exposed = r
        if multiprocess():
            # auto_describe off: registering would otherwise collect at once, reading every process's file, and
            # a process starting beside one that has just created its (still empty) file would fail on it.
            self._exposed = CollectorRegistry(auto_describe=False)
            MultiProcessCollector(self._exposed)
        self._gpus: list[int] = []
        # Series of answered requests by (layer, api, status): labels() costs more than the update itself.
        self._answered: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        # Series of executed batches by (layer, samples), and by layer.
        self._executed: dict[tuple[str, int], Any] = {}
        self._computed: dict[str, tuple[Any, Any, Any]] = {}

    def count_request(self, layer: str, api: str, status: int, latency_s: float) -> None:
        """Count one answered inference request; successful ones (200) also go into the latency histogram."""
        series = self._answered.get((layer, api, status))
        if series is None:
            series = (self.requests.labels(layer, api, str(status)), self.latency.labels(layer))
            self._answered[(layer, api, status)] = series
        series[0].inc()
        if status == 200:
            series[1].observe(latency_s)
        else:
            self.failed_time.labels(layer).inc(latency_s)

    def count_batch(self, layer: str, samples: int, requests: int, seconds: float) -> None:
        """Count one executed batch of ``samples`` samples in ``requests`` requests that took ``seconds`` (the
        series of the KServe statistics, ``service.engine.kserve``)."""
        batch = self._executed.get((layer, samples))
        if batch is None:
            batch = self._executed[(layer, samples)] = self.batch_compute.labels(layer, str(samples))
        batch.observe(seconds)
        per_layer = self._computed.get(layer)
        if per_layer is None:
            per_layer = self._computed[layer] = (self.request_compute.labels(layer),
                                                 self.computed_requests.labels(layer),
                                                 self.last_inference.labels(layer))
        per_layer[0].inc(seconds * requests)
        per_layer[1].inc(requests)
        per_layer[2].set(time.time())

    def collect(self) -> Iterator[Metric]:
        """Every metric family as ``/metrics`` reports it: in a multi-process server, summed over every process
        (the engine's and each HTTP process's series)."""
        yield from self._exposed.collect()

    def watch_gpus(self, indices: list[int]) -> None:
        """Report memory of these CUDA devices at every scrape."""
        self._gpus = list(indices)

    def sample_gpus(self) -> None:
        """Read the watched devices' memory into ``gpu_memory`` now."""
        for i in self._gpus:
            self.gpu_memory.labels(f"cuda:{i}", "allocated").set(torch.cuda.memory_allocated(i))
            self.gpu_memory.labels(f"cuda:{i}", "reserved").set(torch.cuda.memory_reserved(i))

    def render(self) -> bytes:
        """The Prometheus text exposition, with GPU memory read now (every process's series when multi-process;
        there the engine process samples GPU memory once a second)."""
        self.sample_gpus()
        return generate_latest(self._exposed)
