"""The layer repository: the bundled layers, and errors that name the file and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.config import DEFAULT_LAYER_REPOSITORY, Settings
from service.engine.registry import BatchLimits, RepositoryError, load_repository
from service.http.app import create_app

from ..conftest import run, write_layer

DEFAULTS = BatchLimits(max_batch_size=64, max_batch_bytes=1 << 28, max_queue_delay_ms=2.0, max_queue_size=256)


def test_bundled_repository_loads_and_is_small():
    reg = load_repository(DEFAULT_LAYER_REPOSITORY, DEFAULTS)
    names = set(reg.names())
    assert {"demo", "dcgan_up1", "dcgan_up2", "dcgan_up3", "dcgan_rgb", "dcgan_up2_bf16", "unet_up",
            "grouped_dilated"} <= names
    total = sum(p.stat().st_size for p in DEFAULT_LAYER_REPOSITORY.glob("*.safetensors"))
    assert total < 3 * 2**20
    dcgan = reg.get("dcgan_up1").config
    assert (dcgan.kernel_size, dcgan.stride, dcgan.padding, dcgan.bias) == ((4, 4), (2, 2), (1, 1), False)
    unet = reg.get("unet_up").config
    assert (unet.kernel_size, unet.stride) == ((2, 2), (2, 2))
    odd = reg.get("grouped_dilated").config
    assert odd.groups > 1
    assert odd.dilation[0] != odd.dilation[1]
    assert odd.kernel_size[0] != odd.kernel_size[1]
    assert reg.get("dcgan_up2_bf16").dtype == torch.bfloat16
    assert reg.get("demo").dtype == torch.float32
    # The bf16 layer holds dcgan_up2's weights, rounded.
    assert torch.equal(reg.get("dcgan_up2_bf16").weight, reg.get("dcgan_up2").weight.to(torch.bfloat16))


def test_describe_has_the_protocol_fields():
    layer = load_repository(DEFAULT_LAYER_REPOSITORY, DEFAULTS).get("grouped_dilated")
    d = layer.describe()
    for key in ("name", "in_channels", "out_channels", "kernel_size", "stride", "padding", "output_padding",
                "dilation", "groups", "bias", "dtype", "precision", "max_batch_size", "max_batch_bytes",
                "max_queue_delay_ms", "max_queue_size", "max_height", "max_width", "input_shape", "output_size"):
        assert key in d
    assert d["input_shape"] == [-1, 48, -1, -1]
    assert d["output_size"] == ("H_out = (H - 1) * 2 - 2 * 1 + 1 * (3 - 1) + 1 + 1; "
                                "W_out = (W - 1) * 1 - 2 * 2 + 2 * (5 - 1) + 0 + 1")
    c = layer.config
    y = torch.nn.functional.conv_transpose2d(torch.zeros(1, 48, 5, 7), layer.weight, layer.bias, c.stride, c.padding,
                                             c.output_padding, c.groups, c.dilation)
    assert layer.output_hw(5, 7) == tuple(y.shape[2:]) == (10, 11)


def test_output_bytes_match_the_output_tensor_for_every_bundled_layer():
    for layer in load_repository(DEFAULT_LAYER_REPOSITORY, DEFAULTS):
        c = layer.config
        for n, h, w in ((1, 5, 7), (3, 5, 7), (2, 9, 4), (1, 5, 7)):  # the repeat comes from the cache
            x = torch.zeros(n, c.in_channels, h, w, dtype=layer.dtype)
            y = torch.nn.functional.conv_transpose2d(x.float(), layer.weight.float(), None, c.stride, c.padding,
                                                     c.output_padding, c.groups, c.dilation).to(layer.dtype)
            assert layer.output_bytes(n, h, w) == y.numel() * y.element_size(), (c.name, n, h, w)


def test_limits_come_from_the_config_else_the_defaults(tmp_path):
    write_layer(tmp_path, "own", limits={"max_batch_size": 3, "max_queue_delay_ms": 9.0})
    write_layer(tmp_path, "inherits")
    reg = load_repository(tmp_path, DEFAULTS)
    assert reg.get("own").limits == BatchLimits(3, DEFAULTS.max_batch_bytes, 9.0, DEFAULTS.max_queue_size)
    assert reg.get("inherits").limits == DEFAULTS


def _valid(tmp_path: Path) -> tuple[Path, Path]:
    write_layer(tmp_path, "up", 4, 6, 3, stride=2, padding=1, output_padding=1)
    return tmp_path / "up.json", tmp_path / "up.safetensors"


def _edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(("changes", "expected"), [
    ({"stride": 0}, "up.json: field 'stride': must be positive"),
    ({"stride": [2, 2, 2]}, "up.json: field 'stride'"),
    ({"padding": -1}, "up.json: field 'padding': must be non-negative"),
    ({"in_channels": None}, "up.json: field 'in_channels': Field required"),
    ({"colour": "blue"}, "up.json: field 'colour': Extra inputs are not permitted"),
    ({"dtype": "int8"}, "up.json: field 'dtype'"),
    ({"precision": "bf16"}, "up.json: precision 'bf16' does not fit dtype float32"),
    ({"name": "other"}, "up.json: field 'name': 'other' must equal the file name's stem 'up'"),
    ({"output_padding": 2}, "output_padding [2, 2] must be smaller than max(stride, dilation)"),
    ({"groups": 4}, "must be a multiple of groups"),
    ({"max_batch_size": 0}, "up.json: field 'max_batch_size'"),
])
def test_config_errors_name_file_and_field(tmp_path, changes, expected):
    config, _ = _valid(tmp_path)
    _edit_config(config, **changes)
    with pytest.raises(RepositoryError) as info:
        load_repository(tmp_path, DEFAULTS)
    assert expected in str(info.value)


def _edit_weights(path: Path, **changes: torch.Tensor | None) -> None:
    tensors = load_file(str(path))
    for key, value in changes.items():
        if value is None:
            tensors.pop(key)
        else:
            tensors[key] = value
    save_file(tensors, str(path))


@pytest.mark.parametrize(("changes", "expected"), [
    ({"weight": torch.zeros(6, 4, 3, 3)}, "up.safetensors: tensor 'weight': shape [6, 4, 3, 3], the config needs "
                                          "[4, 6, 3, 3]"),
    ({"weight": torch.zeros(4, 6, 3, 3, dtype=torch.float64)}, "up.safetensors: tensor 'weight': dtype torch.float64"),
    ({"bias": None}, "up.safetensors: tensor 'bias': missing (the config says bias: true)"),
    ({"extra": torch.zeros(1)}, "up.safetensors: tensor 'extra': not expected"),
    ({"weight": torch.full((4, 6, 3, 3), float("nan"))}, "up.safetensors: tensor 'weight': holds NaN"),
])
def test_weight_errors_name_file_and_tensor(tmp_path, changes, expected):
    _, weights = _valid(tmp_path)
    _edit_weights(weights, **changes)
    with pytest.raises(RepositoryError) as info:
        load_repository(tmp_path, DEFAULTS)
    assert expected in str(info.value)
    if "NaN" in expected:  # values are not read without the weights: the engine process catches these
        assert load_repository(tmp_path, DEFAULTS, weights=False).get("up") is not None
        return
    with pytest.raises(RepositoryError) as info:  # shapes and dtypes are checked from the header alone
        load_repository(tmp_path, DEFAULTS, weights=False)
    assert expected in str(info.value)


def test_shapes_only_repository_matches_without_holding_weights():
    full = load_repository(DEFAULT_LAYER_REPOSITORY, DEFAULTS)
    light = load_repository(DEFAULT_LAYER_REPOSITORY, DEFAULTS, weights=False)
    assert light.names() == full.names()
    for layer in full:
        other = light.get(layer.name)
        assert other.describe() == layer.describe()
        for t, u in ((layer.weight, other.weight), (layer.bias, other.bias)):
            if t is None:
                assert u is None
            else:
                assert u.is_meta
                assert (u.shape, u.dtype) == (t.shape, t.dtype)


def test_file_level_errors(tmp_path):
    _, weights = _valid(tmp_path)
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "orphan.safetensors").write_bytes(weights.read_bytes())
    (tmp_path / "notes.md").write_text("ignored")
    weights.write_bytes(b"garbage")
    with pytest.raises(RepositoryError) as info:
        load_repository(tmp_path, DEFAULTS)
    problems = info.value.problems
    assert any("broken.json: not valid JSON" in p for p in problems)
    assert any("orphan.safetensors: weights without a config" in p for p in problems)
    assert any("up.safetensors: cannot read as safetensors" in p for p in problems)
    assert len(problems) == 3


def test_missing_weights_and_unexpected_bias(tmp_path):
    write_layer(tmp_path, "nobias", bias=False)
    write_layer(tmp_path, "gone")
    (tmp_path / "gone.safetensors").unlink()
    _edit_weights(tmp_path / "nobias.safetensors", bias=torch.zeros(6))
    with pytest.raises(RepositoryError) as info:
        load_repository(tmp_path, DEFAULTS)
    text = str(info.value)
    assert "gone.safetensors: missing" in text
    assert "nobias.safetensors: tensor 'bias': not expected (the config says bias: false)" in text


def test_empty_or_missing_directory(tmp_path):
    with pytest.raises(RepositoryError, match="holds no layer configs"):
        load_repository(tmp_path, DEFAULTS)
    with pytest.raises(RepositoryError, match="not a directory"):
        load_repository(tmp_path / "nope", DEFAULTS)


def test_app_does_not_start_with_an_invalid_repository(tmp_path):
    config, _ = _valid(tmp_path)
    _edit_config(config, kernel_size=0)
    app = create_app(Settings(layer_repository=tmp_path, devices="cpu"))

    async def start() -> None:
        async with app.router.lifespan_context(app):
            raise AssertionError("the app started")

    with pytest.raises(RepositoryError, match=r"up\.json: field 'kernel_size'"):
        run(start())
