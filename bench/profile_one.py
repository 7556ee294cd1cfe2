"""Run one KernelBench problem or bundled layer with a forced kernel: the target for ncu / compute-sanitizer.

    ncu --section WarpStateStats -k regex:halo python bench/profile_one.py --id 57 --mode tf32 --config 5
    ncu -k regex:halo python bench/profile_one.py --layer dcgan_up1 --batch 64 --config 5 --split 1
    ncu -k regex:dgrad python bench/profile_one.py --layer dcgan_up1 --batch 64 --cudnn
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kernelbench import PROBLEMS  # noqa: E402
from kernels._ops import _forward_cuda, normalize_args  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--id", type=int, help="KernelBench problem id")
    what.add_argument("--layer", help="a bundled layer (layers/NAME.json), in its own dtype")
    ap.add_argument("--batch", type=int, default=1, help="--layer: batch size")
    ap.add_argument("--hw", type=int, default=32, help="--layer: input H = W")
    ap.add_argument("--mode", choices=["tf32", "fp32", "bf16"], default="tf32", help="--id: precision mode")
    ap.add_argument("--config", type=int, default=-1, help="tensor-core configuration (-1: the heuristic's)")
    ap.add_argument("--split", type=int, help="the halo kernel's split-K factor (default: the heuristic's)")
    ap.add_argument("--cudnn", action="store_true", help="run F.conv_transpose2d (cuDNN) instead")
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    if args.id is not None:
        p = next(q for q in json.loads(PROBLEMS.read_text())["problems"] if q["id"] == args.id)
        dtype = torch.bfloat16 if args.mode == "bf16" else torch.float32
        precision = "fp32" if args.mode == "fp32" else "tf32"
        shape = (p["batch"], p["in_channels"], p["height"], p["width"])
    else:
        p = json.loads((ROOT / "layers" / f"{args.layer}.json").read_text())
        dtype = getattr(torch, p["dtype"])
        precision = p.get("precision", "tf32") if dtype == torch.float32 else "tf32"
        shape = (args.batch, p["in_channels"], args.hw, args.hw)
    kh, kw = p["kernel_size"]
    x = torch.randn(shape, device="cuda").to(dtype)
    w = torch.randn(p["in_channels"], p["out_channels"] // p["groups"], kh, kw, device="cuda").to(dtype)
    conv_args = normalize_args(tuple(p["stride"]), tuple(p["padding"]), tuple(p["output_padding"]), p["groups"],
                               tuple(p["dilation"]))
    force: dict = dict(force_path="tensor_core", force_config=args.config) if args.config >= 0 else {}
    if args.split is not None:
        force["force_split"] = args.split
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    for _ in range(args.runs):
        if args.cudnn:
            F.conv_transpose2d(x, w, None, conv_args.stride, conv_args.padding, conv_args.output_padding,
                               conv_args.groups, conv_args.dilation)
        else:
            _forward_cuda(x, w, None, conv_args, precision, **force)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
