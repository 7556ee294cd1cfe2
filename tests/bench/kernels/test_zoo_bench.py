"""bench/kernels/zoo.py (with problems.py and zoo_results.py) and plot_zoo.py without a GPU: the layer data, the
roofline arithmetic, the rows' derived fields, the summary and the JSON schema, the merge of partial runs, the budget's
skipped rows, one problem's rows and KernelBench's check run on CPU tensors (stand-ins for the GPU-only calls), the
printed report, the chart."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench.kernels import layer_zoo, plot_zoo, zoo
from bench.kernels.problems import (
    LAYOUTS,
    PRECISIONS,
    ZOO_TOL,
    kernelbench_problems,
    out_shape,
    roofline,
    select,
    spec,
    zoo_problems,
)
from bench.kernels.zoo_results import DOC_KEYS, ROW_KEYS, document, geomean, make_row, merge, report, summarize
from kernels.tuning import DEFAULT

ROOT = Path(__file__).resolve().parents[3]
CEILINGS = {"copy_TBps": 3.0, "tf32_matmul_TFLOPs": 400.0, "fp32_matmul_TFLOPs": 50.0, "bf16_matmul_TFLOPs": 800.0,
            "fp16_matmul_TFLOPs": 790.0}


def test_layer_data() -> None:
    assert len(layer_zoo.ZOO) == 25
    names = [e[0] for e in layer_zoo.ZOO]
    assert len(set(names)) == 25
    for entry in layer_zoo.ZOO:
        q = layer_zoo.problem(entry)
        assert min(q["out_height"], q["out_width"]) > 0, q
        assert q["in_channels"] % q["groups"] == q["out_channels"] % q["groups"] == 0, q
        assert q["output_padding"] < max(q["stride"], q["dilation"]), q
        assert q["gflop"] > 0
        assert q["source"]
        # the output size agrees with PyTorch's
        x = torch.empty(1, q["in_channels"], q["height"], q["width"], device="meta")
        w = torch.empty(q["in_channels"], q["out_channels"] // q["groups"], q["kernel_size"], q["kernel_size"],
                        device="meta")
        y = F.conv_transpose2d(x, w, None, q["stride"], q["padding"], q["output_padding"], q["groups"],
                               q["dilation"])
        assert tuple(y.shape[2:]) == (q["out_height"], q["out_width"]), q["name"]
    up1 = layer_zoo.problem(next(e for e in layer_zoo.ZOO if e[0] == "dcgan64-up1"))
    assert (up1["out_height"], up1["out_width"]) == (8, 8)
    problems = zoo_problems() + kernelbench_problems()
    assert len(problems) == 32
    assert len({p["name"] for p in problems}) == 32
    assert [p["name"] for p in kernelbench_problems()] == ["kb57", "kb65", "kb69", "kb71", "kb75", "kb78",
                                                                "kb81"]
    assert [p["name"] for p in select(problems, "zoo", ["unet-up1", "kb57"])] == ["unet-up1"]
    assert len(select(problems, "all", None)) == 32


def test_roofline_known_cases() -> None:
    unet = next(p for p in zoo_problems() if p["name"] == "unet-up1")
    # k=2, s=2, no padding: every tap lands, as layer_zoo counts
    flops = 2 * 4 * 1024 * 512 * 32 * 32 * 4
    gflop, floor = roofline(unet, "tf32", CEILINGS)
    assert gflop == pytest.approx(flops / 1e9)
    assert gflop == pytest.approx(layer_zoo.problem(next(e for e in layer_zoo.ZOO if e[0] == "unet-up1"))["gflop"])
    assert floor == pytest.approx(flops / 400e12 * 1e3)  # compute bound: 42.9 us
    assert roofline(unet, "fp32", CEILINGS)[1] == pytest.approx(3 * floor)  # tf32 rate / 3
    assert roofline(unet, "fp16", CEILINGS)[1] == pytest.approx(flops / 790e12 * 1e3)
    # one input pixel, 3x3 kernel, padding 1: only the centre tap lands; bytes bound
    tiny = spec("tiny", "zoo", 1, 1, 1, [3, 3], [1, 1], [1, 1], [0, 0], 1, [1, 1], 1, 1, False)
    gflop, floor = roofline(tiny, "bf16", CEILINGS)
    assert gflop == pytest.approx(2e-9)
    assert floor == pytest.approx((1 + 9 + 1) * 2 / 3e12 * 1e3)
    assert out_shape(tiny) == (1, 1, 1, 1)


def _row(name: str, prec: str, layout: str, ours: float, nchw: float, cl: float, gflop: float = 1.0,
         correct: bool = True, suite: str = "zoo") -> dict:
    p = {"name": name, "suite": suite}
    return make_row(p, prec, layout, ours_ms=ours, served_ms=ours if layout == "nchw" else None,
                        cudnn_nchw_ms=nchw, cudnn_cl_ms=cl, gflop=gflop, floor=0.5, choice="tc3",
                        max_rel_err=1e-4 if correct else 0.5, correct=correct)


def test_row_fields_and_summary() -> None:
    rows = [_row("a", "tf32", "nchw", 1.0, 3.0, 2.0, gflop=10.0),  # 2x, 50% of floor
            _row("b", "tf32", "nchw", 2.0, 1.0, 4.0, gflop=6.0),  # 0.5x, 25%
            _row("c", "tf32", "nchw", 1.0, 1.0, 1.0, correct=False),
            _row("a", "bf16", "cl", 0.5, 1.0, 0.75, gflop=10.0),
            _row("kb1", "tf32", "nchw", 0.25, 1.0, 0.5, suite="kernelbench")]
    a = rows[0]
    assert set(a) == set(ROW_KEYS)
    assert (a["best_cudnn_ms"], a["speedup"], a["pct_of_floor"]) == (2.0, 2.0, 50.0)
    assert rows[3]["served_ms"] is None
    assert rows[3]["speedup"] == 1.5
    s = summarize(rows, skipped=[{"suite": "zoo", "name": "d", "precision": "fp16", "layout": "cl"}],
                      errors=["boom"])
    t = s["zoo"]["tf32/nchw"]
    assert t["rows"] == 3
    assert t["timed"] == 3
    assert t["geomean_speedup"] == pytest.approx(1.0)  # (2 * 0.5 * 1) ** (1/3)
    assert t["at_or_above_1x"] == 2
    assert (t["min_speedup"], t["min_name"]) == (0.5, "b")
    assert (t["big_layers"], t["big_at_half_floor"]) == (2, 1)
    assert t["incorrect"] == 1
    assert t["geomean_served_speedup"] == pytest.approx(1.0)
    assert s["zoo"]["bf16/cl"]["geomean_speedup"] == 1.5
    assert s["zoo"]["bf16/cl"]["geomean_served_speedup"] is None
    assert s["kernelbench"]["tf32/nchw"]["geomean_speedup"] == 2.0
    assert "tf32/cl" not in s["zoo"]
    assert s["incorrect"] == ["c/tf32/nchw"]
    assert s["skipped"][0]["name"] == "d"
    assert s["errors"] == ["boom"]
    assert geomean([4.0, 1.0]) == pytest.approx(2.0)
    doc = document("NVIDIA H100 80GB HBM3", "2.11", 91900, CEILINGS, rows, [], s)
    assert tuple(doc) == DOC_KEYS
    json.loads(json.dumps(doc, allow_nan=False))  # strict JSON: no NaN or Infinity anywhere
    text = report(doc)
    assert "!!! WRONG RESULT: c/tf32/nchw" in text
    assert "SKIPPED 1 rows" in text
    assert "--only d" in text
    assert "ERROR: boom" in text


def test_failed_row_has_no_speedup() -> None:
    r = make_row({"name": "x", "suite": "zoo"}, "fp16", "cl", ours_ms=None, served_ms=None, cudnn_nchw_ms=1.0,
                     cudnn_cl_ms=None, gflop=1.0, floor=0.1, choice="-", max_rel_err=math.inf, correct=False)
    assert r["speedup"] is None
    assert r["pct_of_floor"] is None
    assert r["max_rel_err"] is None
    assert r["best_cudnn_ms"] == 1.0
    s = summarize([r])
    assert s["zoo"]["fp16/cl"]["geomean_speedup"] is None
    assert s["incorrect"] == ["x/fp16/cl"]


def _doc(device: str, rows: list[dict], skipped: list[dict], check: list[dict]) -> dict:
    return document(device, "2.11", 91900, CEILINGS, rows, check, summarize(rows, check, skipped))


def test_merge_partial_files(tmp_path: Path) -> None:
    first = _doc("NVIDIA H200", [_row("unet-up1", "tf32", "nchw", 1.0, 2.0, 2.0), _row("kb57", "bf16", "cl", 1.0,
                                                                                    1.0, 1.0, suite="kernelbench")],
                 [{"suite": "zoo", "name": "maskhead", "precision": "tf32", "layout": "nchw"},
                  {"suite": "zoo", "name": "maskhead", "precision": "tf32", "layout": "cl"}],
                 [{"id": 57, "seed": 0, "choice": "default", "passed": False, "max_abs_diff": 2e-4}])
    second = _doc("NVIDIA H200", [_row("maskhead", "tf32", "nchw", 1.0, 4.0, 4.0),
                                  _row("unet-up1", "tf32", "nchw", 0.5, 2.0, 2.0)], [],
                  [{"id": 57, "seed": 0, "choice": "default", "passed": True, "max_abs_diff": 5e-5}])
    m = merge([first, second])
    keys = [(r["name"], r["precision"], r["layout"]) for r in m["rows"]]
    assert keys == [("unet-up1", "tf32", "nchw"), ("maskhead", "tf32", "nchw"), ("kb57", "bf16", "cl")]  # zoo order
    assert next(r for r in m["rows"] if r["name"] == "unet-up1")["speedup"] == 4.0  # the later file wins
    assert m["summary"]["skipped"] == [{"suite": "zoo", "name": "maskhead", "precision": "tf32", "layout": "cl"}]
    assert m["kernelbench_check"] == [{"id": 57, "seed": 0, "choice": "default", "passed": True,
                                       "max_abs_diff": 5e-5}]
    assert m["summary"]["kernelbench_check"] == {"passed": 1, "total": 1, "failed": []}
    assert len(m["summary"]["sources"]) == 2
    assert tuple(m) == DOC_KEYS
    with pytest.raises(ValueError, match="different devices"):
        merge([first, _doc("NVIDIA H100 80GB HBM3", [], [], [])])
    with pytest.raises(ValueError, match="nothing to merge"):
        merge([])
    # the command line: files in, one file out, the report printed
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(first))
    b.write_text(json.dumps(second))
    zoo.main(["--merge", str(a), str(b), "--out", str(tmp_path / "out")])
    assert json.loads((tmp_path / "out" / "layer_zoo-nvidia-h200.json").read_text()) == json.loads(json.dumps(m))


@pytest.fixture
def cpu_zoo(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/kernels/zoo.py's row logic on CPU tensors: kernels.conv_transpose2d runs PyTorch's reference there; the
    served call, the tuner's label and the timer get stand-ins."""
    monkeypatch.setattr(zoo, "DEVICE", "cpu")

    def served_call(x, w, b, args, mode):
        def fn(out=None):
            y = F.conv_transpose2d(x, w, b, args.stride, args.padding, args.output_padding, args.groups,
                                   args.dilation)
            if out is not None:
                out.copy_(y)
            return (y if out is None else out), "simt"
        return fn, DEFAULT

    monkeypatch.setattr(zoo, "served_call", served_call)
    monkeypatch.setattr(zoo, "tuned_choice", lambda *a: DEFAULT)


def _timer(fn) -> float:
    fn()
    return 0.5


SMALL = spec("small", "zoo", 2, 8, 6, [3, 3], [2, 2], [1, 1], [1, 1], 2, [1, 1], 5, 4, True)


@pytest.mark.usefixtures("cpu_zoo")
def test_run_unit_on_cpu() -> None:
    logs: list[str] = []
    errors: list[str] = []
    rows = zoo.run_unit(SMALL, "bf16", LAYOUTS, _timer, CEILINGS, zoo.RefCache(), logs.append, errors)
    assert [(r["layout"], r["correct"]) for r in rows] == [("nchw", True), ("cl", True)], logs
    assert errors == []
    nchw, cl = rows
    assert nchw["served_ms"] == 0.5
    assert cl["served_ms"] is None
    assert nchw["cudnn_nchw_ms"] == cl["cudnn_nchw_ms"] == 0.5
    assert nchw["speedup"] == 1.0
    assert nchw["max_rel_err"] <= ZOO_TOL["bf16"]
    assert nchw["choice"] == "default"
    assert nchw["gflop"] == pytest.approx(zoo.useful_flops(SMALL) / 1e9, rel=1e-3)
    assert len(logs) == 2
    assert all("small" in line for line in logs)


@pytest.mark.usefixtures("cpu_zoo")
def test_run_unit_keeps_the_smaller_of_two_medians() -> None:
    """Every figure is timed twice (a slow spell of the machine during one median does not make the row), and the
    smaller median is kept: here each call's first median is the slow one."""
    timed: dict[int, int] = {}

    def timer(fn) -> float:
        fn()
        timed[id(fn)] = timed.get(id(fn), 0) + 1
        return 2.0 if timed[id(fn)] == 1 else 1.0

    errors: list[str] = []
    rows = zoo.run_unit(SMALL, "fp32", LAYOUTS, timer, CEILINGS, zoo.RefCache(), lambda _: None, errors)
    assert errors == []
    assert sorted(timed.values()) == [2] * 5  # ours in both layouts, served, cuDNN in both layouts
    for r in rows:
        assert r["ours_ms"] == r["cudnn_nchw_ms"] == r["cudnn_cl_ms"] == 1.0
    assert rows[0]["served_ms"] == 1.0


@pytest.mark.usefixtures("cpu_zoo")
@pytest.mark.parametrize("bad", ["noise", "nan", "raise"])
def test_run_unit_flags_wrong_results(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    real = zoo.kernels.conv_transpose2d

    def wrong(x, *args, **kw):
        y = real(x, *args, **kw)
        if bad == "raise":
            raise RuntimeError("kernel failed")
        y = y.clone()
        y.view(-1)[3] = float("nan") if bad == "nan" else y.view(-1)[3] + 100.0
        return y

    monkeypatch.setattr(zoo.kernels, "conv_transpose2d", wrong)
    logs: list[str] = []
    errors: list[str] = []
    refs = zoo.RefCache()
    rows = zoo.run_unit(SMALL, "fp32", LAYOUTS, _timer, CEILINGS, refs, logs.append, errors)
    assert [r["correct"] for r in rows] == [False, False]
    assert any("WRONG RESULT small/fp32/nchw" in line for line in logs)
    if bad == "noise":
        assert rows[0]["max_rel_err"] > ZOO_TOL["fp32"]
    else:
        assert rows[0]["max_rel_err"] is None
    if bad == "raise":
        assert rows[0]["ours_ms"] is None
        assert rows[0]["speedup"] is None
        assert len(errors) == 2
    # tf32 reuses the reference of the same float32 input
    assert refs.key == ("small", torch.float32)


@pytest.mark.usefixtures("cpu_zoo")
def test_budget_skips_rows_and_says_so() -> None:
    logs: list[str] = []
    rows: list[dict] = []
    skipped: list[dict] = []
    calls: list[int] = []
    zoo.run_problems([SMALL], ["fp16", "tf32"], ["cl"], _timer, CEILINGS, deadline=-1.0, log=logs.append,
                     errors=[], rows=rows, skipped=skipped, after_problem=lambda: calls.append(1))
    assert rows == []
    assert calls == [1]
    assert skipped == [{"suite": "zoo", "name": "small", "precision": p, "layout": "cl"} for p in ("tf32", "fp16")]
    zoo.run_problems([SMALL], ["tf32"], ["nchw"], _timer, CEILINGS, deadline=math.inf, log=logs.append, errors=[],
                     rows=rows, skipped=skipped)
    assert [(r["precision"], r["layout"], r["correct"]) for r in rows] == [("tf32", "nchw", True)]


@pytest.mark.usefixtures("cpu_zoo")
def test_kernelbench_check_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    kb = {"id": 99, "batch": 2, "in_channels": 4, "out_channels": 3, "kernel_size": [3, 3], "stride": [2, 2],
          "padding": [1, 1], "output_padding": [0, 0], "dilation": [1, 1], "groups": 1, "bias": False,
          "height": 5, "width": 6, "init_args": ["in_channels", "out_channels", "kernel_size", "stride", "padding"]}
    problem = {"name": "kb99", "kb": kb}
    errors: list[str] = []
    out = zoo.kernelbench_check([problem], lambda s: None, errors)
    assert [(c["seed"], c["choice"]) for c in out] == [(s, c) for s in range(5) for c in ("default", "measured")]
    assert all(c["passed"] for c in out)
    assert errors == []
    assert torch.backends.cudnn.allow_tf32
    assert not zoo.kernels.tuning.enabled()

    real = zoo.kernels.conv_transpose2d
    monkeypatch.setattr(zoo.kernels, "conv_transpose2d", lambda *a, **k: real(*a, **k) + 2e-3)
    # kernels.module imported the function by name: patch it there too
    monkeypatch.setattr("kernels.module.conv_transpose2d", lambda *a, **k: real(*a, **k) + 2e-3)
    bad = zoo.kernelbench_check([problem], lambda s: None, errors)
    assert not any(c["passed"] for c in bad)
    assert all(c["max_abs_diff"] == pytest.approx(2e-3, rel=1e-3) for c in bad)


def test_plot_from_json(tmp_path: Path) -> None:
    rows = [_row("unet-up1", p, lay, 1.0, s, s * 2) for p, s in (("tf32", 0.5), ("bf16", 2.0))
            for lay in ("nchw", "cl")]
    rows.append(_row("kb57", "fp32", "nchw", 1.0, 1.2, 1.5, suite="kernelbench", correct=False))
    path = tmp_path / "layer_zoo-test.json"
    path.write_text(json.dumps(_doc("Test GPU", rows, [], [])))
    png = plot_zoo.plot(path)
    assert png == tmp_path / "layer_zoo-test.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 5000


def test_command_line_without_gpu() -> None:
    env_py = [sys.executable, "-m", "bench.kernels.zoo"]
    help_text = subprocess.run([*env_py, "--help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for flag in ("--precisions", "--layouts", "--only", "--suite", "--out", "--merge", "--no-check", "--budget-s"):
        assert flag in help_text
    est = subprocess.run([*env_py, "--estimate", "--only", "unet-up1", "kb81"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert "unet-up1" in est
    assert "kb81" in est
    assert "estimated" in est
    bad = subprocess.run([*env_py, "--only", "no-such-layer"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0
    assert "no-such-layer" in bad.stderr
    assert zoo.estimate(zoo_problems(), PRECISIONS, LAYOUTS) < zoo.DEFAULT_BUDGET_S


@pytest.mark.usefixtures("cpu_zoo")
def test_dead_gpu_stops_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def fault(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(zoo.kernels, "conv_transpose2d", fault)
    monkeypatch.setattr(zoo, "gpu_alive", lambda: False)
    rows: list[dict] = []
    skipped: list[dict] = []
    errors: list[str] = []
    zoo.run_problems([SMALL], ["tf32", "bf16"], ["nchw"], _timer, CEILINGS, deadline=math.inf, log=lambda s: None,
                     errors=errors, rows=rows, skipped=skipped)
    assert [(r["precision"], r["correct"]) for r in rows] == [("tf32", False)]
    assert skipped == [{"suite": "zoo", "name": "small", "precision": "bf16", "layout": "nchw"}]
    assert "no longer works" in errors[-1]


def _peer(kind: str):
    """A stand-in for the CUTLASS peer's candidates: PyTorch's call under two names (one slow), a wrong one, or
    none that can run the problem."""
    def candidates(x, w, b, kw):
        if kind == "none":
            raise ValueError("no CUTLASS configuration runs this problem: {'a8': 'channels'}")
        good = lambda: F.conv_transpose2d(x, w, b, **kw)  # noqa: E731
        if kind == "wrong":
            return {"bad": lambda: good() + 1.0}
        return {"slow": good, "fast": good}
    return candidates


@pytest.mark.usefixtures("cpu_zoo")
def test_run_unit_times_the_peer_once_for_both_layouts() -> None:
    errors: list[str] = []
    rows = zoo.run_unit(SMALL, "bf16", LAYOUTS, _timer, CEILINGS, zoo.RefCache(), lambda _: None, errors,
                        _peer("good"))
    assert errors == []
    for r in rows:
        assert set(ROW_KEYS) < set(r)
        assert r["cutlass_config"] in ("slow", "fast")
        assert r["cutlass_ms"] == 0.5
        assert r["cutlass_correct"] is True
        assert r["cutlass_rel_err"] <= ZOO_TOL["bf16"]
        assert r["vs_cutlass"] == 1.0
    s = summarize(rows)["zoo"]["bf16/nchw"]
    assert (s["cutlass_rows"], s["geomean_vs_cutlass"], s["at_or_above_cutlass"]) == (1, 1.0, 1)
    assert (s["geomean_cutlass_vs_cudnn"], s["cutlass_beats_cudnn"]) == (1.0, 0)
    text = report(document("cpu", "2.11", None, CEILINGS, rows, [], summarize(rows)))
    assert "CUTLASS:" in text


@pytest.mark.usefixtures("cpu_zoo")
def test_run_unit_reports_a_wrong_or_absent_peer() -> None:
    errors: list[str] = []
    rows = zoo.run_unit(SMALL, "bf16", LAYOUTS, _timer, CEILINGS, zoo.RefCache(), lambda _: None, errors,
                        _peer("wrong"))
    assert [r["correct"] for r in rows] == [True, True]  # ours stay right; the peer's row fields say it is wrong
    assert all(r["cutlass_correct"] is False for r in rows)
    assert len(errors) == 1
    assert "CUTLASS bad wrong" in errors[0]
    errors.clear()
    rows = zoo.run_unit(SMALL, "bf16", LAYOUTS, _timer, CEILINGS, zoo.RefCache(), lambda _: None, errors,
                        _peer("none"))
    assert errors == []
    assert all(r["cutlass_ms"] is None and r["vs_cutlass"] is None and "channels" in r["cutlass_note"] for r in rows)
    assert "cutlass_rows" not in summarize(rows)["zoo"]["bf16/nchw"]
    rows = zoo.run_unit(SMALL, "fp32", LAYOUTS, _timer, CEILINGS, zoo.RefCache(), lambda _: None, errors,
                        _peer("good"))
    assert all(r["cutlass_ms"] is None and "exact fp32" in r["cutlass_note"] for r in rows)
    rows = zoo.run_unit(SMALL, "bf16", LAYOUTS, _timer, CEILINGS, zoo.RefCache(), lambda _: None, errors)
    assert all("cutlass_ms" not in r for r in rows)  # without a peer the rows are as before
