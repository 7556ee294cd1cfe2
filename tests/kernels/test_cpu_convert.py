"""``kernels.convert``: swaps every plain nn.ConvTranspose2d in place and changes nothing else."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import kernels
from tests.kernels.models import Decoder, Model, ScaledConvTranspose2d


def _snapshot(model: nn.Module) -> dict:
    """Identity, storage and class of every parameter and module, to compare before and after convert()."""
    return {
        "params": {name: (p, p.data_ptr(), p.requires_grad) for name, p in model.named_parameters()},
        "modules": {name: (m, type(m)) for name, m in model.named_modules()},
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "training": {name: m.training for name, m in model.named_modules()},
    }


def _assert_same_outputs(actual: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    """The converted model computes what the original did. On the CPU both run PyTorch's own convolutions, whose
    results are not bitwise reproducible from one call to the next over a whole test session (seen once in the full
    suite: ~1e-5 relative in the nested model's output; one or two threads, input alignment and a loaded CPU did not
    reproduce it alone), so outputs compare to a tolerance far below what a wrong conversion changes (a wrong
    stride, padding, weight or bias moves them by ~1e-1 and more)."""
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5, msg=name or None)


def _assert_converted(model: nn.Module, before: dict) -> None:
    params = dict(model.named_parameters())
    assert params.keys() == before["params"].keys()
    for name, (p, ptr, requires_grad) in before["params"].items():
        assert params[name] is p, name  # the very same Parameter objects
        assert params[name].data_ptr() == ptr, name
        assert params[name].requires_grad == requires_grad
    modules = dict(model.named_modules())
    assert modules.keys() == before["modules"].keys()
    for name, (module, cls) in before["modules"].items():
        assert modules[name] is module, name  # converted in place: same module objects
        if cls is nn.ConvTranspose2d:
            assert type(module) is kernels.ConvTranspose2d, name
        else:
            assert type(module) is cls, name  # everything else untouched, subclasses included
        assert module.training == before["training"][name]
    state = model.state_dict()
    assert state.keys() == before["state"].keys()
    for k, v in before["state"].items():
        assert torch.equal(state[k], v)


@pytest.mark.parametrize(
    ("args", "kwargs", "x_shape"),
    [
        ((32, 16, 3), {}, (2, 32, 8, 8)),
        ((16, 8, (3, 5)), {"stride": (2, 3), "padding": (1, 2), "output_padding": (1, 0)}, (2, 16, 5, 6)),
        ((8, 12, 4), {"stride": 2, "padding": 1, "groups": 4, "bias": True}, (3, 8, 6, 6)),
    ],
)
def test_kernelbench_model(args, kwargs, x_shape):
    torch.manual_seed(0)
    model = Model(*args, **kwargs)
    x = torch.randn(x_shape)
    y_before = model(x)
    before = _snapshot(model)
    model_new = kernels.convert(model)
    assert model_new is model
    _assert_converted(model, before)
    assert type(model.conv_transpose2d) is kernels.ConvTranspose2d
    assert model.conv_transpose2d.precision is None
    _assert_same_outputs(model(x), y_before)


def test_kernelbench_model_one_liner_matches_a_fresh_model():
    # ModelNew = convert(Model(*init_inputs)) gives the same weights as Model(*init_inputs) for the same seed.
    torch.manual_seed(1)
    reference = Model(8, 4, 3, 2, 1, 1)
    torch.manual_seed(1)
    converted = kernels.convert(Model(8, 4, 3, 2, 1, 1))
    x = torch.randn(2, 8, 7, 7)
    _assert_same_outputs(converted(x), reference(x))


def test_nested_model():
    torch.manual_seed(2)
    model = Decoder().eval()
    model.body[0].train()  # mixed training modes survive
    model.heads["rgb"].weight.requires_grad_(False)
    x = torch.randn(2, 8, 5, 6)
    y_before = model(x)
    before = _snapshot(model)
    kernels.convert(model)
    _assert_converted(model, before)

    converted = {name for name, m in model.named_modules() if type(m) is kernels.ConvTranspose2d}
    assert converted == {"body.0", "body.3", "heads.rgb"}
    assert type(model.body[4][1]) is ScaledConvTranspose2d  # a subclass with its own forward: left alone
    assert type(model.body[2]) is nn.Conv2d
    assert type(model.heads["mask"]) is nn.Conv2d
    assert model.body[0].training
    assert not model.body[3].training
    y_after = model(x)
    assert y_after.shape == (2, 4, 20, 24)
    _assert_same_outputs(y_after, y_before)


def test_nested_model_gradients_unchanged():
    torch.manual_seed(3)
    ref = Decoder()
    model = Decoder()
    model.load_state_dict(ref.state_dict())
    kernels.convert(model)
    x = torch.randn(1, 8, 4, 4)
    ref(x).square().sum().backward()
    model(x).square().sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        _assert_same_outputs(p.grad, q.grad, name)


def test_model_that_is_a_conv_transpose2d():
    torch.manual_seed(4)
    layer = nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2)
    weight, bias = layer.weight, layer.bias
    x = torch.randn(2, 4, 5, 5)
    y_before = layer(x)
    out = kernels.convert(layer, precision="fp32")
    assert out is layer
    assert type(layer) is kernels.ConvTranspose2d
    assert layer.weight is weight
    assert layer.bias is bias
    assert layer.precision == "fp32"
    _assert_same_outputs(layer(x), y_before)


def test_subclass_at_the_top_is_left_alone():
    layer = ScaledConvTranspose2d(4, 4, 3)
    assert kernels.convert(layer, precision="tf32") is layer
    assert type(layer) is ScaledConvTranspose2d
    assert not hasattr(layer, "precision")


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
def test_precision_propagates(precision):
    model = Decoder()
    kernels.convert(model, precision=precision)
    precisions = {
        name: m.precision for name, m in model.named_modules() if isinstance(m, kernels.ConvTranspose2d)
    }
    assert precisions == {"body.0": precision, "body.3": precision, "heads.rgb": precision}
    assert "precision" not in vars(model.body[4][1])
    assert repr(model.body[0]).endswith(f", precision='{precision}')")


def test_precision_none_leaves_existing_precision():
    model = Decoder()
    kernels.convert(model, precision="tf32")
    kernels.convert(model)
    assert model.body[0].precision == "tf32"
    kernels.convert(model, precision="fp32")
    assert model.body[0].precision == "fp32"
    assert model.heads["rgb"].precision == "fp32"


def test_already_kernels_modules_take_the_new_precision():
    model = nn.Sequential(kernels.ConvTranspose2d(2, 2, 3), nn.ConvTranspose2d(2, 2, 3))
    kernels.convert(model, precision="fp32")
    assert [m.precision for m in model] == ["fp32", "fp32"]


def test_idempotent():
    torch.manual_seed(5)
    model = Decoder()
    x = torch.randn(1, 8, 4, 5)
    y_before = model(x)
    kernels.convert(model)
    before = _snapshot(model)
    assert kernels.convert(model) is model
    _assert_converted(model, before)
    assert {name for name, m in model.named_modules() if type(m) is kernels.ConvTranspose2d} == {
        "body.0", "body.3", "heads.rgb"
    }
    _assert_same_outputs(model(x), y_before)


def test_invalid_precision_raises_and_changes_nothing():
    model = Decoder()
    with pytest.raises(ValueError, match=r"precision must be one of \('fp32', 'tf32'\) or None"):
        kernels.convert(model, precision="bf16")
    assert type(model.body[0]) is nn.ConvTranspose2d


def test_hooks_survive():
    model = Model(4, 4, 3)
    seen = []
    model.conv_transpose2d.register_forward_hook(lambda module, inputs, output: seen.append(output.shape))
    kernels.convert(model)
    model(torch.randn(1, 4, 3, 3))
    assert seen == [(1, 4, 5, 5)]


def test_other_padding_mode_left_untouched():
    # nn.ConvTranspose2d only runs padding_mode='zeros'; a module whose mode was changed after construction
    # is not ours to run.
    layer = nn.ConvTranspose2d(2, 2, 3)
    layer.padding_mode = "reflect"
    kernels.convert(layer)
    assert type(layer) is nn.ConvTranspose2d


def test_state_dict_loads_into_an_unconverted_model():
    torch.manual_seed(6)
    model = kernels.convert(Decoder())
    plain = Decoder()
    plain.load_state_dict(model.state_dict(), strict=True)
    x = torch.randn(1, 8, 3, 3)
    _assert_same_outputs(plain(x), model(x))


def test_layer_built_with_numpy_integers_still_runs_after_convert():
    # Hyper-parameters read with numpy (np.int64) are fine for nn.ConvTranspose2d, which stores them as they are;
    # after convert() the forward reads them the same way (kernels/internal.py _pair takes any integer by
    # operator.index).
    layer = nn.ConvTranspose2d(4, 6, 3, stride=np.int64(2), padding=np.int64(1), groups=np.int64(2))
    x = torch.randn(1, 4, 5, 5)
    y_before = layer(x)
    kernels.convert(layer)
    _assert_same_outputs(layer(x), y_before)
