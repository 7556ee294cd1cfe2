"""``kernels.ConvTranspose2d`` is a drop-in ``nn.ConvTranspose2d``: signature, init, state_dict, forward."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch
from torch import nn

import kernels

CONSTRUCTORS = {
    "plain": ((4, 8, 3), {}),
    "upsample": ((8, 4, 4), {"stride": 2, "padding": 1}),
    "groups-no-bias": ((6, 9, (3, 5)), {"stride": (2, 1), "groups": 3, "bias": False}),
    "depthwise": ((4, 4, 3), {"groups": 4, "dilation": 2, "padding": 2}),
    "output-padding": ((3, 5, (2, 4)), {"stride": 3, "output_padding": (2, 1), "dilation": (1, 2)}),
    "1x1": ((16, 2, 1), {"bias": True}),
}


def _pair_of_modules(args, kwargs, seed=0, **ours_kwargs):
    torch.manual_seed(seed)
    ref = nn.ConvTranspose2d(*args, **kwargs)
    torch.manual_seed(seed)
    ours = kernels.ConvTranspose2d(*args, **kwargs, **ours_kwargs)
    return ref, ours


def test_is_an_nn_conv_transpose2d():
    layer = kernels.ConvTranspose2d(2, 3, 3)
    assert isinstance(layer, nn.ConvTranspose2d)
    assert issubclass(kernels.ConvTranspose2d, nn.ConvTranspose2d)
    assert layer.precision is None


def test_constructor_signature_is_pytorchs_plus_precision():
    theirs = list(inspect.signature(nn.ConvTranspose2d.__init__).parameters.values())
    ours = list(inspect.signature(kernels.ConvTranspose2d.__init__).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[:-1]] == [(p.name, p.kind, p.default) for p in theirs]
    extra = ours[-1]
    assert (extra.name, extra.kind, extra.default) == ("precision", inspect.Parameter.KEYWORD_ONLY, None)


def test_forward_signature_is_pytorchs():
    theirs = inspect.signature(nn.ConvTranspose2d.forward).parameters
    ours = inspect.signature(kernels.ConvTranspose2d.forward).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]


@pytest.mark.parametrize("name", CONSTRUCTORS)
def test_same_parameters_and_attributes(name):
    args, kwargs = CONSTRUCTORS[name]
    ref, ours = _pair_of_modules(args, kwargs)
    assert [(n, p.shape, p.dtype, p.requires_grad) for n, p in ours.named_parameters()] == [
        (n, p.shape, p.dtype, p.requires_grad) for n, p in ref.named_parameters()
    ]
    assert list(ours.named_buffers()) == list(ref.named_buffers()) == []
    attrs = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "output_padding", "groups",
             "dilation", "padding_mode", "transposed")
    for attr in attrs:
        assert getattr(ours, attr) == getattr(ref, attr), attr


@pytest.mark.parametrize("seed", [0, 1, 12345])
@pytest.mark.parametrize("name", CONSTRUCTORS)
def test_reset_parameters_identical_to_pytorch(name, seed):
    args, kwargs = CONSTRUCTORS[name]
    torch.manual_seed(seed)
    ref = nn.ConvTranspose2d(*args, **kwargs)
    next_ref = torch.rand(3)  # the generator state after construction
    torch.manual_seed(seed)
    ours = kernels.ConvTranspose2d(*args, **kwargs)
    next_ours = torch.rand(3)
    assert torch.equal(ours.weight, ref.weight)
    assert torch.equal(next_ours, next_ref)  # same number of random draws
    if kwargs.get("bias", True):
        assert torch.equal(ours.bias, ref.bias)
    else:
        assert ours.bias is None
        assert ref.bias is None
    # reset_parameters itself, called again later.
    torch.manual_seed(seed + 1)
    ref.reset_parameters()
    torch.manual_seed(seed + 1)
    ours.reset_parameters()
    assert torch.equal(ours.weight, ref.weight)
    if ours.bias is not None:
        assert torch.equal(ours.bias, ref.bias)


def test_different_seeds_give_different_weights():
    ref, ours = _pair_of_modules((4, 8, 3), {}, seed=0)
    _, other = _pair_of_modules((4, 8, 3), {}, seed=1)
    assert torch.equal(ours.weight, ref.weight)
    assert not torch.equal(ours.weight, other.weight)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_device_and_dtype_arguments(dtype):
    torch.manual_seed(3)
    ref = nn.ConvTranspose2d(4, 6, 3, groups=2, device="cpu", dtype=dtype)
    torch.manual_seed(3)
    ours = kernels.ConvTranspose2d(4, 6, 3, groups=2, device="cpu", dtype=dtype, precision="fp32")
    assert ours.weight.dtype == dtype
    assert ours.bias.dtype == dtype
    assert ours.weight.device.type == "cpu"
    assert torch.equal(ours.weight, ref.weight)
    x = torch.randn(2, 4, 5, 5, dtype=dtype)
    assert torch.equal(ours(x), ref(x))


@pytest.mark.parametrize("name", CONSTRUCTORS)
def test_state_dict_loads_both_ways(name):
    args, kwargs = CONSTRUCTORS[name]
    ref, ours = _pair_of_modules(args, kwargs, seed=1)
    _, donor = _pair_of_modules(args, kwargs, seed=2)  # different values, so a load is visible
    assert ours.state_dict().keys() == ref.state_dict().keys()
    assert "precision" not in ours.state_dict()

    ours.load_state_dict(donor.state_dict(), strict=True)  # kernels <- kernels
    ref.load_state_dict(ours.state_dict(), strict=True)  # nn <- kernels
    for key, value in donor.state_dict().items():
        assert torch.equal(ref.state_dict()[key], value)
    fresh_ref, fresh_ours = _pair_of_modules(args, kwargs, seed=3)
    fresh_ours.load_state_dict(fresh_ref.state_dict(), strict=True)  # kernels <- nn
    for key, value in fresh_ref.state_dict().items():
        assert torch.equal(fresh_ours.state_dict()[key], value)
    x = torch.randn(2, args[0], 5, 4)
    assert torch.equal(fresh_ours(x), fresh_ref(x))
    assert torch.equal(ref(x), ours(x))


def test_state_dict_with_missing_key_fails_strict():
    ref = nn.ConvTranspose2d(4, 6, 3, bias=False)
    ours = kernels.ConvTranspose2d(4, 6, 3, bias=True)
    with pytest.raises(RuntimeError, match="bias"):
        ours.load_state_dict(ref.state_dict(), strict=True)


@pytest.mark.parametrize("name", CONSTRUCTORS)
@pytest.mark.parametrize("unbatched", [False, True])
def test_forward_equals_pytorch(name, unbatched):
    args, kwargs = CONSTRUCTORS[name]
    ref, ours = _pair_of_modules(args, kwargs, seed=5)
    x = torch.randn(args[0], 6, 5) if unbatched else torch.randn(3, args[0], 6, 5)
    y = ours(x)
    assert y.dim() == x.dim()
    assert torch.equal(y, ref(x))


@pytest.mark.parametrize("name", ["upsample", "groups-no-bias", "output-padding", "depthwise"])
def test_forward_with_output_size_equals_pytorch(name):
    args, kwargs = CONSTRUCTORS[name]
    ref, ours = _pair_of_modules(args, kwargs, seed=6)
    x = torch.randn(2, args[0], 5, 4)
    base = ref(x).shape[-2:]  # default output_padding
    stride = ref.stride
    smallest = [base[i] - ref.output_padding[i] for i in range(2)]
    # PyTorch's _output_padding offers sizes up to smallest + stride - 1 (not up to max(stride, dilation)).
    sizes = [[smallest[0] + a, smallest[1] + b] for a in range(stride[0]) for b in range(stride[1])]
    assert len(sizes) > 1 or name == "depthwise"
    for size in sizes:
        for form in (size, tuple(size), torch.Size(size), [2, ours.out_channels, *size]):
            got = ours(x, output_size=form)
            assert got.shape[-2:] == tuple(size)
            assert torch.equal(got, ref(x, output_size=form))
    # Out of range: both raise PyTorch's ValueError.
    too_big = [smallest[0] + stride[0], smallest[1]]
    with pytest.raises(ValueError, match="requested an output size"):
        ref(x, output_size=too_big)
    with pytest.raises(ValueError, match="requested an output size"):
        ours(x, output_size=too_big)


def test_output_size_on_unbatched_input():
    ref, ours = _pair_of_modules((4, 3, 3), {"stride": 3, "padding": 1}, seed=7)
    x = torch.randn(4, 5, 5)
    for size in ([13, 15], [15, 14], [3, 14, 13]):
        assert torch.equal(ours(x, output_size=size), ref(x, output_size=size))


@pytest.mark.parametrize("name", CONSTRUCTORS)
def test_repr(name):
    args, kwargs = CONSTRUCTORS[name]
    ref, ours = _pair_of_modules(args, kwargs)
    assert repr(ours) == repr(ref)
    _, tf32 = _pair_of_modules(args, kwargs, precision="tf32")
    assert repr(tf32) == repr(ref)[:-1] + ", precision='tf32')"
    _, fp32 = _pair_of_modules(args, kwargs, precision="fp32")
    assert repr(fp32).endswith(", precision='fp32')")


@pytest.mark.parametrize("precision", ["bf16", "TF32", "", "fp16", 32])
def test_invalid_precision_raises(precision):
    with pytest.raises(ValueError, match=r"precision must be one of \('fp32', 'tf32'\) or None"):
        kernels.ConvTranspose2d(4, 4, 3, precision=precision)


def test_precision_is_keyword_only():
    with pytest.raises(TypeError):
        kernels.ConvTranspose2d(4, 4, 3, 1, 0, 0, 1, True, 1, "zeros", None, None, "tf32")  # type: ignore


@pytest.mark.parametrize("precision", [None, "tf32", "fp32"])
def test_precision_stored_and_ignored_on_cpu(precision):
    ref, ours = _pair_of_modules((4, 6, 3), {"stride": 2}, seed=8, precision=precision)
    assert ours.precision == precision
    x = torch.randn(2, 4, 5, 5)
    assert torch.equal(ours(x), ref(x))


def test_padding_mode_other_than_zeros_rejected_like_pytorch():
    with pytest.raises(ValueError, match="zeros"):
        nn.ConvTranspose2d(4, 4, 3, padding_mode="reflect")
    with pytest.raises(ValueError, match="zeros"):
        kernels.ConvTranspose2d(4, 4, 3, padding_mode="reflect")


def test_copy_and_pickle_keep_class_and_precision():
    layer = kernels.ConvTranspose2d(4, 6, 3, stride=2, precision="tf32")
    x = torch.randn(1, 4, 4, 4)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert type(clone) is kernels.ConvTranspose2d
        assert clone.precision == "tf32"
        assert torch.equal(clone.weight, layer.weight)
        assert torch.equal(clone(x), layer(x))


def test_training_a_step_matches_pytorch():
    ref, ours = _pair_of_modules((4, 6, 3), {"stride": 2, "padding": 1, "groups": 2}, seed=9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    x = torch.randn(2, 4, 5, 5)
    for _ in range(2):
        for module, opt in ((ref, opt_ref), (ours, opt_ours)):
            opt.zero_grad()
            (module(x) ** 2).mean().backward()
            opt.step()
    assert torch.equal(ours.weight, ref.weight)
    assert torch.equal(ours.bias, ref.bias)
