"""bench/harness.py: the relative error, the device's name in file names, the result files, cuDNN's benchmark mode
put back after a timing; on a GPU, the timers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bench import harness


def test_rel_err() -> None:
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert harness.rel_err(torch.tensor([3.0, 4.0]), ref) == 0.0
    assert harness.rel_err(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert harness.rel_err(torch.tensor([3.0, float("nan")]), ref) == math.inf
    assert harness.rel_err(torch.tensor([float("inf"), 4.0]), ref) == math.inf


def test_device_names_in_file_names() -> None:
    assert harness.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert harness.short_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100"
    assert harness.short_slug("NVIDIA H200") == "nvidia-h200"
    assert harness.short_slug("Some GPU") == "some-gpu"


def test_write_makes_the_folder_and_replaces_the_file(tmp_path: Path) -> None:
    path = tmp_path / "out" / "result.json"
    harness.write(path, {"rows": [1]})
    assert path.read_text() == json.dumps({"rows": [1]}, indent=1) + "\n"
    harness.write(path, {"rows": [2]}, indent=2)
    assert path.read_text() == json.dumps({"rows": [2]}, indent=2) + "\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["result.json"]  # no temporary file left


def test_cudnn_benchmark_times_after_one_call_and_puts_the_flag_back() -> None:
    calls: list[bool] = []

    def fn() -> None:
        calls.append(torch.backends.cudnn.benchmark)

    def timer(f: object) -> float:
        fn()
        return 1.5

    before = torch.backends.cudnn.benchmark
    assert harness.cudnn_benchmark(timer, fn) == 1.5
    assert calls == [True, True]  # the untimed first call (cuDNN's algorithm search), then the timed ones
    assert torch.backends.cudnn.benchmark == before


@pytest.mark.cuda
def test_timers_on_the_gpu() -> None:
    x = torch.randn(1024, 1024, device="cuda")

    def fn() -> torch.Tensor:
        return x @ x

    assert harness.Timer(reps=3, warmup=1)(fn) > 0
    assert harness.AdaptiveTimer(target_ms=1.0, min_reps=2, max_reps=4)(fn) > 0
    assert harness.ColdTimer()(fn) > 0
    assert harness.warm_us(fn) > 0
