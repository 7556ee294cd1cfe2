"""KernelBench's seven ConvTranspose2d problems: this project's kernels against cuDNN, in one run on one GPU.

For every problem and precision mode it builds the problem's ``Model`` from its init_args, makes ``ModelNew``
with ``kernels.convert``, checks ModelNew on 5 fresh inputs against a float64 reference, then times ModelNew,
cuDNN (NCHW, PyTorch's default) and cuDNN with channels_last tensors with CUDA events: warm-up, an L2 flush
before every timed run, the median of ``--reps`` runs. The floor is max(FLOPs / matrix rate, bytes / copy
bandwidth) with both ceilings measured at the start of the same run.

Ours is timed twice: with the dispatcher's default choice (``ours_default_ms``) and, unless ``--no-tune``, with
measured kernel choice (kernels.tuning, what the service runs; ``ours_ms``, ``choice``), each checked on the fresh
inputs. cuDNN likewise: PyTorch's default (``cudnn_ms``, the speedup target's reference) and with
``torch.backends.cudnn.benchmark`` (``cudnn_benchmark_ms``), its own measured choice.

    python -m bench.kernels.kernelbench                       # tf32, fp32 (exact) and bf16; table + JSON
    python -m bench.kernels.kernelbench --modes tf32 --ids 57 75 --compile
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from bench.harness import Timer, cudnn_benchmark, device_slug, rel_err, write
from kernels.functional import (
    ConvArgs,
    normalize_args,
    output_size,
    resolve_precision,
)
from kernels.internal import forward_cuda
from kernels.tuning import KernelChoice
from service.engine.ops import WeightPacks

ROOT = Path(__file__).resolve().parents[2]
PROBLEMS = Path(__file__).with_name("kernelbench_conv_transpose2d.json")
TOL = {"tf32": 2e-3, "fp32": 1e-5, "bf16": 2e-2}


class Model(nn.Module):
    """KernelBench's model: one nn.ConvTranspose2d built from the problem's init_args."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__()
        self.conv_transpose2d = nn.ConvTranspose2d(**kwargs)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_transpose2d(x)


def init_args(p: dict) -> dict:
    """The problem's constructor arguments by name (the rest keep nn.ConvTranspose2d's defaults)."""
    return {a: tuple(p[a]) if isinstance(p[a], list) else p[a] for a in p["init_args"]}


def useful_flops(p: dict) -> int:
    """2 x multiply-adds whose product lands inside the output (taps on padding excluded)."""

    def pairs(n_in: int, k: int, s: int, pad: int, d: int, out: int) -> int:
        # (input position i, tap a) with 0 <= i * s - pad + a * d < out
        total = 0
        for a in range(k):
            lo = max(0, math.ceil((pad - a * d) / s))
            hi = min(n_in - 1, (out - 1 + pad - a * d) // s)
            total += max(0, hi - lo + 1)
        return total

    ho = output_size(p["height"], p["kernel_size"][0], p["stride"][0], p["padding"][0], p["output_padding"][0],
                     p["dilation"][0])
    wo = output_size(p["width"], p["kernel_size"][1], p["stride"][1], p["padding"][1], p["output_padding"][1],
                     p["dilation"][1])
    ph = pairs(p["height"], p["kernel_size"][0], p["stride"][0], p["padding"][0], p["dilation"][0], ho)
    pw = pairs(p["width"], p["kernel_size"][1], p["stride"][1], p["padding"][1], p["dilation"][1], wo)
    return 2 * p["batch"] * p["in_channels"] * (p["out_channels"] // p["groups"]) * ph * pw


def min_bytes(p: dict, elem: int) -> int:
    ho = output_size(p["height"], p["kernel_size"][0], p["stride"][0], p["padding"][0], p["output_padding"][0],
                     p["dilation"][0])
    wo = output_size(p["width"], p["kernel_size"][1], p["stride"][1], p["padding"][1], p["output_padding"][1],
                     p["dilation"][1])
    x = p["batch"] * p["in_channels"] * p["height"] * p["width"]
    w = p["in_channels"] * (p["out_channels"] // p["groups"]) * p["kernel_size"][0] * p["kernel_size"][1]
    y = p["batch"] * p["out_channels"] * ho * wo
    return (x + w + y + (p["out_channels"] if p["bias"] else 0)) * elem


# The matrix products measure_ceilings can time: name -> (dtype, TF32 allowed).
MATMULS = {"tf32": (torch.float32, True), "fp32": (torch.float32, False), "bf16": (torch.bfloat16, False),
           "fp16": (torch.float16, False)}


def measure_ceilings(timer: Timer, matmuls: Sequence[str] = ("tf32", "fp32", "bf16")) -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and the matrix rates of ``matmuls`` (keys of MATMULS), measured on
    this GPU now."""
    bufs = [torch.randn(1 << 28, device="cuda"), torch.empty(1 << 28, device="cuda")]  # 1 GiB each
    copy_ms = timer(lambda: bufs[1].copy_(bufs[0]))
    bufs.clear()
    n = 8192
    out = {"copy_TBps": 2 * (1 << 28) * 4 / copy_ms / 1e9}
    old = torch.backends.cuda.matmul.allow_tf32
    for name in matmuls:
        dtype, tf32 = MATMULS[name]
        a = torch.randn(n, n, device="cuda").to(dtype)
        b = torch.randn(n, n, device="cuda").to(dtype)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        ms = timer(lambda a=a, b=b: a @ b)
        out[f"{name}_matmul_TFLOPs"] = 2 * n**3 / ms / 1e9
    torch.backends.cuda.matmul.allow_tf32 = old
    return out


def floor_ms(flops: int, nbytes: int, mode: str, ceilings: dict[str, float]) -> float:
    """The roofline floor in ms: max(FLOPs / the mode's matrix rate, bytes / copy bandwidth). Exact fp32 is bounded
    by the fastest exact method we know, 3 TF32 products per multiply (3xTF32): the TF32 rate / 3."""
    rate = ceilings["tf32_matmul_TFLOPs"] / 3 if mode == "fp32" else ceilings[f"{mode}_matmul_TFLOPs"]
    return max(flops / rate / 1e9, nbytes / ceilings["copy_TBps"] / 1e9)


def tuned_choice(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, args: ConvArgs,
                 mode: str) -> KernelChoice:
    """The kernel that measured choice keeps for ``kernels.conv_transpose2d`` on input ``x`` (tuning on; tunes
    the problem first if it is new), asked with the key the call uses: whether the rows the kernels read start
    16-byte aligned and, where the tuner keys on it, whether the input is channels_last."""
    choose = kernels.tuning.TUNER.choose
    cl = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    if "channels_last" in inspect.signature(choose).parameters:  # channels_last inputs read as they are
        return choose(x.shape, weight, bias, args, mode, aligned=not (x.is_contiguous() or cl)
                      or x.data_ptr() % 16 == 0, channels_last=cl)
    return choose(x.shape, weight, bias, args, mode, aligned=not x.is_contiguous() or x.data_ptr() % 16 == 0)


def tuned_label(x: torch.Tensor, conv: nn.ConvTranspose2d) -> str:
    """The kernel that measured choice keeps for ``conv`` on input ``x`` (tuning on, already tuned)."""
    args = normalize_args(conv.stride, conv.padding, conv.output_padding, conv.groups, conv.dilation)
    mode = resolve_precision(x.dtype, getattr(conv, "precision", None))
    return tuned_choice(x, conv.weight, conv.bias, args, mode).label


def served_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, args: ConvArgs,
                mode: str) -> tuple[Callable[..., tuple[torch.Tensor, str]], KernelChoice]:
    """A layer's call as the service runs it on the GPU (service/engine/paths.py): the weights packed once and kept
    (``WeightPacks``), the kernel measured with them (tuning on; tunes the problem first if it is new). Returns
    the call (``out=`` may be passed to it) and the kernel choice."""
    packs = WeightPacks(weight)
    c = kernels.tuning.TUNER.choose(x.shape, weight, bias, args, mode, packs=packs)
    return partial(forward_cuda, x, weight, bias, args, mode, force_path=c.path, force_config=c.config,
                   force_split=c.split, force_staged=c.staged, force_round=c.rounded, packs=packs), c


def run_problem(p: dict, mode: str, timer: Timer, ceilings: dict[str, float], use_compile: bool,
                tune: bool) -> dict:
    torch.backends.cudnn.allow_tf32 = mode != "fp32"
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    torch.manual_seed(p["id"])
    model = Model(**init_args(p)).cuda().to(dtype).eval()
    model_new = kernels.convert(copy.deepcopy(model))
    conv = model.conv_transpose2d
    shape = (p["batch"], p["in_channels"], p["height"], p["width"])

    errs = []
    with torch.no_grad():
        for _ in range(5):
            x = torch.rand(shape, device="cuda").to(dtype)
            ref = F.conv_transpose2d(x.double(), conv.weight.double(),
                                     None if conv.bias is None else conv.bias.double(), conv.stride, conv.padding,
                                     conv.output_padding, conv.groups, conv.dilation)
            for tuned in (False, True) if tune else (False,):
                kernels.tuning.enable(tuned)
                errs.append(rel_err(model_new(x), ref))  # the first tuned call measures the candidates
            del ref
        x = torch.rand(shape, device="cuda").to(dtype)
        kernels.tuning.enable(False)
        ours_default = timer(lambda: model_new(x))
        kernels.tuning.enable(tune)
        ours = timer(lambda: model_new(x)) if tune else ours_default
        choice = tuned_label(x, model_new.conv_transpose2d) if tune else "default"
        kernels.tuning.enable(False)
        cudnn = timer(lambda: model(x))
        cudnn_bench = cudnn_benchmark(timer, lambda: model(x))
        model_cl = copy.deepcopy(model).to(memory_format=torch.channels_last)
        x_cl = x.contiguous(memory_format=torch.channels_last)
        cudnn_cl = timer(lambda: model_cl(x_cl))
        compiled = None
        if use_compile:
            cm = torch.compile(copy.deepcopy(model))
            compiled = timer(lambda: cm(x))

    flops = useful_flops(p)
    nbytes = min_bytes(p, 2 if dtype == torch.bfloat16 else 4)
    floor = floor_ms(flops, nbytes, mode, ceilings)
    row = {
        "id": p["id"], "precision": mode, "ours_ms": round(ours, 4), "ours_default_ms": round(ours_default, 4),
        "choice": choice, "cudnn_ms": round(cudnn, 4), "cudnn_benchmark_ms": round(cudnn_bench, 4),
        "cudnn_channels_last_ms": round(cudnn_cl, 4), "speedup_vs_cudnn": round(cudnn / ours, 3),
        "speedup_vs_cudnn_benchmark": round(cudnn_bench / ours, 3),
        "default_speedup_vs_cudnn": round(cudnn / ours_default, 3),
        "speedup_vs_cudnn_channels_last": round(cudnn_cl / ours, 3), "floor_ms": round(floor, 4),
        "pct_of_floor": round(100 * floor / ours, 1), "ours_TFLOPs": round(flops / ours / 1e9, 2),
        "cudnn_TFLOPs": round(flops / cudnn / 1e9, 2), "max_rel_err": max(errs), "tolerance": TOL[mode],
        "correct": max(errs) <= TOL[mode], "flops": flops, "bytes": nbytes,
    }
    if compiled is not None:
        row["torch_compile_ms"] = round(compiled, 4)
    torch.backends.cudnn.allow_tf32 = True
    return row


def bundled_layers() -> Iterator[tuple[dict, torch.Tensor, torch.Tensor | None, dict, str | None]]:
    """The service's bundled layers (layers/*.json + .safetensors) on the GPU: (config, weight, bias, the
    stride/padding/output_padding/dilation keywords, the float32 precision or None)."""
    from safetensors.torch import load_file

    for cfg_path in sorted((ROOT / "layers").glob("*.json")):
        cfg = json.loads(cfg_path.read_text())
        dtype = getattr(torch, cfg["dtype"])
        tensors = load_file(str(cfg_path.with_suffix(".safetensors")), device="cuda")
        w, b = tensors["weight"].to(dtype), tensors.get("bias")
        b = b.to(dtype) if b is not None else None
        kw = {k: tuple(cfg[k]) for k in ("stride", "padding", "output_padding", "dilation")}
        yield cfg, w, b, kw, cfg.get("precision") if dtype == torch.float32 else None


def run_layers(timer: Timer, hw: int, tune: bool) -> list[dict]:
    """The service's bundled layers at batch 1, 8 and 64: ours vs cuDNN (default and with cudnn.benchmark).

    Ours three ways: ``ours_default_ms``, ``kernels.conv_transpose2d`` with the default choice; with ``tune``,
    ``ours_call_ms``, the same call with measured choice, and ``ours_ms``, as the service runs a layer (weights
    packed once and kept, ``WeightPacks``; the kernel measured with them). Without ``tune`` all three are the
    first."""
    rows = []
    for cfg, w, b, kw, prec in bundled_layers():
        dtype = w.dtype
        for n in (1, 8, 64):
            x = torch.rand(n, cfg["in_channels"], hw, hw, device="cuda").to(dtype)
            ours_fn = partial(kernels.conv_transpose2d, x, w, b, groups=cfg["groups"], precision=prec, **kw)
            with torch.no_grad():
                ref = F.conv_transpose2d(x.double(), w.double(), None if b is None else b.double(),
                                         groups=cfg["groups"], **kw)
                err = rel_err(ours_fn(), ref)
                ours_default = timer(ours_fn)
                choice = "default"
                args = normalize_args(kw["stride"], kw["padding"], kw["output_padding"], cfg["groups"],
                                      kw["dilation"])
                mode = resolve_precision(dtype, prec)
                if tune:
                    kernels.tuning.enable(True)
                    err = max(err, rel_err(ours_fn(), ref))  # tunes, then checks the kept kernel
                    ours_call = timer(ours_fn)
                    # As the service runs it: the weights packed once and kept, the kernel measured with them.
                    served, c = served_call(x, w, b, args, mode)
                    kernels.tuning.enable(False)
                    choice = c.label
                    err = max(err, rel_err(served()[0], ref))
                    ours = timer(served)
                else:
                    ours = ours_call = ours_default
                torch.backends.cudnn.allow_tf32 = prec != "fp32"
                cudnn_fn = partial(F.conv_transpose2d, x, w, b, groups=cfg["groups"], **kw)
                cudnn = timer(cudnn_fn)
                cudnn_bench = cudnn_benchmark(timer, cudnn_fn)
                torch.backends.cudnn.allow_tf32 = True
            rows.append({"layer": cfg["name"], "batch": n, "hw": hw, "dtype": cfg["dtype"], "precision": prec,
                         "ours_ms": round(ours, 4), "ours_call_ms": round(ours_call, 4),
                         "ours_default_ms": round(ours_default, 4), "choice": choice,
                         "cudnn_ms": round(cudnn, 4), "cudnn_benchmark_ms": round(cudnn_bench, 4),
                         "speedup_vs_cudnn": round(cudnn / ours, 3),
                         "speedup_vs_cudnn_benchmark": round(cudnn_bench / ours, 3),
                         "call_speedup_vs_cudnn": round(cudnn / ours_call, 3),
                         "default_speedup_vs_cudnn": round(cudnn / ours_default, 3), "max_rel_err": err})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["tf32", "fp32", "bf16"], choices=["tf32", "fp32", "bf16"])
    ap.add_argument("--ids", nargs="+", type=int, help="problem ids (default: all seven)")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of the PyTorch model")
    ap.add_argument("--no-tune", dest="tune", action="store_false",
                    help="time only the dispatcher's default kernel choice (no kernels.tuning)")
    ap.add_argument("--out", type=Path, help="JSON path (default docs/benchmarks/kernelbench-<device>.json)")
    ap.add_argument("--layers-hw", type=int, default=32,
                    help="input H = W for the bundled-layers table (0 skips it)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernelbench needs a CUDA GPU")

    device = torch.cuda.get_device_name(0)
    problems = [p for p in json.loads(PROBLEMS.read_text())["problems"] if not args.ids or p["id"] in args.ids]
    timer = Timer(args.reps, args.warmup)
    kernels.conv_transpose2d(torch.randn(1, 1, 2, 2, device="cuda"), torch.randn(1, 1, 1, 1, device="cuda"))
    ceilings = measure_ceilings(timer)
    print(f"# {device}; torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; ceilings: "
          + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()), flush=True)
    rows = []
    for mode in args.modes:
        for p in problems:
            row = run_problem(p, mode, timer, ceilings, args.compile, args.tune)
            rows.append(row)
            print(json.dumps(row), flush=True)

    layer_rows = run_layers(timer, args.layers_hw, args.tune) if args.layers_hw else []

    slug = device_slug(device)
    out = args.out or ROOT / "docs" / "benchmarks" / f"kernelbench-{slug}.json"
    doc = {"device": device, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "ceilings": {k: round(v, 2) for k, v in ceilings.items()}, "reps": args.reps, "tuned": args.tune,
           "problems": rows,
           "layers": layer_rows}
    write(out, doc)

    hdr = f"{'id':>3} {'mode':>5} {'ours ms':>8} {'choice':>8} {'default':>8} {'cuDNN ms':>8} {'cuDNN-B':>8} " \
          f"{'cuDNN-CL':>8} {'speedup':>8} {'vs B':>6} {'vs CL':>6} {'%floor':>7} {'rel err':>9} ok"
    print(f"\n{device}\n{hdr}")
    for r in rows:
        print(f"{r['id']:>3} {r['precision']:>5} {r['ours_ms']:>8.3f} {r['choice']:>8} {r['ours_default_ms']:>8.3f} "
              f"{r['cudnn_ms']:>8.3f} {r['cudnn_benchmark_ms']:>8.3f} {r['cudnn_channels_last_ms']:>8.3f} "
              f"{r['speedup_vs_cudnn']:>7.2f}x {r['speedup_vs_cudnn_benchmark']:>5.2f}x "
              f"{r['speedup_vs_cudnn_channels_last']:>5.2f}x {r['pct_of_floor']:>6.1f}% "
              f"{r['max_rel_err']:>9.2e} {'yes' if r['correct'] else 'NO'}")
    for mode in args.modes:
        for key, name in (("speedup_vs_cudnn", "cuDNN"), ("speedup_vs_cudnn_benchmark", "cuDNN benchmark"),
                          ("default_speedup_vs_cudnn", "cuDNN, our default choice")):
            sp = [r[key] for r in rows if r["precision"] == mode]
            if sp:
                print(f"{mode}: geometric-mean speedup vs {name} "
                      f"{math.exp(sum(map(math.log, sp)) / len(sp)):.2f}x (min {min(sp):.2f}x)")
    if layer_rows:
        print(f"\nbundled layers, {args.layers_hw}x{args.layers_hw} inputs (ms; B: cudnn.benchmark)")
        for r in layer_rows:
            print(f"{r['layer']:>16} N={r['batch']:<3} ours {r['ours_ms']:7.4f} {r['choice']:>8} call "
                  f"{r['ours_call_ms']:7.4f} default {r['ours_default_ms']:7.4f}  cuDNN {r['cudnn_ms']:7.4f} "
                  f"B {r['cudnn_benchmark_ms']:7.4f}  "
                  f"{r['speedup_vs_cudnn']:5.2f}x B {r['speedup_vs_cudnn_benchmark']:5.2f}x "
                  f"call {r['call_speedup_vs_cudnn']:5.2f}x default {r['default_speedup_vs_cudnn']:5.2f}x "
                  f"err {r['max_rel_err']:.1e}")
        for key, name in (("speedup_vs_cudnn", "as served"), ("call_speedup_vs_cudnn", "call, measured choice"),
                          ("default_speedup_vs_cudnn", "call, default choice")):
            at = sum(r[key] >= 1 for r in layer_rows)
            print(f"layers at or above cuDNN ({name}): {at} of {len(layer_rows)}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
