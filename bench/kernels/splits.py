"""The halo kernel's split-K factors on the service's bundled layers: the measurements behind ``halo_split``.

For every layer in layers/ at each batch (H = W = ``--hw``) it runs the kernel with the default choice and with
each split factor forced (1, 2, 4, 8 blocks of a cluster per tile), checks every output against a float64
reference, and times each (CUDA events, L2 flush, median of ``--reps``) next to cuDNN in the same run. Layers that
do not run the halo kernel (narrow, gather) ignore the forced split, so their columns agree within noise.

With ``--config N`` every split column runs tensor-core tile configuration N instead (the "default" column stays
the dispatcher's own choice), and ``--layers`` keeps only the named layers.

    python -m bench.kernels.splits --batches 1 8 64 --out splits.json
    python -m bench.kernels.splits --config 13 --layers dcgan_up3 dcgan_rgb --batches 1 8
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.harness import Timer, rel_err, write
from bench.kernels.kernelbench import TOL, bundled_layers
from kernels.internal import forward_cuda, normalize_args, resolve_precision

SPLITS = (None, 1, 2, 4, 8)  # None: the default choice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hw", type=int, default=32, help="input H = W (kernelbench.py's bundled-layer table)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--config", type=int, help="tensor-core tile configuration of the split columns")
    ap.add_argument("--layers", nargs="+", help="only these layers (default: all)")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args()
    timer = Timer(reps=args.reps, warmup=5)
    tile = "" if args.config is None else f"tc{args.config}/"
    names = ["default" if s is None else f"{tile}split {s}" for s in SPLITS]
    print(f"{'layer':16s} {'batch':>5s} " + " ".join(f"{n:>8s}" for n in names) + f" {'cuDNN':>8s}  (us)  path")
    rows = []
    for cfg, w, b, kw, prec in bundled_layers():
        if args.layers and cfg["name"] not in args.layers:
            continue
        conv = normalize_args(kw["stride"], kw["padding"], kw["output_padding"], cfg["groups"], kw["dilation"])
        precision = resolve_precision(w.dtype, prec)
        tol = TOL[precision] if w.dtype == torch.float32 else TOL["bf16"]  # 16-bit inputs: bf16's 2e-2
        for n in args.batches:
            x = torch.rand(n, cfg["in_channels"], args.hw, args.hw, device="cuda").to(w.dtype)
            times: dict[str, float] = {}
            with torch.no_grad():
                ref = F.conv_transpose2d(x.double(), w.double(), None if b is None else b.double(),
                                         groups=cfg["groups"], **kw)
                for name, split in zip(names, SPLITS, strict=True):
                    forced = {} if split is None else {"force_split": split, "force_config": args.config,
                                                        "force_path": None if args.config is None else "tensor_core"}
                    fn = partial(forward_cuda, x, w, b, conv, precision, **forced)
                    y, path = fn()
                    err = rel_err(y, ref)
                    if not err <= tol:
                        raise SystemExit(f"{cfg['name']} batch {n} {name}: relative error {err:.3e}")
                    times[name] = timer(fn) * 1e3
                torch.backends.cudnn.allow_tf32 = prec != "fp32"
                times["cudnn"] = timer(partial(F.conv_transpose2d, x, w, b, groups=cfg["groups"], **kw)) * 1e3
                torch.backends.cudnn.allow_tf32 = True
            rows.append({"layer": cfg["name"], "batch": n, "hw": args.hw, "path": path, "us": times})
            print(f"{cfg['name']:16s} {n:5d} " + " ".join(f"{times[k]:8.1f}" for k in [*names, "cudnn"])
                  + f"  {path}", flush=True)
    if args.out:
        doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "reps": args.reps,
               "config": args.config, "rows": rows}
        write(args.out, doc, indent=2)


if __name__ == "__main__":
    main()
