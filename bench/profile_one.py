"""Run one KernelBench problem once with a forced tile configuration: the target for ncu / compute-sanitizer.

    ncu --section WarpStateStats -k regex:halo python bench/profile_one.py --id 57 --mode tf32 --config 5
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kernelbench import PROBLEMS  # noqa: E402
from kernels.functional import _forward_cuda, normalize_args  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--id", type=int, required=True)
    ap.add_argument("--mode", choices=["tf32", "fp32", "bf16"], default="tf32")
    ap.add_argument("--config", type=int, default=-1, help="tensor-core configuration (-1: the heuristic's)")
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    p = next(q for q in json.loads(PROBLEMS.read_text())["problems"] if q["id"] == args.id)
    dtype = torch.bfloat16 if args.mode == "bf16" else torch.float32
    kh, kw = p["kernel_size"]
    x = torch.randn(p["batch"], p["in_channels"], p["height"], p["width"], device="cuda").to(dtype)
    w = torch.randn(p["in_channels"], p["out_channels"] // p["groups"], kh, kw, device="cuda").to(dtype)
    conv_args = normalize_args(tuple(p["stride"]), tuple(p["padding"]), tuple(p["output_padding"]), p["groups"],
                               tuple(p["dilation"]))
    force = dict(force_path="tensor_core", force_config=args.config) if args.config >= 0 else {}
    for _ in range(args.runs):
        _forward_cuda(x, w, None, conv_args, "fp32" if args.mode == "fp32" else "tf32", **force)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
