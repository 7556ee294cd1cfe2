"""The layer zoo and KernelBench's seven problems: our kernels against the best of cuDNN, every precision and layout.

For each problem (layer_zoo.py's 25 decoder layers, then kernelbench_conv_transpose2d.json's 7, both beside this
file), each precision (tf32, bf16, fp16 and exact fp32) and each input layout (NCHW contiguous, channels_last), one
row:

- ``ours_ms``: ``kernels.conv_transpose2d(x, w, b, stride, padding, output_padding, groups, dilation,
  precision=...)`` as a library user calls it, with measured kernel choice on (``kernels.tuning.enable()``) and x
  and w in the row's layout (channels_last rows: input AND weight channels_last, as for cuDNN's channels_last
  figure and as ``model.to(memory_format=torch.channels_last)`` leaves a model); ``choice`` is the kernel measured
  choice kept (kernelbench.py's ``tuned_label``).
- ``served_ms`` (NCHW rows; null for channels_last rows): the call as the service's GPU worker makes it, on NCHW
  device tensors: weights packed once and kept (``WeightPacks``), the kernel measured with them.
- ``cudnn_nchw_ms`` / ``cudnn_cl_ms``: ``F.conv_transpose2d`` with ``torch.backends.cudnn.benchmark = True``, with
  NCHW tensors, and with input AND weight channels_last (what ``model.to(memory_format=torch.channels_last)``
  does). They do not depend on our input layout, so both rows of a problem and precision carry the same two
  figures, measured once. ``best_cudnn_ms`` is the smaller; ``speedup`` = best_cudnn_ms / ours_ms.
- ``floor_ms``: max(useful FLOPs / the precision's matrix rate, minimal bytes / copy bandwidth), both ceilings
  measured at the start of the same run (kernelbench.py's ``measure_ceilings``, with an fp16 matmul added).
  Exact fp32 uses the TF32 matmul rate / 3 (3xTF32, the fastest exact method we know; kernelbench.py's rule); the
  plain fp32 matmul rate is in ``ceilings`` too. ``gflop`` counts useful FLOPs (taps that land in the output),
  ``pct_of_floor`` = 100 x floor_ms / ours_ms.
- ``max_rel_err`` / ``correct``: ours (the library call in the row's layout and, on NCHW rows, the served call)
  against a float64 reference computed on the GPU from the same fresh random inputs (not the tuner's), norm-wise
  relative error, tolerance per precision (kernelbench.py's TOL, fp16 2e-2 as the GPU tests). The served call
  writes into a NaN-filled ``out``; the library call's output block is NaN-filled before the call (the caching
  allocator hands the freed block back) and every element must be finite. ``max_rel_err`` is null when the
  output holds a non-finite value or the call failed; a wrong row has ``"correct": false`` and is printed loudly.

- With ``--cutlass``, NVIDIA CUTLASS's strided dgrad kernels as a peer (bench/kernels/cutlass/peer.py): every
  configuration that can run the problem, on channels_last x and w (its layout, like cuDNN's cl figure), timed the
  same way; the fastest is ``cutlass_config`` with ``cutlass_ms`` (the smaller of two medians), checked against the
  same float64 reference (``cutlass_rel_err``, ``cutlass_correct``); ``vs_cutlass`` = cutlass_ms / ours_ms. Both
  rows of a problem and precision carry the same figures. ``cutlass_note`` says why there is none (exact fp32, or no
  configuration runs the problem: groups, dilation). The summary adds, per suite, precision and layout, the geomean
  of vs_cutlass and of best cuDNN / CUTLASS. The peer's build (~30 s on 16 cores) stays outside the budget; its
  timing is inside it.

Timing: CUDA events, an L2 flush and a host-slack sleep before every timed call (bench/harness.py's ``AdaptiveTimer``),
one warm-up call, then timed calls until ~25 ms of GPU time (at least 3, at most 40), the median; every figure (ours,
served, both cuDNN layouts) is the smaller of two such medians, the second taken after all of the problem's other calls
(the machine has slow spells that inflated single rows 2-8x: bench/NOTES.md v20). Tuning (the first call of each problem
with measured choice) and cuDNN's algorithm search are outside the timed calls but inside ``--budget-s``, which is
counted from after the extension is loaded: past it no new problem starts, and the rows not run are listed under
``summary.skipped`` (run them later with ``--only`` and join the files with ``--merge``).

Then, unless ``--no-check``: KernelBench's own correctness check on its seven problems under PyTorch's default
flags (fp32, ``cudnn.allow_tf32`` True, ``cudnn.benchmark`` False): 5 seeds, each ``torch.manual_seed(seed)``,
the Model with nn.ConvTranspose2d's default initialisation, ``torch.rand`` inputs (drawn on the GPU), ModelNew =
``kernels.convert(model)`` (precision None: follows ``cudnn.allow_tf32``), ``torch.allclose(ours, pytorch,
atol=1e-4, rtol=1e-4)``; with the default kernel choice and with measured choice. ``kernelbench_check`` records
pass/fail and the max abs difference per problem, seed and choice.

Output: ``<out>/layer_zoo-<device>.json`` (rewritten after every problem, so a run cut short leaves its rows) and
the full log ``<out>/layer_zoo-<device>.log``; progress lines go to stderr, the summary table comes last on
stdout.

    python -m bench.kernels.zoo --out /tmp/zoo                # everything (~6 min on an H100 after the build)
    python -m bench.kernels.zoo --precisions bf16 --layouts cl --only unet-up1 maskhead --no-check
    python -m bench.kernels.zoo --precisions bf16 fp16 tf32 --cutlass --budget-s 600 --out /tmp/zoo
    python -m bench.kernels.zoo --merge a.json b.json --out docs/benchmarks   # join partial runs (no GPU needed)
    python -m bench.kernels.zoo --estimate                                   # the run-time estimate (no GPU needed)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F

import kernels
from bench.harness import AdaptiveTimer, cudnn_benchmark, rel_err, short_slug, write
from bench.kernels.kernelbench import (
    Model,
    init_args,
    measure_ceilings,
    min_bytes,
    served_call,
    tuned_choice,
    useful_flops,
)
from bench.kernels.problems import (
    DTYPES,
    LAYOUTS,
    OURS_PRECISION,
    PRECISIONS,
    ZOO_TOL,
    conv_kwargs,
    kernelbench_problems,
    out_shape,
    roofline,
    select,
    zoo_problems,
)
from bench.kernels.zoo_results import CHECK_SEEDS, document, make_row, merge, report, summarize
from kernels.functional import normalize_args, resolve_precision, suggests_channels_last

ROOT = Path(__file__).resolve().parents[2]

CHECK_ATOL = CHECK_RTOL = 1e-4

DEVICE = "cuda"  # the CPU test runs the row logic with "cpu" and stand-ins for the GPU-only pieces

# Time-based repetition: timed calls until TARGET_MS of GPU time, MIN_REPS to MAX_REPS of them.
TARGET_MS = 25.0
MIN_REPS, MAX_REPS = 3, 40
DEFAULT_BUDGET_S = 330.0


# ---------------------------------------------------------------- GPU measurement


class Log:
    """Lines to stderr (flushed) and to the log file."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file: TextIO = path.open("w")

    def __call__(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)
        self.file.write(text + "\n")
        self.file.flush()


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kw: dict) -> torch.Tensor:
    """F.conv_transpose2d in float64 on the GPU (cuDNN's algorithm search off: one call)."""
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        return F.conv_transpose2d(x.double(), w.double(), None if b is None else b.double(), **kw)
    finally:
        torch.backends.cudnn.benchmark = old


def poison_allocator(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Fill a block the size of the coming output with NaN and free it: the caching allocator hands it to the
    next allocation of that size, so elements a kernel leaves unwritten read NaN."""
    torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


class RefCache:
    """The float64 reference of the last input dtype: tf32 and exact fp32 rows share one float32 input."""

    def __init__(self) -> None:
        self.key: object = None
        self.ref: torch.Tensor | None = None

    def get(self, key: object, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key != self.key:
            self.ref = None  # free the old one first
            self.ref = make()
            self.key = key
        assert self.ref is not None
        return self.ref

    def clear(self) -> None:
        self.key, self.ref = None, None


def inputs(p: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Fresh random input, weight and bias of a problem (same values for one name at one dtype; not the tuner's
    inputs): N(0, 1) input, weights scaled so that outputs stay O(1) in fp16."""
    gen = torch.Generator(device=DEVICE).manual_seed(zlib.crc32(p["name"].encode()))
    kh, kw = p["kernel_size"]
    c_in_g = p["in_channels"] // p["groups"]
    x = torch.randn(p["batch"], p["in_channels"], p["height"], p["width"], device=DEVICE, generator=gen).to(dtype)
    w = torch.randn(p["in_channels"], p["out_channels"] // p["groups"], kh, kw, device=DEVICE, generator=gen)
    w = (w / math.sqrt(c_in_g * kh * kw)).to(dtype)
    b = torch.randn(p["out_channels"], device=DEVICE, generator=gen).to(dtype) if p["bias"] else None
    return x, w, b


TimerFn = Callable[[Callable[[], object]], float]
# A peer library: (x, w, bias, conv kwargs) -> one call per configuration that can run the problem, or ValueError
# with the reason none can (bench/kernels/cutlass/peer.py's candidates).
PeerFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, dict], dict[str, Callable[[], torch.Tensor]]]


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def time_peer(peer: PeerFn, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kw: dict,
              ref: torch.Tensor, timer: TimerFn, tol: float) -> dict[str, Any]:
    """The peer's figures (the ``cutlass_*`` fields): its configurations on channels_last x and w (its own layout, as
    cuDNN's cl figure) timed once each, the fastest checked against the float64 reference in a NaN-filled block and
    timed again, the smaller median kept. A problem no configuration runs gets the reason in ``cutlass_note``."""
    x_cl = x.contiguous(memory_format=torch.channels_last)
    w_cl = w.contiguous(memory_format=torch.channels_last)
    try:
        runs = peer(x_cl, w_cl, b, kw)
    except ValueError as exc:  # the peer's UnsupportedError: no configuration runs the problem
        return {"cutlass_note": str(exc)[:400]}
    times = {name: timer(fn) for name, fn in runs.items()}
    name = min(times, key=times.__getitem__)
    poison_allocator(tuple(ref.shape), x.dtype)
    err = rel_err(runs[name](), ref)
    ms = min(times[name], timer(runs[name]))
    return {"cutlass_ms": ms, "cutlass_config": name, "cutlass_rel_err": err,
            "cutlass_correct": math.isfinite(err) and err <= tol}


def run_unit(p: dict, precision: str, layouts: Sequence[str], timer: TimerFn, ceilings: dict[str, float],
             refs: RefCache, log: Callable[[str], None], errors: list[str], peer: PeerFn | None = None) -> list[dict]:
    """The rows of one problem in one precision, one per layout (cuDNN, and the peer when given, measured once for
    both)."""
    dtype = DTYPES[precision]
    prec_arg = OURS_PRECISION[precision]
    tol = ZOO_TOL[precision]
    torch.backends.cudnn.allow_tf32 = precision != "fp32"
    x, w, b = inputs(p, dtype)
    kw = conv_kwargs(p)
    args = normalize_args(kw["stride"], kw["padding"], kw["output_padding"], kw["groups"], kw["dilation"])
    mode = resolve_precision(dtype, prec_arg)
    shape = out_shape(p)
    gflop, floor = roofline(p, precision, ceilings)
    tag = f"{p['name']}/{precision}"
    results: dict[str, dict[str, Any]] = {}
    again: list[tuple[dict[str, Any], str, Callable[[], object]]] = []  # (where, key, call) of the second medians
    with torch.no_grad():
        ref = refs.get((p["name"], dtype), lambda: reference(x, w, b, kw))
        for layout in layouts:
            res: dict[str, Any] = {"ours_ms": None, "served_ms": None, "choice": "-", "errs": [], "ok": True}
            results[layout] = res
            xin = x if layout == "nchw" else x.contiguous(memory_format=torch.channels_last)
            win = w if layout == "nchw" else w.contiguous(memory_format=torch.channels_last)
            ours = partial(kernels.conv_transpose2d, xin, win, b, kw["stride"], kw["padding"], kw["output_padding"],
                           kw["groups"], kw["dilation"], precision=prec_arg)
            try:
                t0 = time.perf_counter()
                ours()  # with measured choice: tunes on the problem's first call (outside the timed calls)
                sync()
                res["tune_s"] = time.perf_counter() - t0
                res["choice"] = tuned_choice(xin, win, b, args, mode).label
                poison_allocator(shape, dtype)
                y = ours()
                # PyTorch's layout rule: channels-last out when the input or the weight is, by their strides (a
                # one-pixel input made channels-last stays NCHW-contiguous, and so does PyTorch's output).
                want_cl = suggests_channels_last(xin) or suggests_channels_last(win)
                if want_cl and not y.is_contiguous(memory_format=torch.channels_last):
                    errors.append(f"{tag}/cl: output not channels_last")
                    res["ok"] = False
                res["errs"].append(rel_err(y, ref))
                del y
                res["ours_ms"] = timer(ours)
                again.append((res, "ours_ms", ours))
                if layout == "nchw":
                    served, c = served_call(x, w, b, args, mode)
                    res["served_choice"] = c.label
                    out = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
                    served(out=out)
                    res["errs"].append(rel_err(out, ref))
                    del out
                    res["served_ms"] = timer(served)
                    again.append((res, "served_ms", served))
            except Exception as exc:  # a failing call fails its row, not the run
                errors.append(f"{tag}/{layout}: {type(exc).__name__}: {exc}")
                log(f"!!! {tag}/{layout} failed:\n{traceback.format_exc()}")
                res["ok"] = False
                if isinstance(exc, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()
            del xin, win
        cudnn: dict[str, float | None] = {"nchw": None, "cl": None}
        try:
            x_cl = x.contiguous(memory_format=torch.channels_last)
            w_cl = w.contiguous(memory_format=torch.channels_last)
            calls = {"nchw": partial(F.conv_transpose2d, x, w, b, **kw),
                     "cl": partial(F.conv_transpose2d, x_cl, w_cl, b, **kw)}
            for key, call in calls.items():
                cudnn[key] = cudnn_benchmark(timer, call)
            for key, call in calls.items():
                cudnn[key] = min(cudnn[key], cudnn_benchmark(timer, call))  # type: ignore[type-var]
            del calls, x_cl, w_cl
        except Exception as exc:
            errors.append(f"{tag}: cuDNN: {type(exc).__name__}: {exc}")
            log(f"!!! {tag} cuDNN failed:\n{traceback.format_exc()}")
        peer_res: dict[str, Any] = {}
        if peer is not None and precision == "fp32":
            peer_res = {"cutlass_note": "no exact fp32 kernels (its float kernels run TF32)"}
        elif peer is not None:
            try:
                peer_res = time_peer(peer, x, w, b, kw, ref, timer, tol)
            except Exception as exc:
                errors.append(f"{tag}: CUTLASS: {type(exc).__name__}: {exc}")
                log(f"!!! {tag} CUTLASS failed:\n{traceback.format_exc()}")
                peer_res = {"cutlass_note": f"failed: {type(exc).__name__}: {str(exc)[:300]}"}
            if peer_res.get("cutlass_correct") is False:
                errors.append(f"{tag}: CUTLASS {peer_res['cutlass_config']} wrong: relative error "
                              f"{peer_res['cutlass_rel_err']}")
        for res, key, call in again:  # the second medians of ours (cuDNN's: above, after both first ones)
            try:
                res[key] = min(res[key], timer(call))
            except Exception as exc:
                errors.append(f"{tag}: {key} again: {type(exc).__name__}: {exc}")
                res["ok"] = False
        again.clear()
    torch.backends.cudnn.allow_tf32 = True
    rows = []
    for layout, res in results.items():
        errs = res["errs"]
        finite = bool(errs) and all(math.isfinite(e) for e in errs)
        err = max(errs) if finite else None
        correct = res["ok"] and finite and err is not None and err <= tol
        row = make_row(p, precision, layout, ours_ms=res["ours_ms"], served_ms=res["served_ms"],
                       cudnn_nchw_ms=cudnn["nchw"], cudnn_cl_ms=cudnn["cl"], gflop=gflop, floor=floor,
                       choice=res["choice"], max_rel_err=err, correct=correct, peer=peer_res)
        rows.append(row)
        sp = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        log(f"{p['name']:<15} {precision:<4} {layout:<4} ours {row['ours_ms']} served {row['served_ms']} "
            f"({res.get('served_choice', '-')}) cuDNN {row['cudnn_nchw_ms']}|{row['cudnn_cl_ms']} {sp} "
            f"floor {row['pct_of_floor']}% {row['choice']} err {row['max_rel_err']} tune "
            f"{res.get('tune_s', 0):.2f}s"
            + (f" CUTLASS {row.get('cutlass_ms')} ({row.get('cutlass_config') or row.get('cutlass_note')})"
               if peer else ""))
        if not correct:
            log(f"!!! WRONG RESULT {p['name']}/{precision}/{layout}: errors {errs} (tolerance {tol:.0e})")
    return rows


def kernelbench_check(problems: Sequence[dict], log: Callable[[str], None], errors: list[str]) -> list[dict]:
    """KernelBench's correctness check (see the module docstring) on each problem, default and measured choice."""
    out = []
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark, kernels.tuning.enabled())
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's defaults
    torch.backends.cudnn.benchmark = False
    try:
        for p in problems:
            kb = p["kb"]
            shape = (kb["batch"], kb["in_channels"], kb["height"], kb["width"])
            for seed in range(CHECK_SEEDS):
                try:
                    torch.manual_seed(seed)
                    model = Model(**init_args(kb)).to(DEVICE)
                    model_new = kernels.convert(copy.deepcopy(model))
                    with torch.no_grad():
                        x = torch.rand(shape, device=DEVICE)
                        want = model(x)
                        for choice in ("default", "measured"):
                            kernels.tuning.enable(choice == "measured")
                            got = model_new(x)
                            diff = float((got - want).abs().max())
                            ok = bool(torch.allclose(got, want, atol=CHECK_ATOL, rtol=CHECK_RTOL))
                            out.append({"id": kb["id"], "seed": seed, "choice": choice, "passed": ok,
                                        "max_abs_diff": float(f"{diff:.3e}")})
                            del got
                            log(f"check {kb['id']} seed {seed} {choice}: {'pass' if ok else 'FAIL'} "
                                f"max abs diff {diff:.2e}")
                        del x, want
                except Exception as exc:
                    errors.append(f"check {kb['id']} seed {seed}: {type(exc).__name__}: {exc}")
                    log(f"!!! check {kb['id']} seed {seed} failed:\n{traceback.format_exc()}")
                    out.append({"id": kb["id"], "seed": seed, "choice": "error", "passed": False,
                                "max_abs_diff": None})
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved[0], saved[1]
        kernels.tuning.enable(saved[2])
    return out


# ---------------------------------------------------------------- run-time estimate


# Assumptions of the estimate (H100 SXM): matrix rates, copy bandwidth, the share of them a call reaches, the
# fixed GPU cost of a timed call (L2 flush + host-slack sleep), cuDNN's float64 rate, cuDNN's time as a multiple of
# ours (strict fp32 is 2x ours on KernelBench 57), the algorithms its search runs, 3 times each.
EST = {"tf32": 390.0, "fp32": 130.0, "bf16": 780.0, "fp16": 780.0, "copy_TBps": 3.0, "eff": 0.25,
       "bw_eff": 0.6, "call_overhead_ms": 0.16, "fp64_TFLOPs": 1.0, "cudnn_factor": 2.0, "cudnn_algos": 10,
       "host_call_ms": 0.05, "unit_fixed_s": 0.1}


def estimate_unit_s(p: dict, precision: str, layouts: Sequence[str]) -> float:
    """A pessimistic estimate of one problem-precision unit's seconds on an H100 (see EST): a tuning per layout
    of the library call and one of the served call (~170 calls each, more for small problems that try split-K), timed
    calls of ours (each layout), served and cuDNN (two layouts, each after an algorithm search), twice, the float64
    reference (shared by tf32 and fp32: counted half in each), a fixed cost for allocations and Python."""
    flops = useful_flops(p)
    nbytes = min_bytes(p, DTYPES[precision].itemsize)
    t = max(flops / (EST[precision] * EST["eff"]) / 1e9, nbytes / (EST["copy_TBps"] * EST["bw_eff"]) / 1e9)
    per_call = t + EST["call_overhead_ms"]
    tune_calls = 18 * 4 * 1.5 + 4 * 16 + (12 * 4 if t < 0.25 else 0)
    tuning = (len(layouts) + 1) * tune_calls * per_call  # channels_last inputs may be tuned apart
    tc = t * EST["cudnn_factor"]
    ours_calls = (len(layouts) + ("nchw" in layouts)) * (max(MIN_REPS, min(MAX_REPS, math.ceil(TARGET_MS / t))) + 3)
    cudnn_calls = 2 * (max(MIN_REPS, min(MAX_REPS, math.ceil(TARGET_MS / tc))) + 2)
    timings = 2 * (ours_calls * per_call + cudnn_calls * (tc + EST["call_overhead_ms"]))  # two medians each
    search = 2 * EST["cudnn_algos"] * 3 * tc
    ref = (flops / (EST["fp64_TFLOPs"] * 1e9) + 6 * nbytes / 1e9 / EST["copy_TBps"]) / (2 if precision == "fp32" else 1)
    host = (len(layouts) + 1) * tune_calls * EST["host_call_ms"]  # the tuner's Python per call when the GPU is quicker
    return (tuning + timings + search + ref + host) / 1e3 + EST["unit_fixed_s"]


def estimate(problems: Sequence[dict], precisions: Sequence[str], layouts: Sequence[str]) -> float:
    return sum(estimate_unit_s(p, prec, layouts) for p in problems for prec in precisions)


# ---------------------------------------------------------------- main


def gpu_alive() -> bool:
    """Whether the device still runs work (a kernel fault leaves the CUDA context unusable for the process)."""
    if DEVICE != "cuda":
        return True
    try:
        torch.ones(1, device=DEVICE).add_(1).item()
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def run_problems(problems: Sequence[dict], precisions: Sequence[str], layouts: Sequence[str], timer: TimerFn,
                 ceilings: dict[str, float], deadline: float, log: Callable[[str], None], errors: list[str],
                 rows: list[dict], skipped: list[dict], after_problem: Callable[[], None] = lambda: None,
                 peer: PeerFn | None = None) -> None:
    """Every problem in every precision (tf32 before fp32: they share a reference) into ``rows``; once
    ``time.perf_counter()`` passes ``deadline`` the units not started go to ``skipped``, one entry per row.
    ``after_problem`` runs after each problem (the JSON is rewritten there)."""
    refs = RefCache()
    order = [prec for prec in ("tf32", "fp32", "bf16", "fp16") if prec in precisions]
    dead = False
    for p in problems:
        for prec in order:
            now = time.perf_counter()
            if now > deadline or dead:
                skipped += [{"suite": p["suite"], "name": p["name"], "precision": prec, "layout": lay}
                            for lay in layouts]
                log(f"skip {p['name']}/{prec}: {'the GPU context failed' if dead else 'budget spent'}")
                continue
            n_errors = len(errors)
            try:
                rows += run_unit(p, prec, layouts, timer, ceilings, refs, log, errors, peer)
            except Exception as exc:  # the inputs or the reference failed
                errors.append(f"{p['name']}/{prec}: {type(exc).__name__}: {exc}")
                log(f"!!! {p['name']}/{prec} failed:\n{traceback.format_exc()}")
                refs.clear()
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
            if len(errors) > n_errors and not gpu_alive():
                dead = True
                errors.append(f"{p['name']}/{prec}: the CUDA context no longer works; the rows after it skipped")
                log(f"!!! {errors[-1]}")
            log(f"# {p['name']}/{prec} took {time.perf_counter() - now:.1f} s (estimate "
                f"{estimate_unit_s(p, prec, layouts):.1f} s; {deadline - time.perf_counter():.0f} s of budget left)")
        refs.clear()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        after_problem()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--suite", default="all", choices=["zoo", "kernelbench", "all"])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="problem names (zoo names, kb<id>)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks",
                    help="folder of layer_zoo-<device>.json and .log (default docs/benchmarks)")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help="seconds after the extension loads past which no new problem starts (default %(default)s)")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="FILE",
                    help="join these partial JSON files into <out>/layer_zoo-<device>.json (no GPU needed)")
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="skip KernelBench's correctness check under PyTorch's default flags")
    ap.add_argument("--estimate", action="store_true", help="print the run-time estimate of the selection and exit")
    ap.add_argument("--cutlass", action="store_true",
                    help="time NVIDIA CUTLASS's dgrad kernels too (bench/kernels/cutlass; its build: ~30 s on 16 "
                         "cores, minutes on few), the cutlass_* fields")
    args = ap.parse_args(argv)

    unknown = set(args.only or ()) - {p["name"] for p in zoo_problems() + kernelbench_problems()}
    if unknown:
        sys.exit(f"unknown problem names: {sorted(unknown)}")
    problems = select(zoo_problems() + kernelbench_problems(), args.suite, args.only)
    if args.merge:
        doc = merge([json.loads(f.read_text()) for f in args.merge])
        out = args.out / f"layer_zoo-{short_slug(doc['device'])}.json"
        write(out, doc)
        print(report(doc))
        print(f"wrote {out}")
        return
    if args.estimate:
        for p in problems:
            units = [estimate_unit_s(p, prec, args.layouts) for prec in args.precisions]
            print(f"{p['name']:<15} {useful_flops(p) / 1e9:8.2f} GFLOP  " + " ".join(f"{u:6.2f}" for u in units)
                  + f"  s ({' '.join(args.precisions)})")
        total = estimate(problems, args.precisions, args.layouts)
        print(f"estimated {total:.0f} s for {len(problems)} problems x {len(args.precisions)} precisions x "
              f"{len(args.layouts)} layouts, plus ceilings and the check (~15 s), after the build")
        return
    if not torch.cuda.is_available():
        sys.exit("bench.kernels.zoo needs a CUDA GPU (only --merge and --estimate run without one)")

    device = torch.cuda.get_device_name(0)
    slug = short_slug(device)
    json_path = args.out / f"layer_zoo-{slug}.json"
    log = Log(args.out / f"layer_zoo-{slug}.log")
    t_build = time.perf_counter()
    kernels.conv_transpose2d(torch.randn(1, 1, 2, 2, device="cuda"), torch.randn(1, 1, 1, 1, device="cuda"))
    peer: PeerFn | None = None
    if args.cutlass:
        from bench.kernels.cutlass import peer as cutlass

        cutlass.load(log)  # the build stays outside the budget

        def cutlass_candidates(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kw: dict) -> dict:
            return cutlass.candidates(x, w, b, kw["stride"], kw["padding"], kw["output_padding"], kw["dilation"],
                                      kw["groups"])

        peer = cutlass_candidates
    t0 = time.perf_counter()
    log(f"# extension(s) built/loaded in {t0 - t_build:.1f} s; budget {args.budget_s:.0f} s from now")
    timer = AdaptiveTimer(TARGET_MS, MIN_REPS, MAX_REPS)
    ceilings = measure_ceilings(timer, ("tf32", "fp32", "bf16", "fp16"))
    log(f"# {device}; torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; ceilings: "
        + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()) + f" ({time.perf_counter() - t0:.1f} s)")
    errors: list[str] = []
    check: list[dict] = []
    if args.check:
        kb = [p for p in kernelbench_problems() if not args.only or p["name"] in args.only]
        check = kernelbench_check(kb, log, errors)
        log(f"# check done at {time.perf_counter() - t0:.1f} s")

    kernels.tuning.enable(True)
    rows: list[dict] = []
    skipped: list[dict] = []

    def doc_now(done: bool) -> dict:
        extra = {"elapsed_s": round(time.perf_counter() - t0, 1), "budget_s": args.budget_s, "complete": done,
                 "timing": f"median of {MIN_REPS}-{MAX_REPS} calls (~{TARGET_MS:.0f} ms of GPU time), L2 flushed",
                 "exact_fp32_rate": "tf32_matmul_TFLOPs / 3 (3xTF32)", "gflop": "useful FLOPs"}
        return document(device, torch.__version__, torch.backends.cudnn.version(), ceilings, rows, check,
                        summarize(rows, check, skipped, errors, extra))

    run_problems(problems, args.precisions, args.layouts, timer, ceilings, t0 + args.budget_s, log, errors, rows,
                 skipped, lambda: write(json_path, doc_now(False)), peer)
    doc = doc_now(True)
    write(json_path, doc)
    text = report(doc)
    log.file.write(text + "\n")
    log.file.close()
    print("\n" + text + f"\nwrote {json_path} and its .log", flush=True)


if __name__ == "__main__":
    main()
