"""Every kernel family forced on the service's bundled layers: the measurements behind the path choice.

For each bundled layer (layers/*.json) at batch 1, 8 and 64 it runs the narrow, sparse, tensor-core and SIMT kernels
forced (when the problem is eligible for them), checks each output against float64, and times each (CUDA events,
L2 flush, median) next to the default choice and cuDNN in the same run.

    python -m bench.kernels.paths --hw 32 --out paths.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from bench.harness import Timer, rel_err, write
from kernels.internal import forward_cuda, normalize_args

ROOT = Path(__file__).resolve().parents[2]

PATHS = ("narrow", "sparse", "tensor_core", "simt")
TOLERANCES = {"fp32": 1e-5, "tf32": 2e-3, None: 2e-2}


def run_layer(cfg: dict, n: int, hw: int, timer: Timer) -> dict:
    dtype = getattr(torch, cfg["dtype"])
    tensors = load_file(str(ROOT / "layers" / f"{cfg['name']}.safetensors"), device="cuda")
    w, b = tensors["weight"].to(dtype), tensors.get("bias")
    b = b.to(dtype) if b is not None else None
    prec = cfg.get("precision") if dtype == torch.float32 else None
    args = normalize_args(tuple(cfg["stride"]), tuple(cfg["padding"]), tuple(cfg["output_padding"]), cfg["groups"],
                          tuple(cfg["dilation"]))
    kw = dict(stride=args.stride, padding=args.padding, output_padding=args.output_padding, groups=cfg["groups"],
              dilation=args.dilation)
    x = torch.rand(n, cfg["in_channels"], hw, hw, device="cuda").to(dtype)
    precision = prec or "fp32"
    row: dict = {"layer": cfg["name"], "batch": n, "hw": hw, "dtype": cfg["dtype"], "precision": prec, "paths": {}}
    with torch.no_grad():
        ref = F.conv_transpose2d(x.double(), w.double(), None if b is None else b.double(), **kw)
        _, row["default_path"] = forward_cuda(x, w, b, args, precision)
        row["default_ms"] = round(timer(lambda: forward_cuda(x, w, b, args, precision)), 4)
        for path in PATHS:
            y, ran = forward_cuda(x, w, b, args, precision, force_path=path)
            if ran != path:  # not eligible: the dispatcher fell back
                continue
            err = rel_err(y, ref)
            ms = timer(lambda path=path: forward_cuda(x, w, b, args, precision, force_path=path))
            row["paths"][path] = {"ms": round(ms, 4), "rel_err": err, "correct": err <= TOLERANCES[prec]}
        torch.backends.cudnn.allow_tf32 = prec != "fp32"
        row["cudnn_ms"] = round(timer(lambda: F.conv_transpose2d(x, w, b, **kw)), 4)
        torch.backends.cudnn.allow_tf32 = True
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hw", type=int, default=32, help="input height and width")
    ap.add_argument("--layers", nargs="+", help="layer names (default: every bundled layer)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args()
    timer = Timer(args.reps, 3)
    rows = []
    print(f"{'layer':<16} {'N':>3} {'cuDNN':>8} {'default':>8} {'path':<12} "
          + " ".join(f"{p:>11}" for p in PATHS), flush=True)
    for cfg_path in sorted((ROOT / "layers").glob("*.json")):
        cfg = json.loads(cfg_path.read_text())
        if args.layers and cfg["name"] not in args.layers:
            continue
        for n in (1, 8, 64):
            r = run_layer(cfg, n, args.hw, timer)
            rows.append(r)
            cells = []
            for p in PATHS:
                e = r["paths"].get(p)
                cells.append(f"{'-':>11}" if e is None else f"{e['ms']:10.4f}" + (" " if e["correct"] else "!"))
            print(f"{r['layer']:<16} {n:>3} {r['cudnn_ms']:8.4f} {r['default_ms']:8.4f} {r['default_path']:<12} "
                  + " ".join(cells), flush=True)
    if args.out:
        write(args.out, {"device": torch.cuda.get_device_name(0), "rows": rows})


if __name__ == "__main__":
    main()
