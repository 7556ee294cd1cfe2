"""Measured kernel choice in the service: layers' warm_shapes (config, export, CLI), the batch-size buckets a
serving batch is tuned at, and the pool's warm-up run of every warm shape at every bucket on every worker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kernels.tuning import DEFAULT, KernelChoice
from service.engine.paths import kernel_forward, serving_choice
from service.engine.pool import WorkerPool, batch_buckets
from service.engine.registry import MAX_WARM_SHAPES, BatchLimits, Layer, RepositoryError, load_repository
from service.engine.worker import Worker
from service.export import ExportError, export_model, main

from ..conftest import run, write_layer

DEFAULTS = BatchLimits(max_batch_size=64, max_batch_bytes=1 << 28, max_queue_delay_ms=2.0, max_queue_size=256)
TUNED = KernelChoice("tensor_core", 5, 2)


def _small_model() -> nn.Module:
    """For the export CLI (``tests.service.engine.test_tuning_service:_small_model``)."""
    torch.manual_seed(1)
    return nn.Sequential(nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1), nn.ReLU(),
                         nn.ConvTranspose2d(6, 2, 4, stride=2, padding=1, bias=False))


def _layer(root: Path, name: str = "up", warm_shapes: list[list[int]] | None = None,
           limits: dict[str, Any] | None = None, defaults: BatchLimits = DEFAULTS) -> Layer:
    """A 4 -> 6 channel, 3x3, stride-1 layer (output H + 2, W + 2) with these warm_shapes, loaded."""
    torch.manual_seed(0)
    export_model(nn.ConvTranspose2d(4, 6, 3), root, dtype=torch.float32, precision="fp32", names={"": name},
                 limits=limits, warm_shapes=warm_shapes or (), overwrite=True)
    layer = load_repository(root, defaults).get(name)
    assert layer is not None
    return layer


def _edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


# --- warm_shapes in configs ------------------------------------------------------------------------------------


def test_warm_shapes_load_and_are_described(tmp_path):
    write_layer(tmp_path, "up", 4, 6, 3, stride=2, padding=1, output_padding=1)
    write_layer(tmp_path, "cold")
    _edit_config(tmp_path / "up.json", warm_shapes=[[8, 8], [4, 6], [16, 1]], max_height=16, max_width=16)
    reg = load_repository(tmp_path, DEFAULTS)
    up = reg.get("up")
    assert up is not None
    assert up.config.warm_shapes == ((8, 8), (4, 6), (16, 1))
    assert up.describe()["warm_shapes"] == [[8, 8], [4, 6], [16, 1]]
    json.dumps(up.describe())  # still JSON
    cold = reg.get("cold")
    assert cold is not None
    assert cold.config.warm_shapes == ()
    assert cold.describe()["warm_shapes"] == []


def test_warm_shapes_up_to_the_limits_are_valid(tmp_path):
    write_layer(tmp_path, "up")
    shapes = [[16, 32]] + [[1, 1]] * (MAX_WARM_SHAPES - 1)
    _edit_config(tmp_path / "up.json", warm_shapes=shapes, max_height=16, max_width=32)
    layer = load_repository(tmp_path, DEFAULTS).get("up")
    assert layer is not None
    assert len(layer.config.warm_shapes) == MAX_WARM_SHAPES


@pytest.mark.parametrize(("changes", "expected"), [
    ({"warm_shapes": [[8, 8]] * (MAX_WARM_SHAPES + 1)},
     f"up.json: field 'warm_shapes': must be a list of at most {MAX_WARM_SHAPES} [height, width] pairs"),
    ({"warm_shapes": "8x8"}, "up.json: field 'warm_shapes': must be a list"),
    ({"warm_shapes": {"h": 8, "w": 8}}, "up.json: field 'warm_shapes': must be a list"),
    ({"warm_shapes": [[8, 8, 8]]}, "up.json: field 'warm_shapes': must be a list of at most"),
    ({"warm_shapes": [5]}, "up.json: field 'warm_shapes': must be a list of at most"),
    ({"warm_shapes": [[8, "8"]]}, "up.json: field 'warm_shapes': must be an int or a pair of ints"),
    ({"warm_shapes": [[True, 8]]}, "up.json: field 'warm_shapes': must be an int or a pair of ints"),
    ({"warm_shapes": [[8, 8], [2000, 8]]}, "up.json: warm_shapes entry [2000, 8] must lie within 1..max_height "
                                           "(1024) and 1..max_width (1024)"),
    ({"warm_shapes": [[8, 17]], "max_width": 16}, "up.json: warm_shapes entry [8, 17] must lie within"),
    ({"warm_shapes": [[0, 4]]}, "up.json: warm_shapes entry [0, 4] must lie within"),
    ({"warm_shapes": [[4, -1]]}, "up.json: warm_shapes entry [4, -1] must lie within"),
])
def test_warm_shapes_errors_name_file_and_field(tmp_path, changes, expected):
    write_layer(tmp_path, "up")
    _edit_config(tmp_path / "up.json", **changes)
    with pytest.raises(RepositoryError) as info:
        load_repository(tmp_path, DEFAULTS)
    assert expected in str(info.value)
    assert "warm_shapes" in str(info.value)


# --- export ----------------------------------------------------------------------------------------------------


def test_export_writes_warm_shapes(tmp_path):
    module = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1)
    export_model(module, tmp_path / "warm", names={"": "up"}, warm_shapes=[(8, 8), (4, 6)])
    export_model(module, tmp_path / "cold", names={"": "up"})
    cfg = json.loads((tmp_path / "warm" / "up.json").read_text())
    assert cfg["warm_shapes"] == [[8, 8], [4, 6]]
    assert "warm_shapes" not in json.loads((tmp_path / "cold" / "up.json").read_text())
    layer = load_repository(tmp_path / "warm", DEFAULTS).get("up")
    assert layer is not None
    assert layer.config.warm_shapes == ((8, 8), (4, 6))
    assert layer.describe()["warm_shapes"] == [[8, 8], [4, 6]]


@pytest.mark.parametrize("warm_shapes", [[(8, 8)] * (MAX_WARM_SHAPES + 1), [(8, 8), (2000, 8)]])
def test_export_refuses_warm_shapes_the_config_rejects(tmp_path, warm_shapes):
    with pytest.raises(ExportError, match=r"exported layer is invalid: .*warm_shapes"):
        export_model(nn.ConvTranspose2d(4, 6, 3), tmp_path, names={"": "up"}, warm_shapes=warm_shapes)


@pytest.mark.parametrize("warm_shapes", [[(0, 4)], [(8, 8, 8)], [(8.5, 8)], [8]])
def test_export_refuses_warm_shapes_that_are_not_positive_int_pairs_before_writing(tmp_path, warm_shapes):
    with pytest.raises(ExportError, match=r"warm_shapes must be \(height, width\) pairs of positive ints"):
        export_model(nn.ConvTranspose2d(4, 6, 3), tmp_path / "repo", names={"": "up"}, warm_shapes=warm_shapes)
    assert not (tmp_path / "repo").exists()


def test_export_cli_writes_warm_shapes_into_every_config(tmp_path):
    out = tmp_path / "repo"
    main([f"{__name__}:_small_model", "--out", str(out), "--prefix", "m_", "--warm-shape", "8", "8",
          "--warm-shape", "4", "6"])
    reg = load_repository(out, DEFAULTS)
    assert reg.names() == ["m_0", "m_2"]
    for name in reg.names():
        assert json.loads((out / f"{name}.json").read_text())["warm_shapes"] == [[8, 8], [4, 6]]
        layer = reg.get(name)
        assert layer is not None
        assert layer.config.warm_shapes == ((8, 8), (4, 6))


def test_export_cli_without_warm_shapes(tmp_path):
    out = tmp_path / "repo"
    main([f"{__name__}:_small_model", "--out", str(out)])
    configs = sorted(out.glob("*.json"))
    assert len(configs) == 2
    for path in configs:
        assert "warm_shapes" not in json.loads(path.read_text())


def test_export_cli_reports_an_invalid_warm_shape(tmp_path):
    with pytest.raises(SystemExit, match=r"export failed: warm_shapes must be .* got \[\[0, 4\]\]"):
        main([f"{__name__}:_small_model", "--out", str(tmp_path / "repo"), "--warm-shape", "0", "4"])


def test_export_cli_rejects_a_half_pair(tmp_path):
    with pytest.raises(SystemExit):
        main([f"{__name__}:_small_model", "--out", str(tmp_path / "repo"), "--warm-shape", "8"])
    assert not (tmp_path / "repo").exists()


# --- batch-size buckets and the serving choice -----------------------------------------------------------------


@pytest.mark.parametrize(("max_batch_size", "expected"), [
    (1, [1]),
    (2, [1, 2]),
    (3, [1, 2, 3]),
    (4, [1, 2, 4]),
    (50, [1, 2, 4, 8, 16, 32, 50]),
    (64, [1, 2, 4, 8, 16, 32, 64]),
    (65, [1, 2, 4, 8, 16, 32, 64, 65]),
])
def test_batch_buckets(max_batch_size: int, expected: list[int]) -> None:
    assert batch_buckets(max_batch_size) == expected


class RecordingTuner:
    """Stands in for kernels.tuning.TUNER: records what ``choose`` is asked."""

    def __init__(self, enabled: bool = True, answer: KernelChoice = TUNED) -> None:
        self.enabled = enabled
        self.answer = answer
        self.calls: list[tuple[Any, ...]] = []

    def choose(self, shape: Any, weight: torch.Tensor, bias: torch.Tensor | None, args: Any, precision: str,
               aligned: bool = True, packs: Any = None) -> KernelChoice:
        if not self.enabled:
            raise AssertionError("choose called while tuning is off")
        self.calls.append((tuple(shape), weight, bias, args, precision, aligned))
        self.packs = packs
        return self.answer


def test_serving_choice_is_the_default_when_tuning_is_off(tmp_path, monkeypatch):
    layer = _layer(tmp_path)
    tuner = RecordingTuner(enabled=False)
    monkeypatch.setattr("service.engine.paths.TUNER", tuner)
    assert serving_choice((3, 4, 8, 8), layer.weight, layer.bias, layer) is DEFAULT
    assert tuner.calls == []


@pytest.mark.parametrize(("n", "tuned_at"), [
    (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (17, 32), (32, 32),
    (33, 50), (49, 50), (50, 50),  # the bucket is capped at the max batch
    (60, 60),  # a batch over the max (one large request) is tuned at its own size
])
def test_serving_choice_tunes_at_the_batch_bucket(tmp_path, monkeypatch, n: int, tuned_at: int) -> None:
    layer = _layer(tmp_path, limits={"max_batch_size": 50})
    assert layer.limits.max_batch_size == 50
    tuner = RecordingTuner()
    monkeypatch.setattr("service.engine.paths.TUNER", tuner)
    assert serving_choice((n, 4, 7, 9), layer.weight, layer.bias, layer) == TUNED
    assert len(tuner.calls) == 1
    shape, weight, bias, args, precision, aligned = tuner.calls[0]
    assert shape == (tuned_at, 4, 7, 9)
    assert weight is layer.weight
    assert bias is layer.bias
    assert args == layer.args
    assert precision == "fp32"
    assert aligned is True
    assert tuned_at in batch_buckets(50) or tuned_at > 50


def test_serving_choice_passes_the_resolved_precision(tmp_path, monkeypatch):
    torch.manual_seed(0)
    export_model(nn.ConvTranspose2d(4, 6, 3), tmp_path, dtype=torch.float32, precision="tf32", names={"": "tf"})
    export_model(nn.ConvTranspose2d(4, 6, 3, bias=False), tmp_path, dtype=torch.bfloat16, names={"": "bf"})
    reg = load_repository(tmp_path, DEFAULTS)
    tuner = RecordingTuner()
    monkeypatch.setattr("service.engine.paths.TUNER", tuner)
    for name in ("tf", "bf"):
        layer = reg.get(name)
        assert layer is not None
        serving_choice((3, 4, 5, 5), layer.weight, layer.bias, layer)
    assert [(c[0], c[2] is None, c[4]) for c in tuner.calls] == [((4, 4, 5, 5), False, "tf32"),
                                                               ((4, 4, 5, 5), True, "fp32")]


# --- warm-up ---------------------------------------------------------------------------------------------------


def _counting_pool(num_workers: int, layer: Layer) -> tuple[WorkerPool, list[tuple[str, tuple[int, ...]]]]:
    calls: list[tuple[str, tuple[int, ...]]] = []

    def make(name: str) -> Worker:
        def counting(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, lay: Layer) -> torch.Tensor:
            calls.append((name, tuple(x.shape)))
            return kernel_forward(x, w, b, lay)

        worker = Worker(torch.device("cpu"), forward=counting)
        worker.name = name
        return worker

    pool = WorkerPool([make(f"w{i}") for i in range(num_workers)])
    pool.load(layer)
    return pool, calls


def test_warm_up_runs_every_shape_at_every_bucket_on_every_worker(tmp_path):
    layer = _layer(tmp_path, warm_shapes=[[8, 8], [3, 5]], limits={"max_batch_size": 4})
    pool, calls = _counting_pool(2, layer)
    try:
        runs = run(pool.warm_up(layer), 20)
    finally:
        pool.shutdown()
    buckets = batch_buckets(4)
    assert buckets == [1, 2, 4]
    assert runs == len(layer.config.warm_shapes) * len(buckets) * 2 == 12
    expected = sorted((w, (n, 4, h, wd)) for w in ("w0", "w1") for h, wd in ((8, 8), (3, 5)) for n in buckets)
    assert sorted(calls) == expected
    for worker in pool.workers:
        assert worker.inflight_batches == 0
        assert worker.inflight_samples == 0


def test_warm_up_without_warm_shapes_runs_nothing(tmp_path):
    layer = _layer(tmp_path)
    pool, calls = _counting_pool(1, layer)
    try:
        assert run(pool.warm_up(layer), 20) == 0
    finally:
        pool.shutdown()
    assert calls == []


def test_warm_up_skips_buckets_past_twice_the_batch_bytes(tmp_path):
    # 8x8 in -> 10x10 out: 6 * 100 * 4 = 2400 bytes a sample. With max_batch_bytes 2400, batches of 1 and 2 (4800
    # bytes, exactly twice) run and 4 (9600) is skipped; 2x3 in -> 4x5 out: 480 bytes a sample, every bucket runs.
    # 40x40 in -> 42x42 out is over the limit for a single sample, which still runs.
    layer = _layer(tmp_path, warm_shapes=[[8, 8], [2, 3], [40, 40]],
                   limits={"max_batch_size": 4, "max_batch_bytes": 2400})
    assert layer.limits.max_batch_bytes == 2400
    assert layer.output_hw(8, 8) == (10, 10)
    pool, calls = _counting_pool(1, layer)
    try:
        runs = run(pool.warm_up(layer), 20)
    finally:
        pool.shutdown()
    shapes = [shape for _, shape in calls]
    assert sorted(shapes) == sorted([(1, 4, 8, 8), (2, 4, 8, 8), (1, 4, 2, 3), (2, 4, 2, 3), (4, 4, 2, 3),
                                     (1, 4, 40, 40)])
    assert runs == len(shapes) == 6


def test_warm_up_reports_a_failing_batch(tmp_path):
    from service.errors import InternalError

    layer = _layer(tmp_path, warm_shapes=[[4, 4]], limits={"max_batch_size": 2})

    def broken(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, lay: Layer) -> torch.Tensor:
        raise RuntimeError("simulated kernel failure")

    worker = Worker(torch.device("cpu"), forward=broken)
    pool = WorkerPool([worker])
    pool.load(layer)
    try:
        with pytest.raises(InternalError):
            run(pool.warm_up(layer), 20)
    finally:
        pool.shutdown()
    assert worker.inflight_batches == 0


def test_serving_choice_hands_the_packs_to_the_tuner(tmp_path, monkeypatch):
    layer = _layer(tmp_path)
    tuner = RecordingTuner()
    monkeypatch.setattr("service.engine.paths.TUNER", tuner)
    packs = object()
    serving_choice((3, 4, 8, 8), layer.weight, layer.bias, layer, packs)  # type: ignore[arg-type]
    assert tuner.packs is packs
