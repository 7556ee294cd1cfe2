"""What one call costs, ours against cuDNN in the same run: host time, warm and cold GPU time, and the kernels a call
launches.

For each zoo layer (bench/kernels/layer_zoo.py; KernelBench's seven with ``--suite all``), precision and input layout,
the calls are:

- ``lib``: ``kernels.conv_transpose2d(x, w, b, ...)`` as a library user calls it (no autograd, weights in the row's
  layout, measured choice on unless ``--default``);
- ``module``: ``kernels.ConvTranspose2d`` holding the same weights, called on x (``eval()``, no autograd);
- ``served`` (NCHW rows): the call the service's GPU worker makes on device tensors (weights packed once,
  ``bench.kernels.kernelbench.served_call``);
- ``cudnn_nchw`` / ``cudnn_cl``: ``F.conv_transpose2d`` with ``cudnn.benchmark`` on, NCHW tensors and input AND
  weight channels_last.

Each call is measured four ways:

- ``host_us``: the host time of one call while the GPU is busy (a long sleep queued first, so that the call only
  queues work): the median over ``HOST_CALLS`` calls timed one by one with ``time.perf_counter_ns``;
- ``warm_us``: back-to-back calls (``WARM_CALLS`` of them between two CUDA events, after warm-up), per call: what
  a layer costs when it is host-bound or its data stays in L2 (bench/harness.py's ``warm_us``);
- ``cold_us``: the GPU time of one call after a write of twice the L2 size, with a host-slack sleep before it (so
  that the events time the GPU, not the host), the median of ``COLD_CALLS`` calls: a layer inside a model meets
  cold weights (bench/harness.py's ``ColdTimer``);
- ``kernels``: the GPU work one call launches (torch.profiler, CUDA activity): each kernel's name and microseconds,
  and how many there are.

Ratios in the summary are cuDNN's best layout over ours (>1: ours faster), per measure, per precision and layout:
geometric mean, rows at or above 1.0x, the slowest row. The JSON goes to ``<out>/call_cost-<device>.json``;
``--into FILE`` also writes each row's figures into the matching rows (name, precision, layout) of a
``layer_zoo-<device>.json`` under ``"call_cost"``.

    python -m bench.kernels.call_cost --out /tmp/cost --precisions tf32 bf16
    python -m bench.kernels.call_cost --only unet-up1 maskhead --layouts nchw
    python -m bench.kernels.call_cost --merge a.json b.json --out docs/benchmarks   # join partial runs (no GPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import kernels
from bench.harness import COLD_CALLS, WARM_CALLS, ColdTimer, short_slug, warm_us, write
from bench.kernels import zoo
from bench.kernels.kernelbench import served_call
from bench.kernels.problems import (
    DTYPES,
    LAYOUTS,
    OURS_PRECISION,
    PRECISIONS,
    conv_kwargs,
    kernelbench_problems,
    select,
    zoo_problems,
)
from bench.kernels.zoo_results import geomean
from kernels.functional import normalize_args, resolve_precision

HOST_CALLS = 60
# Cycles of the sleep that keeps the GPU busy while the host calls are timed (~50 ms at H100/H200 clocks; sized up
# when the calls take longer than that).
BUSY_CYCLES = 100_000_000
MEASURES = ("host_us", "warm_us", "cold_us")
CALLS = ("lib", "module", "served", "cudnn_nchw", "cudnn_cl")


def host_us(fn: Callable[[], object]) -> float:
    """The median host time of one call of ``fn`` while the GPU is busy with a sleep queued before the calls."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    fn()
    one = (time.perf_counter_ns() - t0) * 1e-3  # a rough first figure, to size the sleep
    torch.cuda.synchronize()
    cycles = max(BUSY_CYCLES, int(one * HOST_CALLS * 4e3))  # ~2 GHz: 2e3 cycles a microsecond, twice over
    torch.cuda._sleep(cycles)
    times = []
    for _ in range(HOST_CALLS):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e-3


def profile_kernels(calls: dict[str, Callable[[], object]]) -> dict[str, list[tuple[str, float]]]:
    """The GPU activities (kernels, copies, fills) each call launches: one profiler session for all, each call in a
    window between two synchronisations, its activities those that start inside it."""
    from torch.profiler import ProfilerActivity, profile

    windows: dict[str, tuple[float, float]] = {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for name, fn in calls.items():
            torch.cuda.synchronize()
            with torch.profiler.record_function(f"call:{name}"):
                fn()
                torch.cuda.synchronize()
    for evt in prof.events():
        if evt.name.startswith("call:"):
            windows[evt.name[5:]] = (evt.time_range.start, evt.time_range.end)
    out: dict[str, list[tuple[str, float]]] = {name: [] for name in calls}
    for evt in prof.events():
        # The profiler also shows each call's own range on the GPU's timeline (a user annotation): not GPU work.
        if evt.device_type != torch.autograd.DeviceType.CUDA or evt.name.startswith("call:"):
            continue
        for name, (lo, hi) in windows.items():
            if lo <= evt.time_range.start <= hi:
                out[name].append((evt.name[:80], round(evt.time_range.elapsed_us(), 2)))
                break
    return out


def row_calls(p: dict, precision: str, layout: str, default_choice: bool) -> tuple[dict[str, Callable[[], object]],
                                                                                     dict[str, str]]:
    """The calls of one row (and the kernel choices ours made), on fresh random inputs in the row's layout."""
    dtype = DTYPES[precision]
    x, w, b = zoo.inputs(p, dtype)
    kw = conv_kwargs(p)
    prec_arg = OURS_PRECISION[precision]
    if layout == "cl":
        x_in = x.contiguous(memory_format=torch.channels_last)
        w_in = w.contiguous(memory_format=torch.channels_last)
    else:
        x_in, w_in = x, w
    kernels.tuning.enable(not default_choice)
    calls: dict[str, Callable[[], object]] = {}
    calls["lib"] = partial(kernels.conv_transpose2d, x_in, w_in, b, precision=prec_arg, **kw)
    module = kernels.ConvTranspose2d(p["in_channels"], p["out_channels"], tuple(p["kernel_size"]),
                                     bias=b is not None, device="cuda", dtype=dtype, precision=prec_arg,
                                     **{k: v for k, v in kw.items()})
    with torch.no_grad():
        module.weight.copy_(w_in)
        if b is not None:
            module.bias.copy_(b)
    if layout == "cl":
        module = module.to(memory_format=torch.channels_last)
    module.eval()
    calls["module"] = partial(module, x_in)
    labels: dict[str, str] = {}
    if layout == "nchw":
        args = normalize_args(kw["stride"], kw["padding"], kw["output_padding"], kw["groups"], kw["dilation"])
        served, choice = served_call(x, w, b, args, resolve_precision(dtype, prec_arg))
        calls["served"] = served
        labels["served"] = choice.label
    x_cl, w_cl = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
    calls["cudnn_nchw"] = partial(F.conv_transpose2d, x, w, b, **kw)
    calls["cudnn_cl"] = partial(F.conv_transpose2d, x_cl, w_cl, b, **kw)
    return calls, labels


def measure_row(p: dict, precision: str, layout: str, cold: ColdTimer, default_choice: bool) -> dict[str, Any]:
    """Every call of a row measured every way (see the module)."""
    torch.backends.cudnn.allow_tf32 = precision != "fp32"
    torch.backends.cudnn.benchmark = True
    row: dict[str, Any] = {"name": p["name"], "suite": p["suite"], "precision": precision, "layout": layout}
    with torch.no_grad():
        calls, labels = row_calls(p, precision, layout, default_choice)
        for fn in calls.values():  # tuning and cuDNN's algorithm search, untimed
            fn()
        torch.cuda.synchronize()
        for name, fn in calls.items():
            row[name] = {"host_us": round(host_us(fn), 2), "warm_us": round(warm_us(fn), 2),
                         "cold_us": round(cold(fn), 2)}
        for name, acts in profile_kernels(calls).items():
            row[name]["kernels"] = len(acts)
            row[name]["gpu_work"] = acts
        row["choice"] = labels
    for m in MEASURES:
        best = min(row[c][m] for c in ("cudnn_nchw", "cudnn_cl"))
        for c in ("lib", "module", "served"):
            if c in row:
                row[c][f"vs_cudnn_{m.removesuffix('_us')}"] = round(best / row[c][m], 3)
    return row


def summarize(rows: Sequence[dict]) -> dict[str, Any]:
    """Per precision/layout and measure: the library call's ratio to cuDNN's best layout (geomean, rows at or above
    1.0x, the slowest), and the most kernels a library call launched."""
    out: dict[str, Any] = {}
    for key in sorted({(r["precision"], r["layout"]) for r in rows}):
        rs = [r for r in rows if (r["precision"], r["layout"]) == key]
        entry: dict[str, Any] = {"rows": len(rs), "max_lib_kernels": max(r["lib"]["kernels"] for r in rs)}
        for m in ("host", "warm", "cold"):
            ratios = [r["lib"][f"vs_cudnn_{m}"] for r in rs]
            worst = min(rs, key=lambda r: r["lib"][f"vs_cudnn_{m}"])
            entry[m] = {"geomean": round(geomean(ratios), 3), "at_or_above_1x": sum(x >= 1.0 for x in ratios),
                        "min": worst["lib"][f"vs_cudnn_{m}"], "min_name": worst["name"]}
        out[f"{key[0]}/{key[1]}"] = entry
    return out


def report(rows: Sequence[dict], summary: dict[str, Any]) -> str:
    lines = [f"{'name':<15} {'prec':<4} {'lay':<4} {'host us ours|mod|cudnn':>24} {'warm us ours|cudnn':>19} "
             f"{'cold us ours|cudnn':>19} kernels ours|cudnn"]
    for r in rows:
        best = min(("cudnn_nchw", "cudnn_cl"), key=lambda c: r[c]["cold_us"])
        cudnn_host = min(r["cudnn_nchw"]["host_us"], r["cudnn_cl"]["host_us"])
        lines.append(
            f"{r['name']:<15} {r['precision']:<4} {r['layout']:<4} "
            f"{r['lib']['host_us']:7.1f}|{r['module']['host_us']:6.1f}|{cudnn_host:6.1f}  "
            f"{r['lib']['warm_us']:8.1f}|{min(r['cudnn_nchw']['warm_us'], r['cudnn_cl']['warm_us']):8.1f}  "
            f"{r['lib']['cold_us']:8.1f}|{r[best]['cold_us']:8.1f}  {r['lib']['kernels']}|{r[best]['kernels']}")
    lines.append("ours (library call) against cuDNN's best layout, per measure: geomean, rows >= 1x, slowest")
    for key, v in summary.items():
        parts = [f"{m} {v[m]['geomean']:.2f}x {v[m]['at_or_above_1x']}/{v['rows']} min {v[m]['min']:.2f}x "
                 f"({v[m]['min_name']})" for m in ("host", "warm", "cold")]
        lines.append(f"  {key:<10} " + "; ".join(parts) + f"; most kernels a call {v['max_lib_kernels']}")
    return "\n".join(lines)


def merge_into(path: Path, rows: Sequence[dict]) -> int:
    """Write each row's figures into the matching rows of a layer_zoo JSON (under "call_cost"); returns how many."""
    doc = json.loads(path.read_text())
    by_key = {(r["name"], r["precision"], r["layout"]): r for r in rows}
    n = 0
    for zr in doc["rows"]:
        r = by_key.get((zr["name"], zr["precision"], zr["layout"]))
        if r is not None:
            zr["call_cost"] = {c: {k: v for k, v in r[c].items() if k != "gpu_work"} for c in CALLS if c in r}
            n += 1
    write(path, doc)
    return n


def merge(docs: Sequence[dict]) -> dict:
    """Join partial runs of one device and measured-choice setting: rows keyed by (suite, name, precision, layout),
    a later file's replacing an earlier one's, in the zoo's order; the summary recomputed over the joined rows.

    Raises:
        ValueError: no files, or files of different devices or measured-choice settings.
    """
    if not docs:
        raise ValueError("nothing to merge")
    for key in ("device", "measured_choice"):
        if len({str(d[key]) for d in docs}) != 1:
            raise ValueError(f"files with different {key}: {sorted({str(d[key]) for d in docs})}")
    rows: dict[tuple, dict] = {}
    for d in docs:
        for r in d["rows"]:
            rows[(r["suite"], r["name"], r["precision"], r["layout"])] = r
    order = {(p["suite"], p["name"]): i for i, p in enumerate(zoo_problems() + kernelbench_problems())}
    joined = sorted(rows.values(), key=lambda r: (order.get((r["suite"], r["name"]), len(order)), r["name"],
                                                   PRECISIONS.index(r["precision"]), LAYOUTS.index(r["layout"])))
    doc = {k: v for k, v in docs[0].items() if k not in ("summary", "rows")}
    return {**doc, "summary": summarize(joined), "rows": joined}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", nargs="+", default=["tf32", "bf16", "fp16"], choices=PRECISIONS)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--suite", default="zoo", choices=["zoo", "kernelbench", "all"])
    ap.add_argument("--only", nargs="+", metavar="NAME")
    ap.add_argument("--default", action="store_true", help="the default kernel choice (measured choice off)")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--into", type=Path, help="a layer_zoo-<device>.json to add the figures to")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="FILE",
                    help="join these partial JSON files into <out>/call_cost-<device>.json (no GPU needed)")
    args = ap.parse_args(argv)
    if args.merge:
        doc = merge([json.loads(f.read_text()) for f in args.merge])
        out = args.out / f"call_cost-{short_slug(doc['device'])}{'' if doc['measured_choice'] else '-default'}.json"
        write(out, doc)
        if args.into:
            print(f"call-cost figures added to {merge_into(args.into, doc['rows'])} rows of {args.into}",
                  file=sys.stderr)
        print(report(doc["rows"], doc["summary"]))
        print(f"wrote {out}")
        return
    if not torch.cuda.is_available():
        sys.exit("bench.kernels.call_cost needs a CUDA GPU")
    problems = select(zoo_problems() + kernelbench_problems(), args.suite, args.only)
    device = torch.cuda.get_device_name(0)
    cold = ColdTimer()
    rows: list[dict] = []
    t0 = time.perf_counter()
    out = args.out / f"call_cost-{short_slug(device)}{'-default' if args.default else ''}.json"

    def document() -> dict:
        return {"device": device, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                "measured_choice": not args.default, "host_calls": HOST_CALLS, "warm_calls": WARM_CALLS,
                "cold_calls": COLD_CALLS, "summary": summarize(rows), "rows": rows}

    for p in problems:
        for precision in args.precisions:
            for layout in args.layouts:
                try:
                    rows.append(measure_row(p, precision, layout, cold, args.default))
                except Exception as exc:  # one failing row must not lose the others
                    print(f"!!! {p['name']}/{precision}/{layout}: {type(exc).__name__}: {exc}", file=sys.stderr)
                    continue
                r = rows[-1]
                print(f"{p['name']}/{precision}/{layout}: host {r['lib']['host_us']} us (cuDNN "
                      f"{min(r['cudnn_nchw']['host_us'], r['cudnn_cl']['host_us'])}), kernels "
                      f"{[k for k, _ in r['lib']['gpu_work']]} [{time.perf_counter() - t0:.0f} s]",
                      file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
        if rows:
            write(out, document())  # after every problem: a run cut short keeps its rows
    doc = document()
    write(out, doc)
    if args.into:
        print(f"call-cost figures added to {merge_into(args.into, rows)} rows of {args.into}", file=sys.stderr)
    print(report(rows, doc["summary"]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
