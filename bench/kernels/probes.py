"""Measurements that decide a design question, one subcommand each (GPU). Each prints one line a case and a JSON
document at the end; bench/NOTES.md says which version used which.

- ``staging``: the gemm kernel with an NCHW input, its output stored straight into NCHW against written
  channels-last into scratch and converted (``force_staged``), every tile configuration, on every zoo and
  KernelBench layer it runs, next to cuDNN's best layout; the default rule's pick is marked.
- ``tf32``: which rounding cuDNN's TF32 result matches on the KernelBench problems under PyTorch's default flags
  (its kernels' operands rounded to nearest, truncated, or exact), against float64, and ours in each precision.
- ``host``: host time of one call (Python to the kernel's launch) with the GPU kept busy, ours (default and measured
  choice) against ``F.conv_transpose2d`` (cuDNN), for layers whose GPU time is small, and where ours goes.
- ``kernels``: the GPU time of each kernel a call launches (torch.profiler), as a library call and as the service
  calls it (packed weights kept), for the same small layers.
- ``weights``: the gemm kernel on a channels-last input with NCHW weights (packed every call, and packed once and
  kept: the kernel alone with K-major B) against channels-last weights (16-bit: read as they are, B N-major; TF32:
  packed from that layout every call), every tile configuration.
- ``narrow``: the narrow kernels forced (per-pixel; tiled with one and with two columns a thread, and staged), the
  default choice and cuDNN's best layout, on the zoo and KernelBench layers of at most 32 output channels a group,
  NCHW and channels-last inputs, every precision.
- ``rounding``: the gemm kernel's TF32 products with x rounded to TF32 before the kernel (``force_round``: an NCHW
  x by its layout change, a channels-last one by a pass of its own) against the kernel rounding each landed A stage
  (in its multipliers' registers since v33; at 256 columns in shared memory), whole calls, both input layouts, every
  wgmma configuration; the default choice and cuDNN's best layout beside them.
- ``shuffle``: layers whose kernel is their stride, 16-bit NCHW inputs: the shuffle kernel (x and y NCHW as they
  are, one kernel) against the gemm kernel (x changed to channels-last first, y stored NCHW), both with the weights
  packed once, the library call's default choice, and cuDNN in both layouts; warm (back to back) and cold (L2
  flushed) microseconds. The zoo's layers of that kind and a few others from real models (``SHUFFLE_LAYERS``).
- ``nchw``: where an NCHW call's time goes against a channels-last one: each kernel's GPU time (torch.profiler) of our
  library call with NCHW and with channels-last tensors and of cuDNN's, BF16 and TF32, and of our call on the layer's
  column-folded view (``fold_columns``: stride_w 1, C_out x stride_w output channels, the same output once the
  columns are unfolded), which tells what a GEMM whose columns are every column phase of a channel would cost.
  ``NCHW_LAYERS`` by default.
- ``fold``: layers with few output columns C_out x stride_w (at most ``FOLD_MAX_COLUMNS``) or a column stride of 8 or
  more, exact fp32, TF32 and BF16, NCHW and channels-last inputs (``--layouts``): the fold kernel forced, every other
  family forced (the taps path among them; the fastest that ran kept), the library call's default choice, and cuDNN in
  both layouts; warm and cold microseconds. The zoo's and KernelBench's layers of that kind and layers from real
  models outside the zoo (``FOLD_LAYERS``).

- ``layouts``: the layout changes' bandwidth: the gemm kernel forced (configuration 0) on NCHW tensors with its
  output staged channels-last, each kernel's GPU time in launch order (the median of five calls), so that x's change
  to channels-last and y's back to NCHW are told apart even where one kernel does both; bytes read and written over
  time, against a copy of as many bytes. BF16, and TF32 where x is rounded on its way. ``LAYOUT_LAYERS`` by default.

    python -m bench.kernels.probes staging [--only NAME ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import kernels
from bench.harness import ColdTimer, cudnn_benchmark, rel_err, warm_us, write
from bench.kernels import layer_kernels, zoo
from bench.kernels.kernelbench import Model, init_args
from bench.kernels.problems import conv_kwargs, kernelbench_problems, out_shape, spec, zoo_problems
from kernels.internal import check_tensors, forward_cuda, load_extension, normalize_args
from kernels.tuning import TUNER, Timer
from service.engine.ops import WeightPacks

DTYPES = {"tf32": torch.float32, "bf16": torch.bfloat16}


def _timer() -> Callable[[Callable[[], object]], float]:
    t = Timer(torch.device("cuda"))
    return lambda fn: t(fn, 15)


def _args(p: dict) -> Any:
    kw = conv_kwargs(p)
    return normalize_args(kw["stride"], kw["padding"], kw["output_padding"], kw["groups"], kw["dilation"])


def staging(problems: Sequence[dict]) -> list[dict]:
    timer = _timer()
    rows = []
    for p in problems:
        for precision, dtype in DTYPES.items():
            torch.backends.cudnn.allow_tf32 = True
            torch.backends.cudnn.benchmark = True
            x, w, b = zoo.inputs(p, dtype)
            args = _args(p)
            run = partial(forward_cuda, x, w, b, args, "tf32", force_path="gemm")
            with torch.no_grad():
                if run()[1] != "gemm":
                    continue
                times = {}
                for config in range(3):
                    for staged in (False, True):
                        times[(config, staged)] = timer(partial(run, force_config=config, force_staged=staged))
                dflt = timer(partial(run, force_config=None))
                kw = conv_kwargs(p)
                cudnn = min(timer(partial(F.conv_transpose2d, x, w, b, **kw)),
                            timer(partial(F.conv_transpose2d, x.contiguous(memory_format=torch.channels_last),
                                          w.contiguous(memory_format=torch.channels_last), b, **kw)))
            direct = min(v for (c, s), v in times.items() if not s)
            staged_ms = min(v for (c, s), v in times.items() if s)
            row = {"name": p["name"], "precision": precision, "stride": p["stride"], "direct_ms": round(direct, 4),
                   "staged_ms": round(staged_ms, 4), "default_route_ms": round(dflt, 4),
                   "best_cudnn_ms": round(cudnn, 4), "out_mb": round(_out_bytes(p, dtype) / 2**20, 1)}
            rows.append(row)
            print(f"staging {p['name']:<15} {precision} stride {p['stride']} out {row['out_mb']} MB: direct "
                  f"{direct:.4f} staged {staged_ms:.4f} default {dflt:.4f} cuDNN best {cudnn:.4f} ms", flush=True)
            del x, w, b
    return rows


def _out_bytes(p: dict, dtype: torch.dtype) -> int:
    n, c, h, w = out_shape(p)
    return n * c * h * w * dtype.itemsize


def _tf32_round(t: torch.Tensor) -> torch.Tensor:
    return ((t.view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)


def _tf32_truncate(t: torch.Tensor) -> torch.Tensor:
    return (t.view(torch.int32) & -0x2000).view(torch.float32)


def tf32(problems: Sequence[dict]) -> list[dict]:
    """cuDNN's TF32 output against float64 from operands rounded three ways; ours in tf32 and fp32 likewise."""
    rows = []
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = False
    for p in problems:
        kb = p["kb"]
        shape = (kb["batch"], kb["in_channels"], kb["height"], kb["width"])
        torch.manual_seed(0)
        model = Model(**init_args(kb)).cuda()
        conv = next(m for m in model.modules() if isinstance(m, torch.nn.ConvTranspose2d))
        with torch.no_grad():
            x = torch.rand(shape, device="cuda")
            w, b = conv.weight, conv.bias
            kw = conv_kwargs(p)
            got = {"cudnn": model(x)}
            for prec in ("tf32", "fp32"):
                got[f"ours_{prec}"] = kernels.conv_transpose2d(x, w, b, precision=prec, **kw)
            args = _args(p)
            for path in ("tensor_core", "gemm", "sparse"):  # what each of our kernel families gives in TF32 mode
                y, ran = forward_cuda(x, w, b, args, "tf32", force_path=path)
                if ran == path:
                    got[f"ours_tf32_{path}"] = y
            refs = {}
            for name, fn in (("exact", lambda t: t), ("rna", _tf32_round), ("trunc", _tf32_truncate)):
                refs[name] = F.conv_transpose2d(fn(x).double(), fn(w).double(),
                                                None if b is None else b.double(), **kw)
            row: dict[str, Any] = {"id": kb["id"]}
            for gname, y in got.items():
                for rname, ref in refs.items():
                    row[f"{gname}_vs_{rname}"] = float(f"{float((y.double() - ref).abs().max()):.3e}")
            for gname, y in got.items():
                if gname != "cudnn":
                    row[f"cudnn_vs_{gname}"] = float(f"{float((got['cudnn'] - y).abs().max()):.3e}")
            rows.append(row)
            print("tf32", json.dumps(row), flush=True)
            del x, got, refs
    return rows


def _host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Host microseconds a call with the GPU busy (a long sleep queued first, so no call waits for the GPU and
    the queue never fills)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        torch.cuda._sleep(50_000_000)  # ~25-30 ms of GPU time
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        dt = time.perf_counter() - t0
        torch.cuda.synchronize()
        best = min(best, dt / calls * 1e6)
    return best


def _host_row(p: dict, precision: str, dtype: torch.dtype) -> dict:
    x, w, b = zoo.inputs(p, dtype)
    kw = conv_kwargs(p)
    args = _args(p)
    ours = partial(kernels.conv_transpose2d, x, w, b, **kw)
    row: dict[str, Any] = {"name": p["name"], "precision": precision}
    with torch.no_grad():
        kernels.tuning.enable(False)
        row["ours_default_us"] = _host_us(ours)
        kernels.tuning.enable(True)
        row["ours_measured_us"] = _host_us(ours)
        kernels.tuning.enable(False)
        row["cudnn_us"] = _host_us(partial(F.conv_transpose2d, x, w, b, **kw))
        # Where ours goes: the argument parsing and checks, the extension call alone, an allocation.
        row["normalize_us"] = _host_us(partial(normalize_args, kw["stride"], kw["padding"], kw["output_padding"],
                                               kw["groups"], kw["dilation"]), 2000)
        row["check_us"] = _host_us(partial(check_tensors, x, w, b, args), 2000)
        row["extension_us"] = _host_us(partial(forward_cuda, x, w, b, args, "tf32"))
        row["empty_us"] = _host_us(partial(torch.empty_like, x), 2000)
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}


def host(problems: Sequence[dict]) -> list[dict]:
    rows = []
    torch.backends.cudnn.benchmark = True
    for p in problems:
        for precision, dtype in DTYPES.items():
            rows.append(_host_row(p, precision, dtype))
            print("host", json.dumps(rows[-1]), flush=True)
    TUNER.clear()
    return rows


def kernel_times(problems: Sequence[dict]) -> list[dict]:
    """Where a library call's GPU time goes against the served call (packed weights kept), per kernel."""
    from service.engine.ops import WeightPacks

    rows = []
    for p in problems:
        for precision, dtype in DTYPES.items():
            x, w, b = zoo.inputs(p, dtype)
            args = _args(p)
            packs = WeightPacks(w)
            with torch.no_grad():
                lib = layer_kernels.kernel_times(partial(forward_cuda, x, w, b, args, "tf32"), 20)
                served = layer_kernels.kernel_times(partial(forward_cuda, x, w, b, args, "tf32", packs=packs), 20)
            rows.append({"name": p["name"], "precision": precision, "library_us": lib, "served_us": served})
            print("kernels", json.dumps(rows[-1]), flush=True)
    return rows


def weights(problems: Sequence[dict]) -> list[dict]:
    from service.engine.ops import WeightPacks

    timer = _timer()
    rows = []
    for p in problems:
        for precision, dtype in DTYPES.items():
            x, w, b = zoo.inputs(p, dtype)
            x = x.contiguous(memory_format=torch.channels_last)
            w_cl = w.contiguous(memory_format=torch.channels_last)
            args = _args(p)
            packs = WeightPacks(w)
            row: dict[str, Any] = {"name": p["name"], "precision": precision}
            with torch.no_grad():
                for c in range(int(load_extension().num_gemm_configs)):
                    calls = {"nchw_ms": partial(forward_cuda, x, w, b, args, "tf32", force_path="gemm",
                                                force_config=c),
                             "nchw_kept_ms": partial(forward_cuda, x, w, b, args, "tf32", force_path="gemm",
                                                     force_config=c, packs=packs),
                             "cl_ms": partial(forward_cuda, x, w_cl, b, args, "tf32", force_path="gemm",
                                              force_config=c)}
                    if calls["nchw_ms"]()[1] != "gemm":
                        break
                    row[f"gemm{c}"] = {k: round(timer(fn), 4) for k, fn in calls.items()}
            if len(row) > 2:
                rows.append(row)
                print("weights", json.dumps(rows[-1]), flush=True)
    return rows


NARROW_PRECISIONS = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def narrow(problems: Sequence[dict]) -> list[dict]:
    timer = _timer()
    rows = []
    for p in problems:
        if p["out_channels"] // p["groups"] > 32:
            continue
        for precision, dtype in NARROW_PRECISIONS.items():
            torch.backends.cudnn.allow_tf32 = precision == "tf32"
            torch.backends.cudnn.benchmark = True
            x, w, b = zoo.inputs(p, dtype)
            args = _args(p)
            kw = conv_kwargs(p)
            mode = "tf32" if precision == "tf32" else "fp32"
            for layout in ("nchw", "cl"):
                xl = x.contiguous(memory_format=torch.channels_last) if layout == "cl" else x
                row: dict[str, Any] = {"name": p["name"], "precision": precision, "layout": layout}
                with torch.no_grad():
                    calls = {"narrow": dict(force_path="narrow"), "default": {}}
                    for c in range(int(load_extension().num_narrow_tiled_configs)):
                        calls[f"narrow_tiled{c}"] = dict(force_path="narrow_tiled", force_config=c)
                    for name, force in calls.items():
                        run = partial(forward_cuda, xl, w, b, args, mode, **force)
                        row[f"{name}_ran"] = run()[1]
                        row[f"{name}_ms"] = round(timer(run), 4)
                    row["best_cudnn_ms"] = round(min(
                        timer(partial(F.conv_transpose2d, x, w, b, **kw)),
                        timer(partial(F.conv_transpose2d, x.contiguous(memory_format=torch.channels_last),
                                      w.contiguous(memory_format=torch.channels_last), b, **kw))), 4)
                rows.append(row)
                print("narrow", json.dumps(row), flush=True)
            del x, w, b
    return rows


WGMMA_CONFIGS = (0, 1, 2, 5, 6, 7, 8)  # 3 and 4 are the mma.sync kernel's, which rounds in registers


def rounding(problems: Sequence[dict]) -> list[dict]:
    timer = _timer()
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    rows = []
    for p in problems:
        x, w, b = zoo.inputs(p, torch.float32)
        args = _args(p)
        kw = conv_kwargs(p)
        xcl = x.contiguous(memory_format=torch.channels_last)
        row: dict[str, Any] = {"name": p["name"]}
        with torch.no_grad():
            for c in WGMMA_CONFIGS:
                calls = {f"{layout}_{how}_ms": partial(forward_cuda, xl, w, b, args, "tf32", force_path="gemm",
                                                        force_config=c, force_round=how == "rounded")
                         for layout, xl in (("nchw", x), ("cl", xcl)) for how in ("kernel", "rounded")}
                if calls["nchw_kernel_ms"]()[1] != "gemm":
                    break
                row[f"gemm{c}"] = {k: round(timer(fn), 4) for k, fn in calls.items()}
            if len(row) == 1:
                continue
            row["nchw_default_ms"] = round(timer(partial(forward_cuda, x, w, b, args, "tf32")), 4)
            row["cl_default_ms"] = round(timer(partial(forward_cuda, xcl, w, b, args, "tf32")), 4)
            row["best_cudnn_ms"] = round(min(
                timer(partial(F.conv_transpose2d, x, w, b, **kw)),
                timer(partial(F.conv_transpose2d, xcl, w.contiguous(memory_format=torch.channels_last), b, **kw))), 4)
        rows.append(row)
        print("rounding", json.dumps(row), flush=True)
        del x, xcl, w, b
    return rows


# Layers of the same kind outside the zoo: (name, batch, C_in, C_out, k, H, W).
SHUFFLE_LAYERS = (
    ("sam-up1", 1, 256, 64, 2, 64, 64),      # SAM's mask decoder, first 2x2 up-convolution
    ("sam-up2", 1, 64, 32, 2, 128, 128),     # and its second
    ("unet-up28", 8, 1024, 512, 2, 28, 28),  # U-Net at 28 x 28, a batch of 8
    ("unet-up2", 4, 512, 256, 2, 64, 64),    # U-Net's second up-convolution
    ("segment-k4", 4, 256, 64, 4, 32, 32),   # a 4x4 stride-4 upsampling head
)


def shuffle_problems() -> list[dict]:
    """The zoo's and KernelBench's layers whose kernel is their stride (one group), and ``SHUFFLE_LAYERS``."""
    mine = [p for p in zoo_problems() + kernelbench_problems()
            if p["kernel_size"] == p["stride"] and p["groups"] == 1 and p["dilation"] == [1, 1]
            and p["output_padding"] == [0, 0]]
    for name, n, c_in, c_out, k, h, w in SHUFFLE_LAYERS:
        mine.append(spec(name, "other", n, c_in, c_out, [k, k], [k, k], [0, 0], [0, 0], 1, [1, 1], h, w, True))
    return mine


def _layer_row(p: dict, precision: str) -> dict[str, Any]:
    """A probe row's head: the problem's name, the precision, the input's shape and the output channels."""
    return {"name": p["name"], "precision": precision, "shape": [p["batch"], p["in_channels"], p["height"],
            p["width"]], "out_channels": p["out_channels"]}


def shuffle(problems: Sequence[dict]) -> list[dict]:
    cold = ColdTimer()
    rows = []
    for p in problems:
        for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            x, w, b = zoo.inputs(p, dtype)
            args = _args(p)
            kw = conv_kwargs(p)
            packs = WeightPacks(w)
            row = _layer_row(p, precision)
            xcl, wcl = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
            calls = {"shuffle": partial(forward_cuda, x, w, b, args, "fp32", force_path="shuffle", packs=packs),
                     "gemm": partial(forward_cuda, x, w, b, args, "fp32", force_path="gemm", packs=packs),
                     "default": partial(kernels.conv_transpose2d, x, w, b, **kw),
                     "cudnn_nchw": partial(F.conv_transpose2d, x, w, b, **kw),
                     "cudnn_cl": partial(F.conv_transpose2d, xcl, wcl, b, **kw)}
            with torch.no_grad():
                for name in ("shuffle", "gemm"):
                    row[f"{name}_ran"] = calls[name]()[1]
                for name, fn in calls.items():
                    if name.startswith("cudnn"):
                        row[f"{name}_warm_us"] = round(cudnn_benchmark(warm_us, fn), 2)
                        row[f"{name}_cold_us"] = round(cudnn_benchmark(cold, fn), 2)
                    else:
                        row[f"{name}_warm_us"] = round(warm_us(fn), 2)
                        row[f"{name}_cold_us"] = round(cold(fn), 2)
            for how in ("warm", "cold"):
                best = min(row[f"cudnn_nchw_{how}_us"], row[f"cudnn_cl_{how}_us"])
                row[f"vs_cudnn_{how}"] = round(best / row[f"default_{how}_us"], 3)
            rows.append(row)
            print("shuffle", json.dumps(row), flush=True)
            del x, w, b, xcl, wcl, packs
    return rows


# Real layers in the fold kernel's domain (few output columns C_out x stride_w, or a column stride of 8 or more and
# few channels) beside the zoo's: (name, batch, C_in, C_out, kernel, stride, padding, H, W).
FOLD_LAYERS = (
    ("fsrcnn-x2", 16, 56, 1, 9, 2, 4, 64, 64),              # FSRCNN x2 (output padding 1 in the model; 0 here)
    ("dcgan128-rgb", 32, 64, 3, 4, 2, 1, 64, 64),           # a 128 px generator's RGB output layer
    ("pix2pix-rgb-b1", 1, 128, 3, 4, 2, 1, 128, 128),       # pix2pix's output layer for one image
    ("unet-out-k2", 4, 64, 2, 2, 2, 0, 128, 128),           # a two-class U-Net head, 2 x 2 up-convolution
    ("espcn-like-x4", 8, 32, 3, 8, 4, 2, 64, 64),           # an RGB x4 super-resolution output
    ("keypoint-17", 100, 512, 17, 4, 2, 1, 14, 14),         # Mask R-CNN's keypoint head, 100 RoIs
    ("fcn8s-up8-b1", 1, 21, 21, 16, 8, 0, 68, 68),          # FCN-8s' upscore8 for one 500 x 500 image
    ("fcn16s-up16", 4, 21, 21, 32, 16, 0, 36, 36),          # FCN-16s' upscore16
    ("fcn32s-up32", 4, 21, 21, 64, 32, 0, 18, 18),          # FCN-32s' upscore32
    ("cityscapes-up8", 2, 19, 19, 16, 8, 4, 64, 128),       # 19 classes at 1/8 of 512 x 1024, cropped by padding
    ("mask-up8", 16, 1, 1, 16, 8, 4, 28, 28),               # a one-channel mask up-sampler
    ("feat24-up8", 4, 24, 16, 16, 8, 4, 32, 32),            # 24 feature channels to 16: the rule's edge
    ("feat-up8", 4, 32, 16, 16, 8, 4, 32, 32),              # 32 feature channels to 16
    ("ade-up8", 2, 150, 150, 16, 8, 4, 32, 32),             # ADE20K's 150 classes: too many for the fold kernel
)
FOLD_OTHERS = ("taps_fused", "taps", "gemm", "tensor_core", "narrow_tiled", "narrow", "sparse")


FOLD_MAX_COLUMNS = 64  # C_out x stride_w: the probe's few-column layers (8 n8 tiles)


def fold_problems() -> list[dict]:
    """The zoo's and KernelBench's layers with few output columns or a column stride of 8 or more, one group, and
    ``FOLD_LAYERS``."""
    mine = [p for p in zoo_problems() + kernelbench_problems() if p["groups"] == 1
            and (p["stride"][1] >= 8 or p["out_channels"] * p["stride"][1] <= FOLD_MAX_COLUMNS)]
    for name, n, c_in, c_out, k, st, pad, h, w in FOLD_LAYERS:
        mine.append(spec(name, "other", n, c_in, c_out, [k, k], [st, st], [pad, pad], [0, 0], 1, [1, 1], h, w, False))
    return mine


FOLD_PRECISIONS = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}


def fold(problems: Sequence[dict], layouts: Sequence[str] = ("nchw",)) -> list[dict]:
    """The fold kernel forced, every other family forced (each call says which ran: a family that cannot take the
    layer runs the rule's next family), the dispatcher's rule's pick (``rule_ran``), the library call (measured
    choice; ``default_*``), and cuDNN in both layouts; exact fp32, TF32 and BF16, our calls on x in each of
    ``layouts`` (cuDNN in both layouts every time), warm and cold microseconds."""
    cold = ColdTimer()
    rows = []
    for p, (precision, dtype), layout in itertools.product(problems, FOLD_PRECISIONS.items(), layouts):
        x0, w, b = zoo.inputs(p, dtype)
        args = _args(p)
        kw = conv_kwargs(p)
        mode = "fp32" if dtype != torch.float32 else precision
        row = {**_layer_row(p, precision), "layout": layout, "kernel": p["kernel_size"], "stride": p["stride"]}
        xcl, wcl = x0.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
        x = xcl if layout == "cl" else x0
        torch.backends.cudnn.allow_tf32 = precision != "fp32"  # cuDNN's strict fp32 beside exact fp32
        with torch.no_grad():
            row["rule_ran"] = forward_cuda(x, w, b, args, mode)[1]  # the dispatcher's rule, unmeasured
            row["fold_ran"] = forward_cuda(x, w, b, args, mode, force_path="fold")[1]
            if row["fold_ran"] == "fold":
                fn = partial(forward_cuda, x, w, b, args, mode, force_path="fold")
                row["fold_warm_us"], row["fold_cold_us"] = round(warm_us(fn), 2), round(cold(fn), 2)
            others = {}
            for family in FOLD_OTHERS:
                ran = forward_cuda(x, w, b, args, mode, force_path=family)[1]
                if ran in others or ran == "fold":
                    continue
                fn = partial(forward_cuda, x, w, b, args, mode, force_path=family)
                others[ran] = (round(warm_us(fn), 2), round(cold(fn), 2))
            row["others_us"] = others  # family that ran: (warm, cold)
            best = min(others, key=lambda k: others[k][1])
            row["best_other"], row["best_other_warm_us"], row["best_other_cold_us"] = best, *others[best]
            fn = partial(kernels.conv_transpose2d, x, w, b, precision=mode, **kw)
            row["default_warm_us"], row["default_cold_us"] = round(warm_us(fn), 2), round(cold(fn), 2)
            for name, fn in (("cudnn_nchw", partial(F.conv_transpose2d, x0, w, b, **kw)),
                             ("cudnn_cl", partial(F.conv_transpose2d, xcl, wcl, b, **kw))):
                row[f"{name}_warm_us"] = round(cudnn_benchmark(warm_us, fn), 2)
                row[f"{name}_cold_us"] = round(cudnn_benchmark(cold, fn), 2)
        best_cudnn = min(row["cudnn_nchw_cold_us"], row["cudnn_cl_cold_us"])
        row["default_vs_cudnn_cold"] = round(best_cudnn / row["default_cold_us"], 3)
        if "fold_cold_us" in row:
            row["fold_vs_cudnn_cold"] = round(best_cudnn / row["fold_cold_us"], 3)
            row["fold_vs_best_other_cold"] = round(row["best_other_cold_us"] / row["fold_cold_us"], 3)
        rows.append(row)
        print("fold", json.dumps(row), flush=True)
        del x, x0, w, b, xcl, wcl
        torch.cuda.empty_cache()
    torch.backends.cudnn.allow_tf32 = True
    return rows


# The zoo's layers whose 16-bit NCHW rows were below cuDNN's best layout in v32, and a stride-1 one.
NCHW_LAYERS = ("pose-up3", "dcgan64-up3", "pix2pix-u7", "cyclegan-up2", "deconvnet-s1")


def fold_columns(w: torch.Tensor, stride_w: int) -> torch.Tensor:
    """The weights of a layer's column-folded view, ``w'[ci, co * stride_w + r, kh, u] = w[ci, co, kh, u stride_w + r]``
    (zeros past kW). With stride (stride_h, 1), padding (pad_h, 0) and output padding (op_h, 0), the view's output
    column b of channel co * stride_w + r is the layer's output column stride_w * b + r - pad_w (``unfold_columns``):
    every column phase of a channel becomes a column of the GEMM, for any kernel, padding and group count."""
    c_in, cout_g, kh, kw = w.shape
    taps = -(-kw // stride_w)
    padded = F.pad(w, (0, taps * stride_w - kw))
    return padded.view(c_in, cout_g, kh, taps, stride_w).permute(0, 1, 4, 2, 3).reshape(c_in, cout_g * stride_w, kh,
                                                                                       taps).contiguous()


def unfold_columns(y: torch.Tensor, stride_w: int, pad_w: int, w_out: int) -> torch.Tensor:
    """The layer's output from its column-folded view's (``fold_columns``).

    Raises:
        ValueError: the view's columns do not reach the layer's last output column (an output padding past what the
            taps cover: those columns hold only the bias).
    """
    n, c, h, w = y.shape
    if w * stride_w < pad_w + w_out:
        raise ValueError(f"the folded view's {w * stride_w} columns end before column {pad_w + w_out}")
    full = y.reshape(n, c // stride_w, stride_w, h, w).permute(0, 1, 3, 4, 2).reshape(n, c // stride_w, h,
                                                                                     w * stride_w)
    return full[..., pad_w:pad_w + w_out]


def nchw(problems: Sequence[dict]) -> list[dict]:
    timer = _timer()
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    rows = []

    def times(fn: Callable[[], object]) -> dict[str, Any]:
        return {"us": round(timer(fn) * 1e3, 1),
                "kernels": {k: round(v, 1) for k, v in layer_kernels.kernel_times(fn, 20).items()}}

    for p in problems:
        for precision, dtype in (("bf16", torch.bfloat16), ("tf32", torch.float32)):
            x, w, b = zoo.inputs(p, dtype)
            kw = conv_kwargs(p)
            xcl, wcl = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
            mode = "tf32" if dtype == torch.float32 else None
            row: dict[str, Any] = _layer_row(p, precision)
            with torch.no_grad():
                row["ours_nchw"] = times(partial(kernels.conv_transpose2d, x, w, b, precision=mode, **kw))
                row["ours_cl"] = times(partial(kernels.conv_transpose2d, xcl, wcl, b, precision=mode, **kw))
                row["cudnn_nchw"] = times(partial(F.conv_transpose2d, x, w, b, **kw))
                row["cudnn_cl"] = times(partial(F.conv_transpose2d, xcl, wcl, b, **kw))
                sw = p["stride"][1]
                if sw > 1 and p["dilation"][1] == 1:
                    wf = fold_columns(w, sw)
                    bf = b.repeat_interleave(sw) if b is not None else None
                    kf = dict(kw, stride=(p["stride"][0], 1), padding=(p["padding"][0], 0),
                              output_padding=(p["output_padding"][0], 0))
                    y = unfold_columns(kernels.conv_transpose2d(x, wf, bf, precision=mode, **kf), sw,
                                       p["padding"][1], out_shape(p)[3])
                    row["folded_rel_err"] = rel_err(y, F.conv_transpose2d(x.double(), w.double(),
                                                                          None if b is None else b.double(), **kw))
                    row["folded_nchw"] = times(partial(kernels.conv_transpose2d, x, wf, bf, precision=mode, **kf))
                    row["folded_cl"] = times(partial(kernels.conv_transpose2d, xcl,
                                                     wf.contiguous(memory_format=torch.channels_last), bf,
                                                     precision=mode, **kf))
            rows.append(row)
            print("nchw", json.dumps(row), flush=True)
            del x, w, b, xcl, wcl
    return rows


LAYOUT_LAYERS = ("kb57", "kb69", "pix2pix-u7", "pose-up3", "maskhead")


def kernels_in_order(fn: Callable[[], object], reps: int = 5) -> list[tuple[str, float]]:
    """Each kernel ``fn`` launches, in launch order, with the median of its GPU time (us) over ``reps`` calls."""
    prof = layer_kernels.profiled(fn, reps)
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    per = len(events) // reps
    return [(events[i].name, sorted(events[r * per + i].device_time for r in range(reps))[reps // 2])
            for i in range(per)]


def kernel_name(name: str) -> str:
    """A kernel's function name from the profiler's demangled signature (``void ns::(anonymous namespace)::f<T>(...)``
    -> ``f``); other entries (copies, sets) up to their first parenthesis."""
    m = re.search(r"::(\w+)[<(]", name)
    return m.group(1) if m else name.split("(")[0].strip()


def layout_rates(launched: Sequence[tuple[str, float]], x_bytes: int, y_bytes: int) -> dict[str, Any]:
    """The layout changes among a staged gemm call's kernels (layout.cu's transposes: x's first, then y's): time (us)
    and bandwidth (TB/s, each tensor read once and written once)."""
    moves = [t for name, t in launched if kernel_name(name).startswith(("transpose_batched", "transpose_few_channels"))]
    if len(moves) != 2:
        raise ValueError(f"expected x's and y's layout changes, got {len(moves)} in {[n for n, _ in launched]}")
    return {"x_us": round(moves[0], 1), "x_TBps": round(2 * x_bytes / moves[0] / 1e6, 2),
            "y_us": round(moves[1], 1), "y_TBps": round(2 * y_bytes / moves[1] / 1e6, 2)}


def layouts(problems: Sequence[dict]) -> list[dict]:
    rows = []
    for p in problems:
        for precision, dtype in DTYPES.items():
            x, w, b = zoo.inputs(p, dtype)
            run = partial(forward_cuda, x, w, b, _args(p), "tf32", force_path="gemm", force_config=0, force_split=1,
                          force_staged=True)
            with torch.no_grad():
                y, ran = run()
                if ran != "gemm":
                    continue
                launched = kernels_in_order(run)
                dst = torch.empty_like(y)
                copy_us = warm_us(partial(dst.copy_, y))
            row: dict[str, Any] = _layer_row(p, precision)
            row.update(layout_rates(launched, x.numel() * x.element_size(), y.numel() * y.element_size()))
            row["copy_TBps"] = round(2 * y.numel() * y.element_size() / copy_us / 1e6, 2)
            row["kernels_us"] = [(kernel_name(name), round(t, 1)) for name, t in launched]
            rows.append(row)
            print(f"layouts {p['name']:<12} {precision} x {row['x_us']} us {row['x_TBps']} TB/s, y {row['y_us']} us "
                  f"{row['y_TBps']} TB/s (copy {row['copy_TBps']} TB/s)", flush=True)
            del x, w, b, y, dst
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("probe", choices=("staging", "tf32", "host", "kernels", "weights", "narrow", "rounding",
                                      "shuffle", "fold", "nchw", "layouts"))
    ap.add_argument("--only", nargs="*", help="problem names (default: the probe's own set)")
    ap.add_argument("--layouts", nargs="+", choices=("nchw", "cl"), default=["nchw"],
                    help="the input layouts of our calls (the fold probe)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    every = zoo_problems() + kernelbench_problems()
    if a.probe == "tf32":
        chosen = [p for p in kernelbench_problems() if not a.only or p["name"] in a.only]
    elif a.probe == "shuffle":
        chosen = [p for p in shuffle_problems() if not a.only or p["name"] in a.only]
    elif a.probe == "fold":
        chosen = [p for p in fold_problems() if not a.only or p["name"] in a.only]
    elif a.probe == "nchw" and not a.only:
        chosen = [p for p in every if p["name"] in NCHW_LAYERS]
    elif a.probe == "layouts" and not a.only:
        chosen = [p for p in every if p["name"] in LAYOUT_LAYERS]
    elif a.only:
        chosen = [p for p in every if p["name"] in a.only]
    elif a.probe == "kernels":  # small layers whose library call took much longer than the served call
        chosen = [p for p in every if p["name"] in ("pix2pix-u2", "pose-up1", "stylegan2-up32", "dcgan64-up1",
                                                    "deconvnet-s1")]
    elif a.probe == "host":  # layers whose GPU time is tens of microseconds
        chosen = [p for p in every if p["name"] in ("fcn8s-up2", "dcgan64-z", "pix2pix-u2", "dcgan64-up1",
                                                    "deconvnet-s1", "dcgan64-up2")]
    else:
        chosen = every
    rows = {"staging": staging, "tf32": tf32, "host": host, "kernels": kernel_times, "weights": weights,
            "narrow": narrow, "rounding": rounding, "shuffle": shuffle, "fold": partial(fold, layouts=a.layouts),
            "nchw": nchw, "layouts": layouts}[a.probe](chosen)
    doc = {"probe": a.probe, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "rows": rows}
    if a.out:
        write(a.out, doc)


if __name__ == "__main__":
    main()
