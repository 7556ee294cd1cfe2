"""What one batch costs the GPU worker outside the server: the engine's path for n one-sample requests whose tensors
sit in shared-memory slots, step by step, with no event loop and no other load.

    python -m bench.serving.batch_costs --layer demo --sizes 1,2,4,8,16,32,64

For each batch size n (median microseconds over ``--reps`` calls, after a warm-up):

- ``gathered``: ``kernel_forward_gathered``, the extension call (inputs copied from the slots into pinned staging
  memory, upload, kernels, download into pinned memory, wait) with its Python checks and the kernel choice;
- ``batch``: ``paths.forward_span``, the whole batch's output as the worker thread computes it on the host path
  (the above, plus the worker's bookkeeping);
- ``deliver``: ``Worker._deliver``, the output split per request, each request's rows written into its slot;
- ``thread``: ``Worker.submit(...).result()``, the batch handed to the worker thread and back (``batch`` and
  ``deliver`` plus two thread hand-overs, with nobody else holding the GIL), and ``cpu``, the process's CPU time a
  batch on that path (both threads);
- then the parts measured alone: ``stage`` (the inputs copied into pinned memory by ``copy_into``) and, with CUDA
  events on the worker's stream, ``h2d``, ``kernel`` and ``d2h`` and their sum ``gpu``;
- what a CUDA graph per layer and batch size could save a batch: ``eager``, the wall time of the upload, the
  library call and the download issued on the worker's stream from and into fixed pinned buffers and waited for,
  against ``graph``, the same three captured once in a CUDA graph and replayed (wall time of the replay and the
  wait). ``eager - graph`` is the host time a graph takes off a batch.

``--pinned`` page-locks the slots' memory first (``HostPin``), as the engine process does with each HTTP process's
arena: the worker thread then takes the direct path (``paths.direct_batch``), and ``direct`` is its extension call
alone (``kernel_forward_direct``: inputs taken from the slots and outputs put into them, with the Python checks and
the kernel choice).

``--contend 0,200,500`` then measures, for the largest batch size, batches handed to the worker thread back to back
for 3 s while another Python thread holds the GIL for bursts of that many microseconds with pauses as long (0: no
such thread), as the engine's event loop does under load: batches/s, median and p90 microseconds a batch, the
process's CPU a batch, and the other thread's loop iterations per second (its share of the GIL).

Measured kernel choice is on (as in the server, ``Settings.tune``) unless ``--no-tune``. Needs a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kernels import conv_transpose2d, tuning
from kernels.internal import ext_packs, load_extension, resolve_precision
from service.codec import SlotTensor, tensor_bytes
from service.engine.kinds import Kind, Request, batch_kind, kind_of
from service.engine.ops import HostPin
from service.engine.paths import (
    forward_span,
    gather,
    kernel_forward_direct,
    kernel_forward_gathered,
    serving_choice,
)
from service.engine.registry import BatchLimits, Layer, load_repository
from service.engine.worker import Worker
from service.ipc import shm

ROOT = Path(__file__).resolve().parents[2]


def kind_of_batch(xs: list[SlotTensor]) -> Kind:
    """The batch's kind as the server's batcher says it (page-locked slots: the direct path on a GPU)."""
    requests: list[Request] = list(xs)
    return batch_kind(kind_of(x) for x in requests)


def wall_us(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of ``fn()`` in microseconds (after 20 warm-up calls)."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def gpu_us(fn: Callable[[], object], reps: int) -> float:
    """Mean GPU time of ``fn()`` on the current stream in microseconds, by CUDA events around ``reps`` calls."""
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / reps


def cpu_us(fn: Callable[[], object], reps: int) -> float:
    """Mean CPU time of this process (every thread) a call of ``fn()`` in microseconds (after 20 warm-up calls)."""
    for _ in range(20):
        fn()
    c0 = time.process_time()
    for _ in range(reps):
        fn()
    return 1e6 * (time.process_time() - c0) / reps


def slot_inputs(memory: memoryview, pinned: bool, layer: Layer, n: int, h: int, w: int) -> list[SlotTensor]:
    """n one-sample requests of random input, each with its input and output slot in ``memory`` (page-locked:
    ``pinned``)."""
    c = layer.config
    h_out, w_out = layer.output_hw(h, w)
    in_bytes = c.in_channels * h * w * layer.dtype.itemsize
    out_bytes = c.out_channels * h_out * w_out * layer.dtype.itemsize
    step = shm.aligned(in_bytes) + shm.aligned(out_bytes)
    if n * step > memory.nbytes:
        raise SystemExit(f"{n} requests of {step} bytes do not fit the {memory.nbytes}-byte arena")
    out = []
    for i in range(n):
        s = i * step
        x = torch.randn(1, c.in_channels, h, w).to(layer.dtype)
        memory[s:s + in_bytes] = tensor_bytes(x)
        o = s + shm.aligned(in_bytes)
        out.append(SlotTensor(memory[s:s + in_bytes], layer.dtype, (1, c.in_channels, h, w), memory[o:o + out_bytes],
                              pinned))
    return out


def row(worker: Worker, layer: Layer, memory: memoryview, pinned: bool, n: int, h: int, w: int, reps: int) -> str:
    """The table's row for a batch of ``n`` one-sample requests."""
    weight, bias, packs = worker.weights[layer.name]
    stream = worker.stream
    assert stream is not None
    c, cfg = layer.config, layer.args
    h_out, w_out = layer.output_hw(h, w)
    xs = slot_inputs(memory, pinned, layer, n, h, w)
    with torch.cuda.stream(stream):
        gathered = wall_us(lambda: kernel_forward_gathered(xs, weight, bias, layer, packs), reps)
        direct = wall_us(lambda: kernel_forward_direct(xs, weight, bias, layer, packs), reps) if pinned else None
        batch = wall_us(lambda: forward_span(worker, layer, xs, None), reps)
        y = forward_span(worker, layer, xs, None)
    deliver = wall_us(lambda: worker._deliver(xs, y, worker._generation), reps)
    kind = kind_of_batch(xs)
    thread = wall_us(lambda: worker.submit(layer, xs, kind).result(), reps)
    cpu = cpu_us(lambda: worker.submit(layer, xs, kind).result(), reps)
    host_in = torch.empty((n, c.in_channels, h, w), dtype=layer.dtype, pin_memory=True)
    host_out = torch.empty((n, c.out_channels, h_out, w_out), dtype=layer.dtype, pin_memory=True)
    stage = wall_us(lambda: gather(xs, out=host_in), reps)
    dev_in = torch.empty(host_in.shape, dtype=layer.dtype, device="cuda")
    dev_out = torch.empty(host_out.shape, dtype=layer.dtype, device="cuda")
    with torch.cuda.stream(stream):
        h2d = gpu_us(lambda: dev_in.copy_(host_in, non_blocking=True), reps)
        kernel = gpu_us(lambda: conv_transpose2d(dev_in, weight, bias, cfg.stride, cfg.padding, cfg.output_padding,
                                                 cfg.groups, cfg.dilation, precision=layer.kernel_precision), reps)
        d2h = gpu_us(lambda: host_out.copy_(dev_out, non_blocking=True), reps)
    choice = serving_choice(tuple(dev_in.shape), weight, bias, layer, packs)
    mode = resolve_precision(weight.dtype, layer.kernel_precision)

    def forward() -> torch.Tensor:  # the worker's kernels with its packed weights, as a graph per batch size would
        y, _ = load_extension().forward(
            dev_in, weight, bias, list(cfg.stride), list(cfg.padding), list(cfg.output_padding), list(cfg.dilation),
            cfg.groups, mode, None, *choice.forced(), ext_packs(packs, weight), prepare=False, torch_layout=True,
            remember=False)
        return y  # type: ignore[no-any-return]

    eager, graph = graph_us(stream, host_in, dev_in, host_out, forward, reps)
    direct_text = "-" if direct is None else f"{direct:.1f}"
    return (f"{n:>3} {gathered:9.1f} {direct_text:>8} {batch:9.1f} {deliver:8.1f} {thread:8.1f} {cpu:8.1f} | "
            f"{stage:6.1f} {h2d:6.1f} {kernel:6.1f} {d2h:6.1f} {h2d + kernel + d2h:6.1f} | {eager:6.1f} {graph:6.1f}")


def graph_us(stream: torch.cuda.Stream, host_in: torch.Tensor, dev_in: torch.Tensor, host_out: torch.Tensor,
             forward: Callable[[], torch.Tensor], reps: int) -> tuple[float, float]:
    """(eager, graph): median wall microseconds of upload, ``forward`` and download on ``stream`` and their wait,
    issued one by one, and as one CUDA graph's replay. The forward's problem must have run before (its kernel
    choice made outside the capture); the graph's output is checked against the eager one."""

    def eager_step() -> None:
        with torch.cuda.stream(stream):
            dev_in.copy_(host_in, non_blocking=True)
            host_out.copy_(forward(), non_blocking=True)
        stream.synchronize()

    eager = wall_us(eager_step, reps)
    expected = host_out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captured on torch's side stream, after the device is synchronized
        dev_in.copy_(host_in, non_blocking=True)
        host_out.copy_(forward(), non_blocking=True)

    def graph_step() -> None:
        with torch.cuda.stream(stream):
            graph.replay()
        stream.synchronize()

    host_out.zero_()
    graph_step()
    if not torch.equal(host_out, expected):
        raise SystemExit("the graph's replay gave another output than the eager call")
    return eager, wall_us(graph_step, reps)


def contended(worker: Worker, layer: Layer, xs: list[SlotTensor], busy_us: int, seconds: float = 3.0) -> str:
    """Batches back to back on the worker thread while another thread holds the GIL ``busy_us`` at a time, then
    pauses as long (0: no other thread)."""
    stop = threading.Event()
    spins = [0]

    def hold_gil() -> None:
        while not stop.is_set():
            until = time.perf_counter() + busy_us / 1e6
            while time.perf_counter() < until:
                spins[0] += 1
            time.sleep(busy_us / 1e6)

    other = threading.Thread(target=hold_gil, daemon=True) if busy_us else None
    if other is not None:
        other.start()
    times = []
    kind = kind_of_batch(xs)
    c0, t0 = time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        worker.submit(layer, xs, kind).result()
        times.append(time.perf_counter() - t)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stop.set()
    if other is not None:
        other.join()
    times.sort()
    return (f"other thread {busy_us:>4} us on / {busy_us} us off: {len(times) / wall:7.0f} batches/s, median "
            f"{1e6 * times[len(times) // 2]:6.0f} us, p90 {1e6 * times[int(0.9 * len(times))]:6.0f} us, cpu "
            f"{1e6 * cpu / len(times):6.0f} us a batch, other thread {spins[0] / wall / 1e3:6.0f} k iterations/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", default="demo", help="a layer of the repository")
    ap.add_argument("--repository", type=Path, default=ROOT / "layers")
    ap.add_argument("--size", default="16x16", help="input H x W")
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64", help="batch sizes (requests of one sample each)")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--no-tune", action="store_true", help="the dispatcher's default kernel, not the measured choice")
    ap.add_argument("--pinned", action="store_true", help="page-lock the slots' memory, as the engine process does")
    ap.add_argument("--contend", default="", help="comma list of microseconds another thread holds the GIL at a time")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    h, w = (int(v) for v in args.size.lower().split("x"))
    sizes = [int(v) for v in args.sizes.split(",")]
    registry = load_repository(args.repository, BatchLimits(max(sizes), 1 << 30, 0.0, 1024))
    layer = registry.get(args.layer)
    if layer is None:
        raise SystemExit(f"no layer {args.layer!r} in {args.repository}")
    tuning.enable(not args.no_tune)
    worker = Worker(torch.device("cuda", 0))
    worker.load(layer)
    arena = shm.Arena(256 << 20)
    pin = HostPin(arena.view) if args.pinned else None
    memory = pin.view if pin is not None else arena.view
    c = layer.config
    print(f"{torch.cuda.get_device_name()}, layer {layer.name} [n, {c.in_channels}, {h}, {w}] {c.dtype}, "
          f"slots {'page-locked' if args.pinned else 'pageable'}, measured kernel choice "
          f"{'off' if args.no_tune else 'on'}; median us of {args.reps} calls (cpu: mean)")
    print(f"{'n':>3} {'gathered':>9} {'direct':>8} {'batch':>9} {'deliver':>8} {'thread':>8} {'cpu':>8} | "
          f"{'stage':>6} {'h2d':>6} {'kernel':>6} {'d2h':>6} {'gpu':>6} | {'eager':>6} {'graph':>6}")
    for n in sizes:
        print(row(worker, layer, memory, args.pinned, n, h, w, args.reps), flush=True)
    if args.contend:
        xs = slot_inputs(memory, args.pinned, layer, max(sizes), h, w)
        for _ in range(50):  # warm-up
            worker.submit(layer, xs, kind_of_batch(xs)).result()
        print(f"n = {max(sizes)}, worker thread against another thread that wants the GIL:")
        for busy_us in (int(v) for v in args.contend.split(",")):
            print(contended(worker, layer, xs, busy_us), flush=True)
    worker.shutdown()


if __name__ == "__main__":
    main()
