"""The results of bench/kernels/zoo.py without a GPU: a row's derived fields (best cuDNN, % of floor, speedup), the
summary per suite, precision and layout, the JSON document, the merge of partial runs, and the printed report."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from bench.kernels.problems import (
    LAYOUTS,
    PRECISIONS,
    SUITES,
    ZOO_TOL,
    kernelbench_problems,
    zoo_problems,
)

ROW_KEYS = ("name", "precision", "layout", "ours_ms", "served_ms", "cudnn_nchw_ms", "cudnn_cl_ms", "best_cudnn_ms",
            "floor_ms", "gflop", "pct_of_floor", "speedup", "choice", "max_rel_err", "correct", "suite")
DOC_KEYS = ("device", "torch", "cudnn", "ceilings", "rows", "kernelbench_check", "summary")
BIG_GFLOP = 5.0  # layers of at least this many GFLOP should reach HALF_FLOOR_PCT of their floor (issue 27)
HALF_FLOOR_PCT = 50.0
CHECK_SEEDS = 5


def make_row(p: dict, precision: str, layout: str, *, ours_ms: float | None, served_ms: float | None,
             cudnn_nchw_ms: float | None, cudnn_cl_ms: float | None, gflop: float, floor: float, choice: str,
             max_rel_err: float | None, correct: bool, peer: dict | None = None) -> dict:
    """One row of the JSON, its derived fields (best cuDNN, % of floor, speedup) computed here; ``peer``: the
    CUTLASS figures (zoo.py's time_peer), with ``vs_cutlass`` = cutlass_ms / ours_ms."""
    cudnn = [t for t in (cudnn_nchw_ms, cudnn_cl_ms) if t is not None]
    best = min(cudnn) if cudnn else None
    r4 = (lambda t: None if t is None else round(t, 4))  # noqa: E731
    return {"name": p["name"], "precision": precision, "layout": layout, "ours_ms": r4(ours_ms),
            "served_ms": r4(served_ms), "cudnn_nchw_ms": r4(cudnn_nchw_ms), "cudnn_cl_ms": r4(cudnn_cl_ms),
            "best_cudnn_ms": r4(best), "floor_ms": float(f"{floor:.4g}"), "gflop": float(f"{gflop:.4g}"),
            "pct_of_floor": round(100 * floor / ours_ms, 1) if ours_ms else None,
            "speedup": round(best / ours_ms, 4) if ours_ms and best else None, "choice": choice,
            "max_rel_err": None if max_rel_err is None or not math.isfinite(max_rel_err)
            else float(f"{max_rel_err:.3e}"),
            "correct": bool(correct), "suite": p["suite"]} | peer_fields(peer, ours_ms)


def peer_fields(peer: dict | None, ours_ms: float | None) -> dict:
    if not peer:
        return {}
    ms, err = peer.get("cutlass_ms"), peer.get("cutlass_rel_err")
    return {"cutlass_ms": None if ms is None else round(ms, 4), "cutlass_config": peer.get("cutlass_config"),
            "cutlass_rel_err": None if err is None or not math.isfinite(err) else float(f"{err:.3e}"),
            "cutlass_correct": peer.get("cutlass_correct"), "cutlass_note": peer.get("cutlass_note"),
            "vs_cutlass": round(ms / ours_ms, 4) if ms and ours_ms else None}


def geomean(xs: Sequence[float]) -> float:
    """Geometric mean; a ratio that rounded to 0 counts as the smallest ratio a row can print (1e-4)."""
    return math.exp(sum(math.log(max(x, 1e-4)) for x in xs) / len(xs))


def row_key(r: dict) -> tuple[str, str, str, str]:
    return r["suite"], r["name"], r["precision"], r["layout"]


def summarize(rows: Sequence[dict], check: Sequence[dict] = (), skipped: Sequence[dict] = (),
              errors: Sequence[str] = (), extra: dict | None = None) -> dict:
    """Per suite, precision and layout: geometric-mean speedup over the best cuDNN layout, rows at or above 1.0x,
    the slowest, rows as served (NCHW), problems of >= 5 GFLOP at >= 50% of their floor, wrong rows; then the
    wrong rows by name, the skipped ones, the errors and the KernelBench check's tally."""
    out: dict[str, Any] = {}
    for suite in SUITES:
        for prec in PRECISIONS:
            for layout in LAYOUTS:
                rs = [r for r in rows if (r["suite"], r["precision"], r["layout"]) == (suite, prec, layout)]
                if not rs:
                    continue
                timed = [r for r in rs if r["speedup"] is not None]
                sp = [r["speedup"] for r in timed]
                served = [r["best_cudnn_ms"] / r["served_ms"] for r in rs if r["served_ms"] and r["best_cudnn_ms"]]
                big = [r for r in rs if r["gflop"] >= BIG_GFLOP]
                worst = min(timed, key=lambda r: r["speedup"]) if timed else None
                out.setdefault(suite, {})[f"{prec}/{layout}"] = {
                    "rows": len(rs), "timed": len(timed),
                    "geomean_speedup": round(geomean(sp), 3) if sp else None,
                    "at_or_above_1x": sum(s >= 1.0 for s in sp),
                    "min_speedup": worst["speedup"] if worst else None,
                    "min_name": worst["name"] if worst else None,
                    "geomean_served_speedup": round(geomean(served), 3) if served else None,
                    "big_layers": len(big),
                    "big_at_half_floor": sum((r["pct_of_floor"] or 0) >= HALF_FLOOR_PCT for r in big),
                    "incorrect": sum(not r["correct"] for r in rs),
                } | peer_summary(rs)
    out["incorrect"] = [f"{r['name']}/{r['precision']}/{r['layout']}" for r in rows if not r["correct"]]
    out["skipped"] = list(skipped)
    out["errors"] = list(errors)
    if check:
        failed = [f"{c['id']}/seed{c['seed']}/{c['choice']}" for c in check if not c["passed"]]
        out["kernelbench_check"] = {"passed": len(check) - len(failed), "total": len(check), "failed": failed}
    out.update(extra or {})
    return out


def peer_summary(rs: Sequence[dict]) -> dict:
    """CUTLASS against ours (geomean of cutlass_ms / ours_ms, rows at or above 1.0x) and against the best cuDNN
    layout (geomean of best_cudnn_ms / cutlass_ms, rows where CUTLASS is faster), over the rows it ran."""
    ran = [r for r in rs if r.get("vs_cutlass") is not None]
    if not ran:
        return {}
    vs = [r["best_cudnn_ms"] / r["cutlass_ms"] for r in ran if r["best_cudnn_ms"]]
    return {"cutlass_rows": len(ran), "geomean_vs_cutlass": round(geomean([r["vs_cutlass"] for r in ran]), 3),
            "at_or_above_cutlass": sum(r["vs_cutlass"] >= 1.0 for r in ran),
            "geomean_cutlass_vs_cudnn": round(geomean(vs), 3) if vs else None,
            "cutlass_beats_cudnn": sum(v > 1.0 for v in vs)}


def document(device: str, torch_version: str, cudnn: int | None, ceilings: dict[str, float], rows: Sequence[dict],
             check: Sequence[dict], summary: dict) -> dict:
    return {"device": device, "torch": torch_version, "cudnn": cudnn,
            "ceilings": {k: round(v, 2) for k, v in ceilings.items()}, "rows": list(rows),
            "kernelbench_check": list(check), "summary": summary}


def merge(docs: Sequence[dict]) -> dict:
    """Join partial runs of one device: rows keyed by (suite, name, precision, layout) and check entries by
    (id, seed, choice), a later file's replacing an earlier one's; skipped rows that some file ran are dropped.
    The first file's ceilings head the result; every file's are listed under summary.sources.

    Raises:
        ValueError: no files, or files from different devices.
    """
    if not docs:
        raise ValueError("nothing to merge")
    devices = {d["device"] for d in docs}
    if len(devices) != 1:
        raise ValueError(f"files from different devices: {sorted(devices)}")
    rows: dict[tuple, dict] = {}
    check: dict[tuple, dict] = {}
    skipped: dict[tuple, dict] = {}
    errors: list[str] = []
    for d in docs:
        for r in d["rows"]:
            rows[row_key(r)] = r
        for c in d.get("kernelbench_check", []):
            check[(c["id"], c["seed"], c["choice"])] = c
        for s in d["summary"].get("skipped", []):
            skipped[(s["suite"], s["name"], s["precision"], s["layout"])] = s
        errors += d["summary"].get("errors", [])
    skipped = {k: s for k, s in skipped.items() if k not in rows}
    order = {(p["suite"], p["name"]): i for i, p in enumerate(zoo_problems() + kernelbench_problems())}

    def sort_key(r: dict) -> tuple:
        return (order.get((r["suite"], r["name"]), len(order)), r["name"], PRECISIONS.index(r["precision"]),
                LAYOUTS.index(r["layout"]))

    merged_rows = sorted(rows.values(), key=sort_key)
    sources = [{"torch": d["torch"], "cudnn": d["cudnn"], "ceilings": d["ceilings"], "rows": len(d["rows"])}
               for d in docs]
    summary = summarize(merged_rows, sorted(check.values(), key=lambda c: (c["id"], c["seed"], c["choice"])),
                        sorted(skipped.values(), key=sort_key), errors, {"sources": sources})
    first = docs[0]
    return document(first["device"], first["torch"], first["cudnn"], first["ceilings"], merged_rows,
                    sorted(check.values(), key=lambda c: (c["id"], c["seed"], c["choice"])), summary)


def report(doc: dict, worst: int = 12) -> str:
    """The table printed last: the KernelBench check, one line per suite x precision x layout, the slowest rows,
    the wrong rows and the skipped ones."""
    lines = [f"{doc['device']}; torch {doc['torch']}, cuDNN {doc['cudnn']}; ceilings: "
             + ", ".join(f"{k} {v}" for k, v in doc["ceilings"].items())]
    s = doc["summary"]
    by_id: dict[int, list[dict]] = {}
    for c in doc["kernelbench_check"]:
        by_id.setdefault(c["id"], []).append(c)
    if by_id:
        lines.append(f"KernelBench check (fp32 default flags, {CHECK_SEEDS} seeds, allclose atol=rtol=1e-4):")
        for pid, cs in by_id.items():
            parts = []
            for choice in ("default", "measured"):
                sel = [c for c in cs if c["choice"] == choice]
                if sel:
                    ok = sum(c["passed"] for c in sel)
                    diffs = [c["max_abs_diff"] for c in sel if c["max_abs_diff"] is not None]
                    parts.append(f"{choice} {ok}/{len(sel)}{'' if ok == len(sel) else ' FAIL'} "
                                 f"max|d| {max(diffs) if diffs else float('nan'):.2e}")
            failed = sum(c["choice"] == "error" for c in cs)
            if failed:
                parts.append(f"{failed} seeds FAILED TO RUN")
            lines.append(f"  {pid:>3}: " + "; ".join(parts))
    lines.append(f"{'suite':<11} {'prec/layout':<11} {'rows':>4} {'geomean':>8} {'>=1x':>5} {'min':>6} "
                 f"{'(layer)':<15} {'served':>7} {'>=5GF@50%':>9} wrong")
    for suite in SUITES:
        for key, v in s.get(suite, {}).items():
            gm = "-" if v["geomean_speedup"] is None else f"{v['geomean_speedup']:.2f}x"
            mn = "-" if v["min_speedup"] is None else f"{v['min_speedup']:.2f}x"
            sv = "-" if v["geomean_served_speedup"] is None else f"{v['geomean_served_speedup']:.2f}x"
            lines.append(f"{suite:<11} {key:<11} {v['rows']:>4} {gm:>8} {v['at_or_above_1x']:>5} {mn:>6} "
                         f"{v['min_name'] or '-':<15} {sv:>7} {v['big_at_half_floor']:>4}/{v['big_layers']:<4} "
                         f"{v['incorrect'] or ''}")
    peer_lines = [(suite, key, v) for suite in SUITES for key, v in s.get(suite, {}).items() if "cutlass_rows" in v]
    if peer_lines:
        lines.append(f"CUTLASS: {'suite':<11} {'prec/layout':<11} {'rows':>4} {'ours/CUTLASS':>12} {'>=1x':>5} "
                     f"{'CUTLASS/cuDNN':>13} {'faster':>6}")
        for suite, key, v in peer_lines:
            cv = "-" if v["geomean_cutlass_vs_cudnn"] is None else f"{v['geomean_cutlass_vs_cudnn']:.2f}x"
            lines.append(f"         {suite:<11} {key:<11} {v['cutlass_rows']:>4} {v['geomean_vs_cutlass']:>11.2f}x "
                         f"{v['at_or_above_cutlass']:>5} {cv:>13} {v['cutlass_beats_cudnn']:>6}")
    timed = sorted((r for r in doc["rows"] if r["speedup"] is not None), key=lambda r: r["speedup"])
    if timed:
        lines.append(f"slowest {min(worst, len(timed))} rows (ms: ours / best cuDNN nchw|cl, % of floor, choice):")
        for r in timed[:worst]:
            lines.append(f"  {r['name']:<15} {r['precision']:<4} {r['layout']:<4} {r['speedup']:5.2f}x  "
                         f"{r['ours_ms']:.4f} / {r['best_cudnn_ms']:.4f} ({r['cudnn_nchw_ms']}|{r['cudnn_cl_ms']}) "
                         f"{r['pct_of_floor']}% {r['choice']}")
    for name in s.get("incorrect", []):
        r = next(r for r in doc["rows"] if f"{r['name']}/{r['precision']}/{r['layout']}" == name)
        lines.append(f"!!! WRONG RESULT: {name}: max rel err {r['max_rel_err']} (tolerance "
                     f"{ZOO_TOL[r['precision']]:.0e})")
    for e in s.get("errors", [])[:10]:
        lines.append(f"!!! ERROR: {e[:300]}")
    skipped = s.get("skipped", [])
    if skipped:
        names = sorted({k["name"] for k in skipped})
        lines.append(f"SKIPPED {len(skipped)} rows (budget); rerun with --only {' '.join(names)}")
    return "\n".join(lines)
