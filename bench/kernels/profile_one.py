"""Run one KernelBench problem, bundled layer or zoo layer with a forced kernel: the target for ncu /
compute-sanitizer.

    ncu --section WarpStateStats -k regex:halo python -m bench.kernels.profile_one --id 57 --mode tf32 --config 5
    ncu -k regex:halo python -m bench.kernels.profile_one --layer dcgan_up1 --batch 64 --config 5 --split 1
    ncu -k regex:dgrad python -m bench.kernels.profile_one --layer dcgan_up1 --batch 64 --cudnn
    ncu --profile-from-start off -k regex:gemm_kernel python -m bench.kernels.profile_one --zoo unet-up1 --mode bf16 \\
        --layout cl

The calls run once outside the profiler's range first (cuDNN in benchmark mode picks its algorithm
there, our packed weights and tuner settle), then ``--runs`` calls inside ``torch.cuda.profiler.start()`` /
``stop()``: run ncu with ``--profile-from-start off`` to see only those.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.kernels.kernelbench import PROBLEMS
from bench.kernels.layer_zoo import ZOO, problem
from bench.kernels.problems import DTYPES
from kernels.internal import forward_cuda, normalize_args

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--id", type=int, help="KernelBench problem id")
    what.add_argument("--layer", help="a bundled layer (layers/NAME.json), in its own dtype")
    what.add_argument("--zoo", help="a layer of bench/kernels/layer_zoo.py, in --mode's precision and --layout")
    ap.add_argument("--batch", type=int, default=1, help="--layer: batch size")
    ap.add_argument("--hw", type=int, default=32, help="--layer: input H = W")
    ap.add_argument("--mode", choices=list(DTYPES), default="tf32", help="--id / --zoo: precision mode")
    ap.add_argument("--layout", choices=["nchw", "cl"], default="nchw", help="--id / --zoo: the input's layout")
    ap.add_argument("--path", help="force a kernel family (tensor_core, gemm, narrow, sparse, simt)")
    ap.add_argument("--config", type=int, default=-1, help="tile configuration (-1: the heuristic's)")
    ap.add_argument("--split", type=int, help="split-K factor (default: the heuristic's)")
    ap.add_argument("--cudnn", action="store_true", help="run F.conv_transpose2d (cuDNN) instead")
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    dtype = DTYPES[args.mode]
    precision = "fp32" if args.mode == "fp32" else "tf32"
    if args.zoo is not None:
        q = problem(next(e for e in ZOO if e[0] == args.zoo))
        k = q["kernel_size"]
        p = {**q, "kernel_size": [k, k], "stride": [q["stride"]] * 2, "padding": [q["padding"]] * 2,
             "output_padding": [q["output_padding"]] * 2, "dilation": [q["dilation"]] * 2}
        shape = (q["batch"], q["in_channels"], q["height"], q["width"])
    elif args.id is not None:
        p = next(q for q in json.loads(PROBLEMS.read_text())["problems"] if q["id"] == args.id)
        shape = (p["batch"], p["in_channels"], p["height"], p["width"])
    else:
        p = json.loads((ROOT / "layers" / f"{args.layer}.json").read_text())
        dtype = getattr(torch, p["dtype"])
        precision = p.get("precision", "tf32") if dtype == torch.float32 else "tf32"
        shape = (args.batch, p["in_channels"], args.hw, args.hw)
    kh, kw = p["kernel_size"]
    x = torch.randn(shape, device="cuda").to(dtype)
    w = torch.randn(p["in_channels"], p["out_channels"] // p["groups"], kh, kw, device="cuda").to(dtype)
    if args.layout == "cl":
        x = x.contiguous(memory_format=torch.channels_last)
        w = w.contiguous(memory_format=torch.channels_last)
    conv_args = normalize_args(tuple(p["stride"]), tuple(p["padding"]), tuple(p["output_padding"]), p["groups"],
                               tuple(p["dilation"]))
    force: dict = {}
    if args.config >= 0:
        force = dict(force_path=args.path or "tensor_core", force_config=args.config)
    elif args.path:
        force = dict(force_path=args.path)
    if args.split is not None:
        force["force_split"] = args.split
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.benchmark = True

    def call() -> None:
        if args.cudnn:
            F.conv_transpose2d(x, w, None, conv_args.stride, conv_args.padding, conv_args.output_padding,
                               conv_args.groups, conv_args.dilation)
        else:
            forward_cuda(x, w, None, conv_args, precision, **force)

    call()  # outside the profiled range: algorithm selection, first-call work
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(args.runs):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
