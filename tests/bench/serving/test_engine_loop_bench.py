"""bench/serving/engine_loop.py, the engine event loop's Python per request, runs against today's engine connection: a
few bursts of SUBMIT frames are answered and it prints its figure (the value itself is a benchmark's, not checked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_engine_loop_bench_runs(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "bench.serving.engine_loop", "--burst", "4", "--rounds", "3",
                           "--repeat", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bursts of 4: engine event loop" in done.stdout
    assert "us CPU per request (median" in done.stdout
