"""Every tensor-core tile configuration on the KernelBench problems: the measurements behind the tile heuristic.

For each problem and precision mode it runs the kernel with each configuration forced (0-3: gather kernel,
4-13: halo kernel, 9-12 its warp-specialized wgmma tiles on sm_90), checks the output against a float64
reference, and times it (CUDA events, L2 flush, median), next to the configuration the heuristic picks and cuDNN
in the same run.

    python -m bench.kernels.sweep --modes tf32 bf16 --ids 57 69 --out sweep.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.harness import Timer, rel_err, write
from bench.kernels.kernelbench import PROBLEMS, TOL
from kernels.internal import forward_cuda, load_extension, normalize_args


def sweep_problem(p: dict, mode: str, timer: Timer) -> dict:
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    precision = "fp32" if mode == "fp32" else "tf32"
    torch.backends.cudnn.allow_tf32 = mode != "fp32"
    g = torch.Generator(device="cuda").manual_seed(p["id"])
    shape = (p["batch"], p["in_channels"], p["height"], p["width"])
    kh, kw = p["kernel_size"]
    x = torch.randn(shape, device="cuda", generator=g).to(dtype)
    w = torch.randn(p["in_channels"], p["out_channels"] // p["groups"], kh, kw, device="cuda", generator=g).to(dtype)
    b = torch.randn(p["out_channels"], device="cuda", generator=g).to(dtype)
    args = normalize_args(tuple(p["stride"]), tuple(p["padding"]), tuple(p["output_padding"]), p["groups"],
                          tuple(p["dilation"]))
    kw_ = dict(stride=args.stride, padding=args.padding, output_padding=args.output_padding, groups=p["groups"],
               dilation=args.dilation)
    with torch.no_grad():
        ref = F.conv_transpose2d(x.double(), w.double(), b.double(), **kw_)
        row: dict = {"id": p["id"], "precision": mode, "configs": {}}
        _, path = forward_cuda(x, w, b, args, precision)
        row["default_ms"] = round(timer(lambda: forward_cuda(x, w, b, args, precision)), 4)
        row["default_path"] = path
        for c in range(num_configs()):
            try:
                y, _ = forward_cuda(x, w, b, args, precision, force_path="tensor_core", force_config=c)
            except RuntimeError as exc:  # shared memory does not fit this problem
                row["configs"][c] = {"error": str(exc).splitlines()[0][:80]}
                continue
            err = rel_err(y, ref)
            del y
            ms = timer(lambda c=c: forward_cuda(x, w, b, args, precision, force_path="tensor_core",
                                                 force_config=c))
            row["configs"][c] = {"ms": round(ms, 4), "rel_err": err, "correct": err <= TOL[mode]}
        del ref
        row["cudnn_ms"] = round(timer(lambda: F.conv_transpose2d(x, w, b, **kw_)), 4)
    torch.backends.cudnn.allow_tf32 = True
    return row


def num_configs() -> int:
    """Tensor-core tile configurations the built extension has."""
    return int(load_extension().num_tensor_core_configs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["tf32", "fp32", "bf16"], choices=["tf32", "fp32", "bf16"])
    ap.add_argument("--ids", nargs="+", type=int, help="problem ids (default: all seven)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args()
    problems = [p for p in json.loads(PROBLEMS.read_text())["problems"] if not args.ids or p["id"] in args.ids]
    timer = Timer(args.reps, 2)
    rows = []
    print(f"{'id':>3} {'mode':>4} {'cuDNN':>8} {'default':>8}  " + " ".join(f"{'c' + str(c):>7}" for c in
                                                                      range(num_configs())), flush=True)
    for mode in args.modes:
        for p in problems:
            r = sweep_problem(p, mode, timer)
            rows.append(r)
            cells = []
            for c in range(num_configs()):
                e = r["configs"][c]
                cells.append(f"{'-':>7}" if "ms" not in e else f"{e['ms']:7.3f}" + ("" if e["correct"] else "!"))
            print(f"{r['id']:>3} {mode:>4} {r['cudnn_ms']:8.3f} {r['default_ms']:8.3f}  " + " ".join(cells),
                  flush=True)
    if args.out:
        write(args.out, {"device": torch.cuda.get_device_name(0), "rows": rows})


if __name__ == "__main__":
    main()
