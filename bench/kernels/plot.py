"""Bar chart of a kernelbench JSON: speedup over cuDNN per problem and precision (PNG beside the JSON).

    python -m bench.kernels.plot docs/benchmarks/kernelbench-nvidia-h100.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot(path: Path) -> Path:
    doc = json.loads(path.read_text())
    rows = doc["problems"]
    modes = sorted({r["precision"] for r in rows}, key=["tf32", "fp32", "bf16"].index)
    ids = sorted({r["id"] for r in rows})
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, mode in enumerate(modes):
        by_id = {r["id"]: r["speedup_vs_cudnn"] for r in rows if r["precision"] == mode}
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(ids))]
        ax.bar(xs, [by_id.get(p, 0) for p in ids], width, label=mode)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(ids)), [f"#{p}" for p in ids])
    ax.set_xlabel("KernelBench problem")
    ax.set_ylabel("speedup over cuDNN (same precision, NCHW)")
    ax.set_title(f"deconv kernels vs cuDNN on {doc['device']} (>1 = faster)")
    ax.legend()
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(plot(Path(arg)))
