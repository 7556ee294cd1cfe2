"""Chart of a layer-zoo JSON (bench/kernels/zoo.py): per layer, our speedup over the best cuDNN layout for every
precision and input layout, on a log scale with the 1.0x line (PNG beside the JSON unless --out).

    python -m bench.kernels.plot_zoo docs/benchmarks/layer_zoo-nvidia-h100.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PRECISIONS = ("tf32", "bf16", "fp16", "fp32")
LAYOUTS = ("nchw", "cl")
COLORS = {"tf32": "tab:blue", "bf16": "tab:orange", "fp16": "tab:green", "fp32": "tab:red"}
MARKERS = {"nchw": "o", "cl": "^"}


def plot(path: Path, out: Path | None = None) -> Path:
    """Write the chart of the JSON at ``path`` to ``out`` (default: ``path`` with .png); returns where."""
    doc = json.loads(path.read_text())
    rows = [r for r in doc["rows"] if r["speedup"] is not None]
    names: list[str] = []
    for r in doc["rows"]:  # the JSON's order: the zoo, then KernelBench
        if r["name"] not in names:
            names.append(r["name"])
    series = [(p, lay) for p in PRECISIONS for lay in LAYOUTS
              if any(r["precision"] == p and r["layout"] == lay for r in rows)]
    step = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.45 * len(names) + 2), 5.5))
    for i, (prec, lay) in enumerate(series):
        sel = {r["name"]: r for r in rows if r["precision"] == prec and r["layout"] == lay}
        xs = [j + (i - (len(series) - 1) / 2) * step for j, n in enumerate(names) if n in sel]
        ys = [sel[n]["speedup"] for n in names if n in sel]
        wrong = [sel[n]["speedup"] for n in names if n in sel and not sel[n]["correct"]]
        wx = [j + (i - (len(series) - 1) / 2) * step for j, n in enumerate(names) if n in sel and not sel[n]["correct"]]
        ax.scatter(xs, ys, s=22, color=COLORS[prec], marker=MARKERS[lay], label=f"{prec} {lay}",
                   facecolors=COLORS[prec] if lay == "nchw" else "none")
        if wrong:
            ax.scatter(wx, wrong, s=80, color="black", marker="x")
    ax.set_yscale("log")
    ax.axhline(1.0, color="black", linewidth=0.8)
    zoo_count = sum(1 for n in names if any(r["name"] == n and r["suite"] == "zoo" for r in doc["rows"]))
    if 0 < zoo_count < len(names):
        ax.axvline(zoo_count - 0.5, color="grey", linewidth=0.6, linestyle="--")
    ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_ylabel("speedup over the best cuDNN layout (log)")
    ax.set_title(f"deconv kernels vs cuDNN (benchmark mode, best of NCHW and channels_last) on {doc['device']}\n"
                 "filled: NCHW input, open: channels_last input; x: wrong result; > 1 = ours faster", fontsize=10)
    ax.grid(axis="y", which="both", alpha=0.3)
    if series:
        ax.legend(ncol=4, fontsize=8)
    fig.tight_layout()
    out = out or path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path)
    ap.add_argument("--out", type=Path, help="PNG path (default: the JSON's path with .png)")
    args = ap.parse_args()
    print(plot(args.json, args.out))


if __name__ == "__main__":
    main()
