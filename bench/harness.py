"""What the benchmarks share: GPU timing with a cold L2 (flushed before each timed call) or a warm one (calls back to
back), the relative error against a float64 reference, the device's name in file names, and the JSON result files.

A cold call's events time the GPU, not the host: the flush (a write of at least twice the L2 size) and a sleep of
``kernels.tuning.HOST_SLACK_CYCLES`` are queued before its start event, so that the call's launches are queued before
the GPU reaches them (bench/NOTES.md v12).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from kernels.tuning import HOST_SLACK_CYCLES

WARM_CALLS = 50  # calls back to back between the two events of ``warm_us``
COLD_CALLS = 21  # timed calls of ``ColdTimer``, each after a flush


def flushed_ms(fn: Callable[[], object], reps: int, flush: torch.Tensor, value: int) -> list[float]:
    """The GPU time of ``reps`` calls of ``fn`` in ms, each after ``flush`` is filled with ``value`` and a host-slack
    sleep, queued before one wait."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.fill_(value)
        torch.cuda._sleep(HOST_SLACK_CYCLES)
        start.record()
        fn()
        end.record()
    events[-1][1].synchronize()
    return [start.elapsed_time(end) for start, end in events]


class Timer:
    """CUDA-event timing of GPU time with an L2 flush before every run; returns the median in ms."""

    def __init__(self, reps: int, warmup: int) -> None:
        self.reps, self.warmup = reps, warmup
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        self.flush_buf = torch.empty(max(2 * l2, 64 << 20), dtype=torch.uint8, device="cuda")

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(self.reps):
            self.flush_buf.zero_()
            # Host dispatch stays out of the window (kernels.tuning.HOST_SLACK_CYCLES; bench/NOTES.md v12).
            torch.cuda._sleep(HOST_SLACK_CYCLES)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


class AdaptiveTimer(Timer):
    """``Timer`` (L2 flush and host-slack sleep before each call, CUDA events, median), with the repetitions set by
    time: one warm-up call, one probe call, then calls until ``target_ms`` of GPU time (at least ``min_reps``, at most
    ``max_reps``), queued before one wait as the tuner's timer does."""

    def __init__(self, target_ms: float, min_reps: int, max_reps: int) -> None:
        super().__init__(reps=max_reps, warmup=1)
        self.target_ms, self.min_reps, self.max_reps = target_ms, min_reps, max_reps

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        probe = flushed_ms(fn, 1, self.flush_buf, 0)[0]
        reps = max(self.min_reps, min(self.max_reps, math.ceil(self.target_ms / max(probe, 1e-3))))
        return statistics.median(flushed_ms(fn, reps, self.flush_buf, 0))


class ColdTimer:
    """The median GPU time in us of one call after an L2 flush (twice the L2 written) and a host-slack sleep, over
    ``COLD_CALLS`` calls: a layer inside a model meets cold weights."""

    def __init__(self) -> None:
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        self.flush = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")

    def __call__(self, fn: Callable[[], object]) -> float:
        fn()
        return statistics.median(flushed_ms(fn, COLD_CALLS, self.flush, 1)) * 1e3


def warm_us(fn: Callable[[], object]) -> float:
    """Microseconds a call when ``WARM_CALLS`` calls run back to back (host and GPU overlapping): what a layer costs
    when it is host-bound or its data stays in L2."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(WARM_CALLS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / WARM_CALLS


def cudnn_benchmark(timer: Callable[[Callable[[], object]], float], fn: Callable[[], object]) -> float:
    """``fn``'s time by ``timer`` with ``torch.backends.cudnn.benchmark`` on (its first call, untimed, searches
    cuDNN's algorithms)."""
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        fn()
        return timer(fn)
    finally:
        torch.backends.cudnn.benchmark = old


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error of ``y`` against the float64 ``ref``; infinite when ``y`` holds a non-finite value."""
    y64 = y.double()
    if not torch.isfinite(y64).all():
        return float("inf")
    return ((y64 - ref).norm() / ref.norm()).item()


def device_slug(device: str) -> str:
    """A device name as a file-name part: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")


def short_slug(device: str) -> str:
    """The device for file names: "NVIDIA H100 80GB HBM3" -> "nvidia-h100" (the full slug when it is no
    NVIDIA <letter><digits> name)."""
    slug = device_slug(device)
    m = re.match(r"nvidia-[a-z]+\d+", slug)
    return m.group(0) if m else slug


def write(path: Path, doc: dict, indent: int = 1) -> None:
    """``doc`` as JSON at ``path`` (its folder made first), replacing the file at once: a reader never sees half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=indent) + "\n")
    tmp.replace(path)
