"""What one batch costs the GPU worker outside the server: the engine's path for n one-sample requests whose tensors
sit in shared-memory slots, step by step, with no event loop and no other load.

    python bench/batch_costs.py --layer demo --sizes 1,2,4,8,16,32,64

For each batch size n (median microseconds over ``--reps`` calls, after a warm-up):

- ``gathered``: ``kernel_forward_gathered``, the extension call (inputs copied from the slots into pinned staging
  memory, upload, kernels, download into pinned memory, wait) with its Python checks and the kernel choice;
- ``batch``: ``Worker._batch_output``, the whole batch's output as the worker thread computes it (the above, plus
  the worker's bookkeeping);
- ``deliver``: ``Worker._deliver``, the output split per request, each request's rows written into its slot;
- ``thread``: ``Worker.submit(...).result()``, the batch handed to the worker thread and back (``batch`` and
  ``deliver`` plus two thread hand-overs, with nobody else holding the GIL);
- then the parts measured alone: ``stage`` (the inputs copied into pinned memory by ``copy_into``) and, with CUDA
  events on the worker's stream, ``h2d``, ``kernel`` and ``d2h`` and their sum ``gpu``.

Measured kernel choice is on (as in the server, ``Settings.tune``) unless ``--no-tune``. Needs a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels import conv_transpose2d, tuning  # noqa: E402
from service.codec import SlotTensor, tensor_bytes  # noqa: E402
from service.engine.registry import BatchLimits, Layer, load_repository  # noqa: E402
from service.engine.worker import Worker, _gather, kernel_forward_gathered  # noqa: E402
from service.ipc import shm  # noqa: E402


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


def slot_inputs(arena: shm.Arena, layer: Layer, n: int, h: int, w: int) -> list[SlotTensor]:
    """n one-sample requests of random input, each with its input and output slot in ``arena``."""
    c = layer.config
    h_out, w_out = layer.output_hw(h, w)
    in_bytes = c.in_channels * h * w * layer.dtype.itemsize
    out_bytes = c.out_channels * h_out * w_out * layer.dtype.itemsize
    step = shm.aligned(in_bytes) + shm.aligned(out_bytes)
    if n * step > arena.size:
        raise SystemExit(f"{n} requests of {step} bytes do not fit the {arena.size}-byte arena")
    out = []
    for i in range(n):
        s = i * step
        x = torch.randn(1, c.in_channels, h, w).to(layer.dtype)
        arena.view[s:s + in_bytes] = tensor_bytes(x)
        o = s + shm.aligned(in_bytes)
        out.append(SlotTensor(arena.view[s:s + in_bytes], layer.dtype, (1, c.in_channels, h, w),
                              arena.view[o:o + out_bytes]))
    return out


def row(worker: Worker, layer: Layer, arena: shm.Arena, n: int, h: int, w: int, reps: int) -> str:
    """The table's row for a batch of ``n`` one-sample requests."""
    weight, bias, packs = worker._weights[layer.name]
    stream = worker._stream
    assert stream is not None
    c, cfg = layer.config, layer.args
    h_out, w_out = layer.output_hw(h, w)
    xs = slot_inputs(arena, layer, n, h, w)
    with torch.cuda.stream(stream):
        gathered = wall_us(lambda: kernel_forward_gathered(xs, weight, bias, layer, packs), reps)
        batch = wall_us(lambda: worker._batch_output(layer, xs), reps)
        y = worker._batch_output(layer, xs)
    deliver = wall_us(lambda: worker._deliver(xs, y, worker._generation), reps)
    thread = wall_us(lambda: worker.submit(layer, xs).result(), reps)
    host_in = torch.empty((n, c.in_channels, h, w), dtype=layer.dtype, pin_memory=True)
    host_out = torch.empty((n, c.out_channels, h_out, w_out), dtype=layer.dtype, pin_memory=True)
    stage = wall_us(lambda: _gather(xs, out=host_in), reps)
    dev_in = torch.empty(host_in.shape, dtype=layer.dtype, device="cuda")
    dev_out = torch.empty(host_out.shape, dtype=layer.dtype, device="cuda")
    with torch.cuda.stream(stream):
        h2d = gpu_us(lambda: dev_in.copy_(host_in, non_blocking=True), reps)
        kernel = gpu_us(lambda: conv_transpose2d(dev_in, weight, bias, cfg.stride, cfg.padding, cfg.output_padding,
                                                 cfg.groups, cfg.dilation, precision=layer.kernel_precision), reps)
        d2h = gpu_us(lambda: host_out.copy_(dev_out, non_blocking=True), reps)
    return (f"{n:>3} {gathered:9.1f} {batch:9.1f} {deliver:8.1f} {thread:8.1f} | {stage:6.1f} {h2d:6.1f} "
            f"{kernel:6.1f} {d2h:6.1f} {h2d + kernel + d2h:6.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", default="demo", help="a layer of the repository")
    ap.add_argument("--repository", type=Path, default=ROOT / "layers")
    ap.add_argument("--size", default="16x16", help="input H x W")
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64", help="batch sizes (requests of one sample each)")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--no-tune", action="store_true", help="the dispatcher's default kernel, not the measured choice")
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
    c = layer.config
    print(f"{torch.cuda.get_device_name()}, layer {layer.name} [n, {c.in_channels}, {h}, {w}] {c.dtype}, "
          f"measured kernel choice {'off' if args.no_tune else 'on'}; median us of {args.reps} calls")
    print(f"{'n':>3} {'gathered':>9} {'batch':>9} {'deliver':>8} {'thread':>8} | {'stage':>6} {'h2d':>6} "
          f"{'kernel':>6} {'d2h':>6} {'gpu':>6}")
    for n in sizes:
        print(row(worker, layer, arena, n, h, w, args.reps), flush=True)
    worker.shutdown()


if __name__ == "__main__":
    main()
