"""bench/serving/timeline.py: the steps it records around a batch (on the CPU worker), its start-up hook, and its
reading of a GPU trace (a made-up one: the gaps, who was doing what, the hand-over)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from bench.serving import timeline as timeline_module
from service.config import DEFAULT_LAYER_REPOSITORY
from service.engine import batcher as batcher_module
from service.engine import paths as paths_module
from service.engine import pool as pool_module
from service.engine import worker as worker_module
from service.engine.batcher import Batcher
from service.engine.registry import BatchLimits, load_repository

from ...service.conftest import run

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def timeline() -> ModuleType:
    return timeline_module


def test_recording_marks_every_step_of_each_batch(timeline: ModuleType, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("conv_transpose2d_placed", "kernel_forward_gathered", "kernel_forward_direct", "kernel_forward"):
        monkeypatch.setattr(paths_module, name, getattr(paths_module, name))  # put back after the test
    monkeypatch.setattr(worker_module, "_settle", worker_module._settle)
    monkeypatch.setattr(worker_module.Worker, "_outputs", worker_module.Worker._outputs)
    monkeypatch.setattr(pool_module.WorkerPool, "run", pool_module.WorkerPool.run)
    monkeypatch.setattr(batcher_module.Batcher, "_pack", batcher_module.Batcher._pack)
    recorder = timeline.Recorder(tmp_path, trigger=10**9, seconds=1.0)
    recorder._warmed = True  # no profiler here: the steps alone
    recorder._recording = True
    timeline.install(recorder, paths_module, worker_module, pool_module, batcher_module)
    layer = load_repository(DEFAULT_LAYER_REPOSITORY, BatchLimits(4, 1 << 28, 0.0, 64)).get("demo")

    async def main() -> None:
        pool = pool_module.WorkerPool([worker_module.Worker(torch.device("cpu"))])
        pool.load(layer)
        batcher = Batcher(layer, pool)
        batcher.start()
        items = [batcher.submit(torch.randn(1, layer.config.in_channels, 6, 6)) for _ in range(6)]
        for item in items:
            await item.future
        await batcher.close()
        pool.shutdown()

    run(main(), 60)
    threads: dict[int, list[str]] = {}
    for step, tid, _ns in recorder.steps:
        threads.setdefault(tid, []).append(step)
    worker = [steps for steps in threads.values() if "start" in steps]
    loop = [steps for steps in threads.values() if "packed" in steps]
    assert len(worker) == 1
    assert len(loop) == 1
    batches = worker[0].count("start")
    assert batches >= 2  # six requests, at most four a batch
    assert worker[0] == ["start", "call0", "call1", "end", "settled"] * batches
    assert loop[0].count("packed") == loop[0].count("done") == batches


def test_start_up_hook_installs_only_when_asked(tmp_path: Path) -> None:
    code = ("import sys, service.engine.local as _, service.engine.worker as w; "
            "print('deconv_bench_timeline' in sys.modules, hasattr(w.Worker._outputs, '__wrapped__'))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "bench" / "serving" / "timeline_site"), str(ROOT)])}
    env.pop("DECONV_TIMELINE_DIR", None)
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert off.returncode == 0, off.stderr[-2000:]
    assert off.stdout.split() == ["False", "False"]
    env["DECONV_TIMELINE_DIR"] = str(tmp_path / "timeline")
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert on.returncode == 0, on.stderr[-2000:]
    assert on.stdout.split() == ["True", "True"]
    assert not (tmp_path / "timeline").exists()  # a folder only for a process that records batches


def _op(cat: str, name: str, start_us: float, dur_us: float, stream: int, corr: int) -> dict:
    return {"cat": cat, "name": name, "ts": start_us, "dur": dur_us, "tid": stream, "args": {"correlation": corr}}


def _call(name: str, start_us: float, dur_us: float, thread: int, corr: int | None = None) -> dict:
    return {"cat": "cuda_runtime", "name": name, "ts": start_us, "dur": dur_us, "tid": thread,
            "args": {} if corr is None else {"correlation": corr}}


def test_reading_names_the_gap_and_what_the_next_thread_was_doing(timeline: ModuleType) -> None:
    """Two worker threads (profiler ids 7 and 8, native 100 and 200): thread 100's kernel 100-1100 us, its copy
    1100-1110, then 500 us of nothing while thread 200 (idle since 0) gets its batch, its kernel 1610-2610."""
    trace = {"baseTimeNanoseconds": 0, "traceEvents": [
        _call("cudaLaunchKernel", 90, 5, 7, 1), _op("kernel", "conv_kernel_a", 100, 1000, 13, 1),
        _call("cudaMemcpyAsync", 95, 3, 7, 2), _op("gpu_memcpy", "Memcpy DtoD", 1100, 10, 13, 2),
        _call("cudaStreamSynchronize", 98, 1020, 7),
        _call("cudaLaunchKernel", 1600, 5, 8, 3), _op("kernel", "conv_kernel_b", 1610, 1000, 17, 3),
        _call("cudaStreamSynchronize", 1606, 1010, 8),
    ]}
    us = 1000
    steps = [("settled", 200, 0), ("start", 100, 50 * us), ("call0", 100, 80 * us), ("call1", 100, 1150 * us),
             ("end", 100, 1160 * us), ("settled", 100, 1170 * us), ("done", 1, 1250 * us),
             ("packed", 1, 1300 * us), ("start", 200, 1400 * us), ("call0", 200, 1590 * us),
             ("call1", 200, 2650 * us), ("end", 200, 2660 * us), ("settled", 200, 2670 * us)]
    lines = timeline.analyze(trace, {"window_ns": [10 * us, 3010 * us], "steps": steps}, margin_ns=0)
    text = "\n".join(lines)
    assert "worker threads [100, 200]" in lines[0]
    # kernels and the copy: 2010 of the window's 3000 us busy, never two at once
    assert lines[1] == "GPU running 0 / 1 / 2+ things at once: 33.0% / 67.0% / 0.0%"
    assert "GPU idle 33.0%" in text
    gap = next(line for line in lines if "Memcpy DtoD -> conv_kernel_b" in line)
    assert gap.split()[4:] == ["other", "thread", "idle", "16.7%", "in", "1", "gaps"]
    assert "worker thread 100: start->call0 30 us, call0->call1 1070 us, call1->settled 20 us" in text
    assert "hand-over: settled->done 80 us, done->packed 50 us, packed->start 100 us" in text
