"""``bench/serving/grpc_load.py`` runs as the lead runs it, bounded: a CPU server started by the script, both protocols,
two sizes, every answer checked and one output of each against PyTorch in float64."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serving import grpc_load

from ...service.conftest import REPO_ROOT

pytest.importorskip("tritonclient.grpc")


def test_sizes_are_parsed() -> None:
    assert grpc_load.parse_sizes("tiny=16x16, 4mib=256x256") == [("tiny", 16, 16), ("4mib", 256, 256)]
    with pytest.raises(SystemExit):
        grpc_load.parse_sizes("tiny=16")


def test_a_bounded_run_measures_both_protocols(tmp_path: Path) -> None:
    out = tmp_path / "grpc_load.json"
    run = subprocess.run([sys.executable, "-m", "bench.serving.grpc_load", "--devices", "cpu", "--sizes",
                          "tiny=8x8,big=64x64", "--clients", "2", "--procs", "1", "--requests", "30", "--warmup", "4",
                          "--out", str(out)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(r["size"], r["protocol"]) for r in rows] == [("tiny", "http"), ("tiny", "grpc"), ("big", "http"),
                                                          ("big", "grpc")]
    for r in rows:
        assert r["ok"] == 30, r
        assert r["errors"] == 0, r
        assert r["rel_err"] < 1e-5, r
        assert r["server_cpu_ms_per_request"] > 0, r
    assert rows[2]["input_bytes"] == 16 * 64 * 64 * 4  # the bundled demo layer: 16 input channels, float32
    assert "grpc" in run.stdout
