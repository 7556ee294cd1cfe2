"""The gemm kernel's tile configurations and split-K factors on the zoo layers and KernelBench's problems (kb<id>),
against the default kernel choice and cuDNN (NCHW and channels-last, cudnn.benchmark on), in one run: where each
configuration wins, for fitting the dispatcher's rule (kernels/csrc/conv_transpose2d_gemm.cu, gemm_config /
gemm_split) and bench/NOTES.md.

    python -m bench.kernels.gemm_probe --precisions bf16 tf32 --only unet-up1 pose-up1 kb57
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.harness import Timer, rel_err
from bench.kernels.layer_zoo import ZOO, problem
from bench.kernels.problems import kernelbench_problems
from kernels.internal import forward_cuda, load_extension, normalize_args

DTYPES = {"tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"tf32": 2e-3, "bf16": 2e-2, "fp16": 2e-2}


def _pair(v: int | list[int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (v[0], v[1])


def problems() -> list[dict]:
    """The zoo's layers (layer_zoo.py's form) and KernelBench's problems (problems.py's: pairs as lists)."""
    out = [problem(entry) for entry in ZOO]
    for q in kernelbench_problems():
        kh, kw = q["kernel_size"]
        macs = q["batch"] * q["height"] * q["width"] * kh * kw * q["in_channels"] * (q["out_channels"] // q["groups"])
        out.append(dict(q, gflop=2 * macs / 1e9))
    return out


def measure(q: dict, prec: str, layouts: list[str], splits: list[int], timer: Timer) -> list[dict]:
    """One zoo layer in one precision: cuDNN's two layouts, our default choice and every gemm configuration x split,
    for each input layout."""
    args = normalize_args(q["stride"], q["padding"], q["output_padding"], q["groups"], q["dilation"])
    dtype = DTYPES[prec]
    torch.backends.cudnn.allow_tf32 = True
    g = torch.Generator(device="cuda").manual_seed(0)
    kh, kw = _pair(q["kernel_size"])
    x0 = torch.randn(q["batch"], q["in_channels"], q["height"], q["width"], device="cuda", generator=g).to(dtype)
    w = (torch.randn(q["in_channels"], q["out_channels"] // q["groups"], kh, kw, device="cuda", generator=g)
         / (q["in_channels"] * kh * kw) ** 0.5).to(dtype)
    b = torch.randn(q["out_channels"], device="cuda", generator=g).to(dtype) if q["bias"] else None
    ref = F.conv_transpose2d(x0.double(), w.double(), None if b is None else b.double(), args.stride, args.padding,
                             args.output_padding, args.groups, args.dilation)
    w_cl = w.contiguous(memory_format=torch.channels_last)
    x_cl = x0.contiguous(memory_format=torch.channels_last)

    def cudnn(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        return F.conv_transpose2d(x, wt, b, args.stride, args.padding, args.output_padding, args.groups,
                                  args.dilation)

    torch.backends.cudnn.benchmark = True
    try:
        c_nchw = timer(lambda: cudnn(x0, w))
        c_cl = timer(lambda: cudnn(x_cl, w_cl))
    finally:
        torch.backends.cudnn.benchmark = False
    rows = []
    for layout in layouts:
        x = x_cl if layout == "cl" else x0

        def ours(path: str | None, config: int | None, split: int | None, x: torch.Tensor = x) -> str:
            return forward_cuda(x, w, b, args, "tf32", force_path=path, force_config=config, force_split=split)[1]

        y, ran = forward_cuda(x, w, b, args, "tf32")
        res = {f"default:{ran}": timer(lambda ours=ours: ours(None, None, None))}
        errs = {"default": rel_err(y, ref)}
        for c in range(int(load_extension().num_gemm_configs)):
            for s in splits:
                y, ran = forward_cuda(x, w, b, args, "tf32", force_path="gemm", force_config=c, force_split=s)
                if ran != "gemm":
                    break
                errs[f"gemm{c}/s{s}"] = rel_err(y, ref)
                res[f"gemm{c}/s{s}"] = timer(lambda ours=ours, c=c, s=s: ours("gemm", c, s))
        best = min(res, key=lambda key: res[key])
        rows.append({"name": q["name"], "precision": prec, "layout": layout, "gflop": round(q["gflop"], 3),
                     "cudnn_nchw_ms": round(c_nchw, 4), "cudnn_cl_ms": round(c_cl, 4),
                     "times": {key: round(v, 4) for key, v in res.items()}, "best": best,
                     "speedup": round(min(c_nchw, c_cl) / res[best], 3), "max_err": max(errs.values()),
                     "correct": max(errs.values()) <= TOL[prec]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precisions", nargs="+", default=["bf16", "tf32"], choices=list(DTYPES))
    ap.add_argument("--layouts", nargs="+", default=["cl", "nchw"], choices=["cl", "nchw"])
    ap.add_argument("--only", nargs="*", help="zoo layer names")
    ap.add_argument("--splits", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path, help="JSON lines file")
    a = ap.parse_args()
    timer = Timer(a.reps, 2)
    rows = []
    for q in problems():
        if a.only and q["name"] not in a.only:
            continue
        for prec in a.precisions:
            rows += measure(q, prec, a.layouts, a.splits, timer)
    if a.out:
        a.out.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    print(f"{'layer':16s} {'prec':5s} {'lay':4s} {'cuDNN':>8s} {'default':>17s} {'best gemm':>17s} {'x':>6s}")
    for r in rows:
        d = next(k for k in r["times"] if k.startswith("default"))
        gm = {k: v for k, v in r["times"].items() if k.startswith("gemm")}
        bg = min(gm, key=lambda k: gm[k]) if gm else "-"
        print(f"{r['name']:16s} {r['precision']:5s} {r['layout']:4s} {min(r['cudnn_nchw_ms'], r['cudnn_cl_ms']):8.4f} "
              f"{d[8:]:>8s} {r['times'][d]:8.4f} {bg:>8s} {gm.get(bg, float('nan')):8.4f} {r['speedup']:6.2f}"
              f"{'' if r['correct'] else '  WRONG'}")


if __name__ == "__main__":
    main()
