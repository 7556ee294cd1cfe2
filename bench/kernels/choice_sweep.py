"""The default kernel choice against measured choice on generated realistic layers, and what measuring costs.

Point of comparison: without ``kernels.tuning`` a library call runs the dispatcher's rule (``default``); with it,
the first call of a problem measures every candidate (``measured``). For each generated layer this runs the tuner
once (``kernels.tuning.Tuner.tune``: the candidates timed with an L2 flush before each call, the best few and the
default timed again in one pass) and reports the default's time over the chosen one's, from that same pass, and the
seconds the measuring took (what a first call with measured choice costs, kernel build excluded).

Layers are drawn with a fixed seed from what decoders use: batch 1-128, input channels 3-2048, output channels
from one to twice the input's, spatial 4-256, and the (kernel, stride, padding, output_padding) of real up-sampling
layers (2/2/0/0, 4/2/1/0, 3/2/1/1, 3/1/1/0, 4/1/0/0, 5/2/2/1, 8/4/2/0, 16/8/4/0), bounded to at most ``--max-gflop``
and tensors of at most 256 MiB; precision bf16 or TF32 and NCHW or channels-last at random. Rows with an even
index are the "fit" half, odd ones the "held-out" half: a rule fitted on these figures must be judged on the
other half.

    python -m bench.kernels.choice_sweep --count 320 --budget-s 240 --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.harness import short_slug, write
from bench.kernels.zoo_results import geomean
from kernels.internal import ConvArgs
from kernels.tuning import TUNER

LAYER_KINDS = ((2, 2, 0, 0), (4, 2, 1, 0), (3, 2, 1, 1), (3, 1, 1, 0), (4, 1, 0, 0), (5, 2, 2, 1), (8, 4, 2, 0),
               (16, 8, 4, 0))
CHANNELS = (3, 8, 16, 21, 32, 48, 64, 96, 128, 192, 256, 320, 384, 512, 768, 1024, 1536, 2048)
SPATIAL = (4, 7, 8, 14, 16, 28, 32, 56, 64, 96, 128, 256)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_BYTES = 256 << 20
WITHIN = 1.15  # the target: default within this factor of measured choice ...
SHARE = 0.95  # ... on this share of the layers
NEVER = 1.5  # and never worse than this


def layers(count: int, seed: int, max_gflop: float) -> list[dict]:
    """``count`` layers drawn as the module describes; deterministic for a seed."""
    rng = random.Random(seed)
    out: list[dict] = []
    while len(out) < count:
        k, s, p, op = rng.choice(LAYER_KINDS)
        c_in = rng.choice(CHANNELS)
        c_out = max(1, min(2 * c_in, rng.choice((c_in // 4, c_in // 2, c_in, 2 * c_in, rng.choice(CHANNELS)))))
        h = rng.choice(SPATIAL)
        w = h if rng.random() < 0.8 else rng.choice(SPATIAL)
        n = rng.choice(BATCHES)
        h_out, w_out = (h - 1) * s - 2 * p + k + op, (w - 1) * s - 2 * p + k + op
        gflop = 2 * n * c_in * h * w * c_out * k * k / 1e9
        elems = max(n * c_in * h * w, n * c_out * h_out * w_out, c_in * c_out * k * k)
        if h_out < 1 or w_out < 1 or gflop > max_gflop or elems * 4 > MAX_BYTES:
            continue
        out.append({"index": len(out), "half": "fit" if len(out) % 2 == 0 else "held-out",
                    "input": [n, c_in, h, w], "c_out": c_out, "kernel": k, "stride": s, "padding": p,
                    "output_padding": op, "precision": rng.choice(("bf16", "tf32")),
                    "layout": rng.choice(("nchw", "cl")), "gflop": round(gflop, 4)})
    return out


def measure(row: dict) -> dict:
    """Tune one layer (no choice store, nothing cached) and return the row with its figures."""
    dtype = torch.bfloat16 if row["precision"] == "bf16" else torch.float32
    c_in = row["input"][1]
    k = row["kernel"]
    weight = (torch.randn(c_in, row["c_out"], k, k, device="cuda") / (c_in * k * k) ** 0.5).to(dtype)
    bias = torch.randn(row["c_out"], device="cuda").to(dtype)
    args = ConvArgs((row["stride"],) * 2, (row["padding"],) * 2, (row["output_padding"],) * 2, (1, 1), 1)
    result = TUNER.tune(row["input"], weight, bias, args, "tf32" if row["precision"] == "tf32" else "fp32",
                        channels_last=row["layout"] == "cl")
    return {**row, "default_ms": round(result.default_ms, 5), "measured_ms": round(result.ms, 5),
            "choice": result.choice.label, "ratio": round(result.default_ms / result.ms, 4),
            "tune_s": round(result.seconds, 3), "candidates": len(result.trials)}


def summary(rows: list[dict]) -> dict:
    """The distribution of default/measured over the rows, per half and in all, and of the measuring's cost."""
    def part(rs: list[dict]) -> dict:
        if not rs:
            return {}
        ratios = sorted(r["ratio"] for r in rs)
        tune = sorted(r["tune_s"] for r in rs)
        q = lambda xs, f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
        return {"layers": len(rs), "within_1.15": round(sum(x <= WITHIN for x in ratios) / len(rs), 4),
                "worse_than_1.5": sum(x > NEVER for x in ratios), "ratio_median": ratios[len(ratios) // 2],
                "ratio_p90": q(ratios, 0.9), "ratio_p95": q(ratios, 0.95), "ratio_max": ratios[-1],
                "ratio_geomean": round(geomean(ratios), 4), "tune_s_median": tune[len(tune) // 2],
                "tune_s_p90": q(tune, 0.9), "tune_s_max": tune[-1], "tune_s_total": round(sum(tune), 1),
                "first_call_over_call_median": round(statistics.median(
                    r["tune_s"] * 1e3 / r["measured_ms"] for r in rs), 1)}

    return {"all": part(rows), "fit": part([r for r in rows if r["half"] == "fit"]),
            "held-out": part([r for r in rows if r["half"] == "held-out"]),
            "target": {"within": WITHIN, "share": SHARE, "never_worse_than": NEVER}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=320, help="layers to generate (default 320)")
    ap.add_argument("--seed", type=int, default=47)
    ap.add_argument("--max-gflop", type=float, default=40.0)
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop measuring after this many seconds")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/kernels/choice_sweep.py needs a CUDA GPU")
    rows: list[dict] = []
    start = time.perf_counter()
    todo = layers(args.count, args.seed, args.max_gflop)
    for row in todo:
        if time.perf_counter() - start > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent after {len(rows)} of {len(todo)} layers", flush=True)
            break
        try:
            rows.append(measure(row))
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            continue
        r = rows[-1]
        print(f"{r['index']:4d} {r['precision']} {r['layout']:4s} {r['input']} -> {r['c_out']} k{r['kernel']} "
              f"s{r['stride']}: default {r['default_ms']:.4f} ms, measured {r['measured_ms']:.4f} ms "
              f"({r['choice']}), {r['ratio']:.2f}x, tuning {r['tune_s']:.2f} s", flush=True)
    device = torch.cuda.get_device_name(0)
    doc = {"device": device, "torch": torch.__version__, "seed": args.seed, "generated": len(todo),
           "summary": summary(rows), "rows": rows}
    out = args.out / f"choice_sweep-{short_slug(device)}.json"
    write(out, doc)
    print(json.dumps(doc["summary"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
