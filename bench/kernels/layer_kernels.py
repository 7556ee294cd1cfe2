"""Where a bundled layer's time goes on the GPU: each kernel's time per call, ours against cuDNN's.

For every layer in layers/ at batch 1, 8 and 64 (H = W = ``--hw``), one call of ``kernels.conv_transpose2d`` and
one of ``F.conv_transpose2d`` (cuDNN) are timed end to end with CUDA events (median of ``--reps``, as
bench/kernels/kernelbench.py does) and run ``--reps`` times under ``torch.profiler``, which gives each GPU kernel's mean
time per call. The difference between the event time and the kernels' sum is what the GPU spends idle between
kernels within one call (launch gaps). Prints one line per (layer, batch) and writes JSON with ``--out``.

    python -m bench.kernels.layer_kernels --out /tmp/layer_kernels.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import kernels
from bench.harness import Timer, write
from bench.kernels.kernelbench import bundled_layers


def profiled(fn: Callable[[], object], reps: int) -> profile:
    """torch.profiler's record of ``reps`` calls of ``fn`` (GPU activity), after one call outside it."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return prof


def kernel_times(fn: Callable[[], object], reps: int) -> dict[str, float]:
    """Mean GPU time per call, in us, of each kernel (and copy or set) that ``fn`` runs, by name."""
    prof = profiled(fn, reps)
    out: dict[str, float] = {}
    for evt in prof.key_averages():
        total = getattr(evt, "device_time_total", None)
        if total is None:
            total = evt.cuda_time_total
        if total > 0 and evt.device_type == torch.autograd.DeviceType.CUDA:
            out[evt.key[:80]] = round(total / reps, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hw", type=int, default=32, help="input H = W (kernelbench.py's bundled-layer table)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    timer = Timer(reps=args.reps, warmup=5)
    rows = []
    for cfg, w, b, kw, prec in bundled_layers():
        dtype = w.dtype
        for n in args.batches:
            x = torch.rand(n, cfg["in_channels"], args.hw, args.hw, device="cuda").to(dtype)
            ours = partial(kernels.conv_transpose2d, x, w, b, groups=cfg["groups"], precision=prec, **kw)
            cudnn = partial(F.conv_transpose2d, x, w, b, groups=cfg["groups"], **kw)
            row: dict[str, object] = {"layer": cfg["name"], "batch": n, "hw": args.hw, "dtype": cfg["dtype"]}
            with torch.no_grad():
                for name, fn in (("ours", ours), ("cudnn", cudnn)):
                    torch.backends.cudnn.allow_tf32 = prec != "fp32"
                    ms = timer(fn)
                    ks = kernel_times(fn, args.reps)
                    torch.backends.cudnn.allow_tf32 = True
                    row[f"{name}_us"] = round(1e3 * ms, 2)
                    row[f"{name}_kernels_us"] = ks
                    row[f"{name}_gap_us"] = round(1e3 * ms - sum(ks.values()), 2)
            rows.append(row)
            print(f"{cfg['name']:<16} b{n:<3} ours {row['ours_us']:>8.2f} us (gaps {row['ours_gap_us']:>6.2f}) "
                  + " ".join(f"{k[:28]}={v}" for k, v in row["ours_kernels_us"].items())  # type: ignore[union-attr]
                  + f" | cudnn {row['cudnn_us']:>8.2f} us (gaps {row['cudnn_gap_us']:>6.2f}) "
                  + " ".join(f"{k[:28]}={v}" for k, v in row["cudnn_kernels_us"].items()),  # type: ignore[union-attr]
                  flush=True)
    if args.out:
        device = torch.cuda.get_device_name()
        write(args.out, {"device": device, "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
