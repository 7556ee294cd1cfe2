"""A timeline of the engine's batches: where the GPU idles and what the worker threads and the event loop did then.

Two parts, one file:

* Recording, inside the engine process. ``bench/serving/timeline_site`` on ``PYTHONPATH`` with ``DECONV_TIMELINE_DIR``
  set makes Python's start-up (its ``sitecustomize``) call ``install`` once ``service.engine.local`` is imported, in
  whichever process imports it (the engine process of a multi-process server, the only process of a single-process one).
  ``install`` wraps a few functions of ``service.engine.paths``, ``service.engine.worker``, ``service.engine.pool`` and
  ``service.engine.batcher`` so that each step of a batch leaves a timestamp (the thread's native id,
  ``time.time_ns``): on a worker thread ``start`` (the batch taken from its queue), ``call0``/``call1`` (around the
  extension call: ``conv_transpose2d_placed``, ``kernel_forward_gathered`` or ``kernel_forward_direct``; a CPU
  worker's ``kernel_forward``), ``end`` and ``settled`` (its future resolved); on the event loop ``packed`` (a batch
  formed) and ``done`` (its outputs back on the loop).
  After ``DECONV_TIMELINE_TRIGGER`` batches in a row (default 250; a pause of half a second starts the count again)
  torch.profiler (CUPTI) records ``DECONV_TIMELINE_SECONDS`` (default 1) of the GPU's kernels and copies and every
  thread's CUDA calls, and the steps of the same window go beside it: ``trace<k>.json`` and ``steps<k>.json`` in the
  directory's ``engine-<pid>`` (each server's engine its own), k = 0, 1, ... for each run of load. The profiler's first
  start takes seconds (it stalled the process mid-run once), so it is started and thrown away once at the first batch,
  normally a start-up warm-up.
* Reading, anywhere: ``python -m bench.serving.timeline DIR`` prints, for every recording under DIR, the GPU's busy
  share and how many things it ran at once, kernel and copy times, the idle gaps longer than 20 us by what preceded and
  followed them and what the thread of the next GPU work was doing when the gap began, each worker thread's step times
  and the event loop's hand-over times.

    PYTHONPATH=$PWD/bench/serving/timeline_site:$PYTHONPATH DECONV_TIMELINE_DIR=/tmp/timeline python -m service ...
    python -m bench.serving.timeline /tmp/timeline
    # under bench/device/sizes.sh's load (one recording a case, each after its first 250 batches):
    SERVER_ENV="PYTHONPATH=$PWD/bench/serving/timeline_site:$PYTHONPATH DECONV_TIMELINE_DIR=/tmp/timeline" \
        SIZES=gpu-16MiB CASES="on-cuda-shm on-shm" MAX_SECONDS=5 bash bench/device/sizes.sh

bench/NOTES.md ("Batches in a GPU's CUDA shared memory on one stream a GPU") shows what it found once. Not for
production: it slows each batch by a few microseconds while installed and by far more while the profiler runs.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import functools
import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger("deconv.timeline")

# The step after which a worker thread is in a state, by the step's name (the analysis's classes).
STATE_AFTER = {"start": "lease", "call0": "call", "call1": "after-call", "end": "settle", "settled": "idle"}
GAP_NS = 20_000  # idle gaps shorter than this are the GPU's own spacing between operations


class Recorder:
    """The steps of the batches and the profiler's schedule, in the process that runs the workers."""

    def __init__(self, out: Path, trigger: int, seconds: float) -> None:
        self.out = out
        self.trigger = trigger
        self.seconds = seconds
        self.steps: list[tuple[str, int, int]] = []  # (step, native thread id, time.time_ns)
        self._recording = False
        self._busy = False
        self._warmed = False
        self._count = 0
        self._last = 0.0
        self._index = 0

    def mark(self, step: str) -> None:
        if self._recording:
            self.steps.append((step, threading.get_native_id(), time.time_ns()))

    def batch(self) -> None:
        """A batch started: count it, and start the profiler when it is time."""
        now = time.monotonic()
        self._count = self._count + 1 if now - self._last < 0.5 else 1
        self._last = now
        if self._busy:
            return
        if not self._warmed or self._count == self.trigger:
            self._busy = True
            keep = self._warmed
            self._warmed = True
            threading.Thread(target=self._profile, args=(keep,), daemon=True, name="deconv-timeline").start()

    def _profile(self, keep: bool) -> None:
        from torch.profiler import ProfilerActivity, profile

        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                self.steps = []
                self._recording = keep
                t0 = time.time_ns()
                time.sleep(self.seconds if keep else 0.2)
                t1 = time.time_ns()
                self._recording = False
                steps = self.steps
            if keep:
                k = self._index
                self._index += 1
                self.out.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(self.out / f"trace{k}.json"))
                (self.out / f"steps{k}.json").write_text(json.dumps({"window_ns": [t0, t1], "steps": steps}))
                log.warning("timeline %d written to %s (%d steps)", k, self.out, len(steps))
        except Exception:
            log.exception("timeline: the profiler failed")
        finally:
            self._busy = False


def _around(fn: Callable[..., Any], before: Callable[[], None], after: Callable[[], None]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        before()
        try:
            return fn(*args, **kwargs)
        finally:
            after()
    return wrapped


def install(recorder: Recorder, paths: ModuleType, worker: ModuleType, pool: ModuleType, batcher: ModuleType) -> None:
    """Wrap the steps of a batch (module docstring) in ``service.engine.paths``, ``.worker``, ``.pool`` and
    ``.batcher``; call it before any ``Worker`` is made (they bind the extension calls when made)."""
    mark = recorder.mark
    for name in ("conv_transpose2d_placed", "kernel_forward_gathered", "kernel_forward_direct", "kernel_forward"):
        setattr(paths, name, _around(getattr(paths, name), lambda: mark("call0"), lambda: mark("call1")))
    outputs = worker.Worker._outputs

    @functools.wraps(outputs)
    def timed_outputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        recorder.batch()
        mark("start")
        try:
            return outputs(self, *args, **kwargs)
        finally:
            mark("end")
    worker.Worker._outputs = timed_outputs
    worker._settle = _around(worker._settle, lambda: None, lambda: mark("settled"))
    pack = batcher.Batcher._pack

    @functools.wraps(pack)
    def timed_pack(self: Any, *args: Any, **kwargs: Any) -> Any:
        batch = pack(self, *args, **kwargs)
        if batch:
            mark("packed")
        return batch
    batcher.Batcher._pack = timed_pack
    run = pool.WorkerPool.run

    @functools.wraps(run)
    async def timed_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await run(self, *args, **kwargs)
        finally:
            mark("done")
    pool.WorkerPool.run = timed_run


def install_from_env() -> Recorder | None:
    """``install`` as ``DECONV_TIMELINE_DIR`` (and ``_TRIGGER``, ``_SECONDS``) say; None when it is not set."""
    directory = os.environ.get("DECONV_TIMELINE_DIR")
    if not directory:
        return None
    from service.engine import batcher, paths, pool, worker

    out = Path(directory) / f"engine-{os.getpid()}"  # made at the first recording: only a process with batches
    recorder = Recorder(out, int(os.environ.get("DECONV_TIMELINE_TRIGGER", "250")),
                        float(os.environ.get("DECONV_TIMELINE_SECONDS", "1")))
    install(recorder, paths, worker, pool, batcher)
    log.warning("timeline: installed in pid %d; it records into %s once it runs batches", os.getpid(), out)
    return recorder


# --- reading ------------------------------------------------------------------------------------------------------


def _pct(ns: float, window: float) -> str:
    return f"{100 * ns / window:.1f}%"


def _median_us(values: list[int]) -> str:
    return f"{statistics.median(values) / 1e3:.0f} us" if values else "-"


def analyze(trace: dict[str, Any], recorded: dict[str, Any], margin_ns: int = 100_000_000) -> list[str]:
    """The summary lines of one recording (module docstring); ``margin_ns`` of each end of the window left out."""
    base = int(trace.get("baseTimeNanoseconds", 0))
    gpu: list[tuple[int, int, str, Any, Any]] = []  # start, end, name, stream, correlation
    calls: dict[Any, list[tuple[int, int, str]]] = collections.defaultdict(list)  # by the profiler's thread id
    caller: dict[Any, Any] = {}  # correlation -> the profiler's thread id of the CUDA call that queued it
    for e in trace.get("traceEvents", []):
        if "ts" not in e or "dur" not in e:
            continue
        start = base + int(float(e["ts"]) * 1000)
        end = start + int(float(e["dur"]) * 1000)
        cat, corr = e.get("cat"), (e.get("args") or {}).get("correlation")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu.append((start, end, str(e.get("name", "")), e.get("tid"), corr))
        elif cat in ("cuda_runtime", "cuda_driver"):
            calls[e.get("tid")].append((start, end, str(e.get("name", ""))))
            if corr is not None:
                caller[corr] = e.get("tid")
    by_thread: dict[int, list[tuple[int, str]]] = collections.defaultdict(list)
    for step, tid, ns in recorded["steps"]:
        by_thread[tid].append((ns, step))
    for steps in by_thread.values():
        steps.sort()
    # The profiler names threads its own way: a worker thread is the one whose waits end just before its call1s.
    native: dict[Any, int] = {}
    for ptid, evs in calls.items():
        ends = sorted(end for _, end, name in evs if name in ("cudaStreamSynchronize", "cudaEventSynchronize"))
        best: tuple[float, int] | None = None
        for tid, steps in by_thread.items():
            lags = [ns - ends[i] for ns, step in steps if step == "call1"
                    for i in [bisect.bisect_right(ends, ns) - 1] if i >= 0]
            if lags and (best is None or statistics.median(lags) < best[0]):
                best = (statistics.median(lags), tid)
        if best is not None:
            native[ptid] = best[1]
    t0, t1 = recorded["window_ns"][0] + margin_ns, recorded["window_ns"][1] - margin_ns
    window = t1 - t0
    if window <= 0:
        return ["window too short to read"]
    workers = sorted(tid for tid, steps in by_thread.items() if any(step == "start" for _, step in steps))
    lines = [f"window {window / 1e6:.0f} ms; {len(gpu)} GPU operations; worker threads {workers}"]
    ops = sorted(g for g in gpu if g[1] > t0 and g[0] < t1)
    level, last, share = 0, t0, collections.Counter()
    for x, d in sorted([(max(s, t0), 1) for s, *_ in ops] + [(min(e, t1), -1) for _, e, *_ in ops]):
        share[level] += x - last
        level += d
        last = x
    share[level] += t1 - last
    lines.append("GPU running 0 / 1 / 2+ things at once: " + " / ".join(
        _pct(share[k] if k < 2 else sum(v for j, v in share.items() if j >= 2), window) for k in range(3)))
    kinds: dict[str, list[int]] = collections.defaultdict(list)
    for s, e, name, *_ in ops:
        kinds[name[:70]].append(e - s)
    for name, d in sorted(kinds.items(), key=lambda kv: -sum(kv[1]))[:6]:
        lines.append(f"  {name:70} n {len(d):5}  median {_median_us(d):>9}  {_pct(sum(d), window)} of the window")

    def state(tid: int, ns: int) -> str:
        steps = by_thread.get(tid, [])
        i = bisect.bisect_right(steps, (ns, "~")) - 1
        return STATE_AFTER.get(steps[i][1], steps[i][1]) if i >= 0 else "?"
    gaps: collections.Counter[tuple[str, str, str]] = collections.Counter()
    count: collections.Counter[tuple[str, str, str]] = collections.Counter()
    idle, cur, prev = 0, t0, None
    for op in ops:
        if op[0] > cur:
            idle += op[0] - cur
        if prev is not None and op[0] - cur > GAP_NS:
            nxt = native.get(caller.get(op[4]))
            same = "same thread" if nxt == native.get(caller.get(prev[4])) else "other thread"
            key = (f"{prev[2][:16]} -> {op[2][:16]}", same, state(nxt, cur) if nxt is not None else "?")
            gaps[key] += op[0] - cur
            count[key] += 1
        if op[1] > cur:
            cur, prev = op[1], op
    idle += max(0, t1 - cur)
    lines.append(f"GPU idle {_pct(idle, window)}; gaps over {GAP_NS // 1000} us by (before -> after, the thread of the "
                 "next work, its state when the gap began):")
    for key, ns in gaps.most_common(8):
        lines.append(f"  {key[0]:36} {key[1]:12} {key[2]:10} {_pct(ns, window):>6} in {count[key]} gaps")
    for tid in workers:
        spans: dict[str, list[int]] = collections.defaultdict(list)
        seen: dict[str, int] = {}
        for ns, step in by_thread[tid]:
            for a, b in (("start", "call0"), ("call0", "call1"), ("call1", "settled"), ("settled", "start")):
                if step == b and a in seen and t0 <= ns <= t1:
                    spans[f"{a}->{b}"].append(ns - seen[a])
            seen[step] = ns
        lines.append(f"worker thread {tid}: " + ", ".join(f"{k} {_median_us(v)}" for k, v in spans.items()))
    ordered = sorted((ns, step) for steps in by_thread.values() for ns, step in steps if t0 <= ns <= t1)
    handover: dict[str, list[int]] = collections.defaultdict(list)
    for i, (ns, step) in enumerate(ordered):
        nxt = {"settled": "done", "done": "packed", "packed": "start"}.get(step)
        if nxt is not None:
            later = next((n for n, s in ordered[i + 1:] if s == nxt), None)
            if later is not None:
                handover[f"{step}->{nxt}"].append(later - ns)
    lines.append("hand-over: " + ", ".join(f"{k} {_median_us(v)}" for k, v in handover.items()))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path, help="the DECONV_TIMELINE_DIR of the recordings (or one engine's folder)")
    args = p.parse_args()
    traces = sorted(args.directory.rglob("trace*.json"))
    if not traces:
        p.error(f"no trace<k>.json under {args.directory}")
    for path in traces:
        steps = path.with_name("steps" + path.name.removeprefix("trace"))
        print(f"== {path.relative_to(args.directory)}")
        print("\n".join(analyze(json.loads(path.read_text()), json.loads(steps.read_text()))))


if __name__ == "__main__":
    main()
