"""Whole decoders under torch.compile: our operator against cuDNN, the same model compiled both ways, in one run.

Models (``--models``): ``dcgan`` (the DCGAN 64 px generator: a latent [N, 100, 1, 1] through five transposed
convolutions with batch norm and ReLU, Tanh last) and ``unet`` (a U-Net decoder: four 2x2 up-convolutions from
[N, 1024, 28, 28], each followed by two 3x3 convolutions with ReLU). Each is built once (seeded), in eval mode,
in the row's dtype and layout; ``ours`` is that model through ``kernels.convert``, ``cudnn`` the same weights with
PyTorch's modules (``cudnn.benchmark`` on). Both are compiled with ``torch.compile(fullgraph=True, mode=...)``.
``--choice``: our kernel choice, ``default`` (the dispatcher's rule: what a library user gets) or ``measured``
(``kernels.tuning``, as cuDNN's benchmark mode measures its own); the row says which.

Per model, dtype, layout and mode: the first call's seconds (compilation), then ``warm_ms`` (forward passes back to
back, per pass) and ``cold_ms`` (one pass after a write of twice the L2 size, median), timed by bench/harness.py's
``warm_us`` and ``ColdTimer`` as bench/kernels/call_cost.py times one call, and ours against a float64 run of the same
weights next to cuDNN's error.

    python -m bench.kernels.compiled_models --models dcgan --dtypes bf16 --layouts nchw
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

import kernels
from bench.harness import ColdTimer, short_slug, warm_us, write

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}


def dcgan(batch: int) -> tuple[nn.Module, tuple[int, ...]]:
    def up(c_in: int, c_out: int, stride: int, padding: int) -> list[nn.Module]:
        return [nn.ConvTranspose2d(c_in, c_out, 4, stride, padding, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]

    layers = [*up(100, 512, 1, 0), *up(512, 256, 2, 1), *up(256, 128, 2, 1), *up(128, 64, 2, 1),
              nn.ConvTranspose2d(64, 3, 4, 2, 1, bias=False), nn.Tanh()]
    return nn.Sequential(*layers), (batch, 100, 1, 1)


def unet_decoder(batch: int) -> tuple[nn.Module, tuple[int, ...]]:
    layers: list[nn.Module] = []
    for c in (1024, 512, 256, 128):
        layers += [nn.ConvTranspose2d(c, c // 2, 2, 2), nn.Conv2d(c // 2, c // 2, 3, padding=1), nn.ReLU(),
                   nn.Conv2d(c // 2, c // 2, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers), (batch, 1024, 28, 28)


MODELS: dict[str, Callable[[int], tuple[nn.Module, tuple[int, ...]]]] = {"dcgan": dcgan, "unet": unet_decoder}
BATCH = {"dcgan": 128, "unet": 4}


def run(name: str, dtype_name: str, layout: str, mode: str | None, choice: str, cold: ColdTimer) -> dict:
    torch._dynamo.reset()  # every row compiles afresh (and the models share nn.Sequential's code: no recompile limit)
    torch.manual_seed(0)
    model, shape = MODELS[name](BATCH[name])
    model = model.cuda().eval()
    dtype = DTYPES[dtype_name]
    fmt = torch.channels_last if layout == "cl" else torch.contiguous_format
    x = torch.randn(shape, device="cuda").to(dtype).contiguous(memory_format=fmt)
    ref64 = copy.deepcopy(model).double()
    cudnn = model.to(dtype).to(memory_format=fmt)
    ours = kernels.convert(copy.deepcopy(cudnn))
    row: dict = {"model": name, "dtype": dtype_name, "layout": layout, "mode": mode or "default",
                 "choice": choice, "input": list(shape)}
    kernels.tuning.enable(choice == "measured")
    with torch.no_grad():
        ref = ref64(x.double())
        for label, module in (("cudnn", cudnn), ("ours", ours)):
            compiled = torch.compile(module, fullgraph=True, mode=mode)
            t0 = time.perf_counter()
            y = compiled(x)
            torch.cuda.synchronize()
            row[f"{label}_compile_s"] = round(time.perf_counter() - t0, 1)
            row[f"{label}_rel_err"] = float(f"{float((y.double() - ref).norm() / ref.norm()):.3e}")
            row[f"{label}_warm_ms"] = round(warm_us(lambda c=compiled: c(x)) * 1e-3, 4)
            row[f"{label}_cold_ms"] = round(cold(lambda c=compiled: c(x)) * 1e-3, 4)
    row["warm_speedup"] = round(row["cudnn_warm_ms"] / row["ours_warm_ms"], 3)
    row["cold_speedup"] = round(row["cudnn_cold_ms"] / row["ours_cold_ms"], 3)
    return row


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    ap.add_argument("--layouts", nargs="+", default=["nchw", "cl"], choices=["nchw", "cl"])
    ap.add_argument("--modes", nargs="+", default=["default"], choices=["default", "reduce-overhead"])
    ap.add_argument("--choices", nargs="+", default=["default"], choices=["default", "measured"],
                    help="our kernel choice: the dispatcher's rule, or measured (kernels.tuning)")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.kernels.compiled_models needs a CUDA GPU")
    torch.backends.cudnn.benchmark = True
    cold = ColdTimer()
    rows = []
    for name in args.models:
        for dt in args.dtypes:
            for layout in args.layouts:
                for mode, choice in itertools.product(args.modes, args.choices):
                    rows.append(run(name, dt, layout, None if mode == "default" else mode, choice, cold))
                    r = rows[-1]
                    print(f"{name} {dt} {layout} {r['mode']} {choice}: warm {r['ours_warm_ms']} / "
                          f"{r['cudnn_warm_ms']} ms "
                          f"({r['warm_speedup']}x), cold {r['ours_cold_ms']} / {r['cudnn_cold_ms']} ms "
                          f"({r['cold_speedup']}x), err {r['ours_rel_err']} / {r['cudnn_rel_err']}, compile "
                          f"{r['ours_compile_s']} / {r['cudnn_compile_s']} s", flush=True)
    device = torch.cuda.get_device_name(0)
    out = args.out / f"compiled_models-{short_slug(device)}.json"
    write(out, {"device": device, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                    "rows": rows})
    print(json.dumps(rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
