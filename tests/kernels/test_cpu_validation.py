"""Tensor validation in ``kernels.conv_transpose2d`` on CPU: PyTorch's rules, with clearer messages."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
import kernels.functional as kf
import kernels.internal as ops
from kernels import ConvTranspose2dArgumentError
from kernels.functional import normalize_args

_GEN = torch.Generator().manual_seed(0)


def r(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype, generator=_GEN)


def case(*args, words, **kwargs):
    """(call arguments, keyword arguments, words the message must hold)."""
    return args, kwargs, words


def x4():  # the usual input [2, 4, 5, 5]
    return r(2, 4, 5, 5)


def w4():  # the usual weight [4, 3, 3, 3]
    return r(4, 3, 3, 3)


F64 = torch.float64

# PyTorch rejects every one of these too.
INVALID = {
    "input-1d": case(r(4), w4(), words=r"3-D \(unbatched\).*4-D \(batched\).*got shape \[4\]"),
    "input-2d": case(r(4, 5), w4(), words=r"3-D \(unbatched\).*4-D \(batched\).*got shape \[4, 5\]"),
    "input-5d": case(r(1, 2, 4, 5, 5), w4(), words=r"got shape \[1, 2, 4, 5, 5\]"),
    "weight-1d": case(x4(), r(4), words=r"4-D weight \[C_in, C_out/groups, kH, kW\], got shape \[4\]"),
    "weight-3d": case(x4(), r(4, 3, 3), words=r"4-D weight.*got shape \[4, 3, 3\]"),
    "weight-5d": case(x4(), r(4, 3, 3, 3, 1), words=r"4-D weight.*got shape \[4, 3, 3, 3, 1\]"),
    "channels": case(r(2, 5, 5, 5), w4(), words=r"input has 5 channels but weight \[4, 3, 3, 3\] expects 4"),
    "channels-unbatched": case(r(3, 5, 5), w4(), words=r"input has 3 channels.*expects 4"),
    "groups-not-dividing": case(r(2, 6, 5, 5), r(6, 1, 3, 3), groups=4,
                                words=r"input channels \(6\) must be a positive multiple of groups \(4\)"),
    "groups-larger": case(r(2, 2, 5, 5), r(2, 1, 3, 3), groups=3, words=r"multiple of groups \(3\)"),
    "zero-channels": case(r(2, 0, 5, 5), r(0, 3, 3, 3), words=r"input channels \(0\) must be a positive"),
    "weight-no-out-channels": case(x4(), r(4, 0, 3, 3), words=r"at least one output channel"),
    "weight-zero-kernel": case(x4(), r(4, 3, 0, 3), words=r"kernel of at least 1x1"),
    "bias-c-in": case(x4(), w4(), r(4), words=r"bias must have shape \[3\] \(C_out\), got \[4\]"),
    "bias-2d": case(x4(), w4(), r(3, 1), words=r"bias must have shape \[3\].*got \[3, 1\]"),
    "bias-0d": case(x4(), w4(), r(), words=r"bias must have shape \[3\].*got \[\]"),
    "bias-groups": case(x4(), w4(), r(3), groups=2, words=r"bias must have shape \[6\]"),
    "weight-float64": case(x4(), r(4, 3, 3, 3, dtype=F64),
                           words=r"weight dtype torch.float64 differs from input dtype torch.float32"),
    "weight-int32": case(x4(), w4().int(), words=r"weight dtype torch.int32 differs"),
    "bias-float64": case(x4(), w4(), r(3, dtype=F64),
                         words=r"bias dtype torch.float64 differs from input dtype torch.float32"),
    "bias-half": case(x4(), w4(), r(3).half(),
                      words=r"bias dtype torch.float16 differs from input dtype torch.float32"),
    "int32": case(x4().int(), w4().int(), words=r"unsupported dtype torch.int32"),
    "int32-bias": case(x4().int(), w4().int(), r(3).int(), words=r"unsupported dtype torch.int32"),
    "output-padding-eq-stride": case(
        x4(), w4(), stride=2, output_padding=2,
        words=r"output_padding must be non-negative and smaller than max\(stride, dilation\)",
    ),
    "output-padding-eq-dilation": case(x4(), w4(), stride=1, dilation=3, output_padding=3,
                                       words=r"3 >= max\(1, 3\)"),
    "output-padding-width": case(x4(), w4(), stride=(3, 1), output_padding=(2, 1),
                                 words=r"width: 1 >= max\(1, 1\)"),
    "zero-height": case(r(2, 4, 0, 5), w4(), words=r"height and width must be positive.*\[2, 4, 0, 5\]"),
    "zero-width": case(r(2, 4, 5, 0), w4(), words=r"height and width must be positive.*\[2, 4, 5, 0\]"),
    "zero-height-unbatched": case(r(4, 0, 5), w4(), words=r"input height and width must be positive"),
    "output-negative": case(r(1, 4, 1, 1), r(4, 3, 1, 1), padding=1,
                            words=r"output size -1 x -1 is not positive for input 1 x 1"),
    "output-zero": case(r(1, 4, 2, 2), r(4, 3, 1, 1), padding=1, words=r"output size 0 x 0 is not positive"),
    "output-width-negative": case(r(1, 4, 4, 1), r(4, 3, 1, 1), padding=(0, 1),
                                  words=r"output size 4 x -1 is not positive.*padding \(0, 1\)"),
    "output-negative-empty-batch": case(r(0, 4, 1, 1), r(4, 3, 1, 1), padding=1,
                                        words=r"output size -1 x -1"),
    "stride-zero": case(x4(), w4(), stride=0, words=r"stride must be positive"),
    "padding-negative": case(x4(), w4(), padding=(0, -1), words=r"padding must be non-negative"),
    "dilation-zero": case(x4(), w4(), dilation=0, words=r"dilation must be positive"),
    "groups-zero": case(x4(), w4(), groups=0, words=r"groups must be positive"),
    "input-list": case([[[[1.0]]]], r(1, 1, 1, 1), words=r"input and weight must be tensors"),
    "weight-list": case(r(1, 1, 1, 1), [[[[1.0]]]], words=r"input and weight must be tensors"),
}


@pytest.mark.parametrize(("args", "kwargs", "words"), INVALID.values(), ids=INVALID.keys())
def test_invalid_rejected_like_pytorch(args, kwargs, words):
    with pytest.raises(ConvTranspose2dArgumentError, match=words):
        kernels.conv_transpose2d(*args, **kwargs)
    # Our rule is PyTorch's: it rejects the same call (RuntimeError, or NotImplementedError, a RuntimeError,
    # for integer dtypes; TypeError for non-tensor arguments).
    with pytest.raises((RuntimeError, TypeError)):
        F.conv_transpose2d(*args, **kwargs)


# Deliberately stricter than PyTorch (each with the reason).
STRICTER = {
    # PyTorch's CPU path computes complex transposed convolutions; our kernels take four float dtypes only.
    "complex64": case(x4().to(torch.complex64), w4().to(torch.complex64),
                      words=r"unsupported dtype torch.complex64; use float32, float16, bfloat16 or float64"),
    # PyTorch's CPU path also computes int64 (not int32); ours does not.
    "int64": case(x4().long(), w4().long(), words=r"unsupported dtype torch.int64"),
    # PyTorch's float64 CPU path quietly accepts a bias of another float dtype (its float32 path does not);
    # we require one dtype for all three tensors on every device.
    "float64-with-half-bias": case(x4().double(), w4().double(), r(3).half(),
                                   words=r"bias dtype torch.float16 differs from input dtype torch.float64"),
    # PyTorch accepts an empty batch with zero height (a [0, C_out, H_out, W_out] output); we require H, W > 0
    # always, and allow only the batch to be empty.
    "empty-batch-zero-height": case(r(0, 4, 0, 5), w4(), words=r"height and width must be positive"),
    # PyTorch lets some zero-sized outputs through, depending on the backend it picks (here oneDNN, for a
    # dilated kernel: [2, 1, 12, 0]); we reject every non-positive output size.
    "output-width-zero-dilated": case(r(2, 1, 6, 1), r(1, 1, 5, 2), stride=(1, 3), padding=(3, 2), dilation=3,
                                      words=r"output size 12 x 0 is not positive"),
    # Mixing devices: PyTorch runs cpu + meta through its meta kernels; ours requires one device (and on real
    # devices, cpu + cuda, PyTorch rejects as well).
    "weight-on-meta": case(x4(), torch.empty(4, 3, 3, 3, device="meta"),
                           words=r"weight is on meta but input is on cpu"),
    "bias-on-meta": case(x4(), w4(), torch.empty(3, device="meta"),
                         words=r"bias is on meta but input is on cpu"),
}


@pytest.mark.parametrize(("args", "kwargs", "words"), STRICTER.values(), ids=STRICTER.keys())
def test_deliberately_stricter_than_pytorch(args, kwargs, words):
    with pytest.raises(ConvTranspose2dArgumentError, match=words):
        kernels.conv_transpose2d(*args, **kwargs)
    F.conv_transpose2d(*args, **kwargs)  # PyTorch accepts these (if it stops doing so, revisit the list)


@pytest.mark.parametrize("precision", ["bf16", "TF32", "fp16", "", "ieee", 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_invalid_precision_rejected_on_cpu(precision, dtype):
    # No PyTorch counterpart: ``precision`` is ours. Validated on every device and dtype, even where ignored.
    x, w = r(1, 2, 3, 3, dtype=dtype), r(2, 2, 2, 2, dtype=dtype)
    with pytest.raises(ConvTranspose2dArgumentError, match=r"precision must be one of \('fp32', 'tf32'\)"):
        kernels.conv_transpose2d(x, w, precision=precision)


@pytest.mark.parametrize("precision", [None, "tf32", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_valid_precision_is_ignored_on_cpu(precision, dtype):
    x, w, b = r(2, 4, 5, 5, dtype=dtype), r(4, 2, 3, 3, dtype=dtype), r(4, dtype=dtype)
    ref = F.conv_transpose2d(x, w, b, stride=2, padding=1, groups=2)
    got = kernels.conv_transpose2d(x, w, b, stride=2, padding=1, groups=2, precision=precision)
    assert got.dtype == dtype
    assert torch.equal(got, ref)


@pytest.mark.parametrize(
    ("stride", "dilation", "output_padding"),
    [(1, 2, 1), (1, 3, 2), (2, 3, 2), ((1, 2), (3, 1), (2, 1)), ((1, 1), (1, 2), (0, 1))],
)
def test_output_padding_at_or_above_stride_but_below_dilation_is_accepted(stride, dilation, output_padding):
    x, w, b = r(2, 4, 5, 6), r(4, 3, 3, 2), r(3)
    ref = F.conv_transpose2d(x, w, b, stride=stride, output_padding=output_padding, dilation=dilation)
    got = kernels.conv_transpose2d(x, w, b, stride=stride, output_padding=output_padding, dilation=dilation)
    assert got.shape == ref.shape
    assert torch.equal(got, ref)


@pytest.mark.parametrize(
    ("c_in", "c_out", "groups", "kwargs", "bias"),
    [
        (4, 3, 1, {}, True),
        (4, 6, 2, {"stride": 2, "padding": 1, "output_padding": 1}, True),
        (6, 3, 3, {"stride": (3, 1), "dilation": (1, 2)}, False),
        (2, 5, 1, {"padding": (2, 0), "dilation": 3, "output_padding": (2, 0)}, True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_empty_batch_returns_empty_output_like_pytorch(c_in, c_out, groups, kwargs, bias, dtype):
    x = r(0, c_in, 5, 7, dtype=dtype)
    w = r(c_in, c_out // groups, 3, 4, dtype=dtype)
    b = r(c_out, dtype=dtype) if bias else None
    ref = F.conv_transpose2d(x, w, b, groups=groups, **kwargs)
    got = kernels.conv_transpose2d(x, w, b, groups=groups, **kwargs)
    a = normalize_args(groups=groups, **kwargs)
    expected_hw = tuple(
        kernels.output_size(size, k, a.stride[i], a.padding[i], a.output_padding[i], a.dilation[i])
        for i, (size, k) in enumerate(((5, 3), (7, 4)))
    )
    assert got.shape == ref.shape == (0, c_out, *expected_hw)
    assert got.dtype == dtype
    assert got.numel() == 0


def test_empty_batch_keeps_autograd():
    x = r(0, 4, 5, 5).requires_grad_()
    w = r(4, 3, 3, 3).requires_grad_()
    y = kernels.conv_transpose2d(x, w, stride=2)
    assert y.shape == (0, 3, 11, 11)
    y.sum().backward()
    assert x.grad is not None
    assert x.grad.shape == x.shape
    assert w.grad is not None
    assert torch.equal(w.grad, torch.zeros_like(w))


# force_path (tests and tuning) is checked before the extension is built, so these run without a GPU.


@pytest.mark.parametrize("force_path", ["fast", "SIMT", "tensor-core", "", 2, ["narrow"]])
def test_unknown_force_path_is_a_clear_error(monkeypatch, force_path):
    monkeypatch.setattr(ops, "load_extension", lambda: pytest.fail("the extension must not be loaded"))
    names = "'simt', 'tensor_core', 'narrow', 'sparse', 'gemm', 'narrow_tiled', 'shuffle', 'fold', 'taps', 'taps_fused'"
    with pytest.raises(ConvTranspose2dArgumentError, match=rf"force_path must be None or one of {names}, got "):
        ops.forward_cuda(x4(), w4(), None, normalize_args(), "fp32", force_path=force_path)


@pytest.mark.parametrize("force_split", [0, 17, -1, 2.0, True, "2"])
def test_bad_force_split_is_a_clear_error(monkeypatch, force_split):
    monkeypatch.setattr(ops, "load_extension", lambda: pytest.fail("the extension must not be loaded"))
    with pytest.raises(ConvTranspose2dArgumentError, match=r"force_split must be None or an int from 1 to 16, got "):
        ops.forward_cuda(x4(), w4(), None, normalize_args(), "fp32", force_split=force_split)


@pytest.mark.parametrize(("force_split", "code"), [(None, -1), (1, 1), (8, 8), (16, 16)])
@pytest.mark.parametrize(("force_staged", "staged_code"), [(None, -1), (False, 0), (True, 1)])
@pytest.mark.parametrize(("force_round", "round_code"), [(None, -1), (False, 0), (True, 1)])
def test_force_split_staged_and_round_reach_the_extension(monkeypatch, force_split, code, force_staged,
                                                          staged_code, force_round, round_code):
    calls = []

    class FakeExtension:
        @staticmethod
        def forward(*args):
            calls.append(args[-4:-1])  # force_split, force_staged, force_round; the packs come last
            assert args[-1] is None
            return F.conv_transpose2d(*args[:3]), 1

    monkeypatch.setattr(ops, "load_extension", lambda: FakeExtension)
    ops.forward_cuda(x4(), w4(), None, normalize_args(), "fp32", force_split=force_split,
                      force_staged=force_staged, force_round=force_round)
    assert calls == [(code, staged_code, round_code)]


@pytest.mark.parametrize(
    ("force_path", "code", "ran"),
    [(None, -1, "tensor_core"), ("simt", 0, "simt"), ("tensor_core", 1, "tensor_core"), ("narrow", 2, "narrow"),
     ("sparse", 3, "sparse"), ("narrow_tiled", 5, "narrow_tiled"), ("shuffle", 6, "shuffle"), ("fold", 7, "fold"),
     ("taps", 8, "taps"), ("taps_fused", 9, "taps_fused")],
)
def test_force_path_names_reach_the_extension(monkeypatch, force_path, code, ran):
    calls = []

    class FakeExtension:
        @staticmethod
        def forward(x, weight, bias, stride, padding, output_padding, dilation, groups, precision, out,
                    force_path_code, force_config, force_split, force_staged, force_round, packs):
            calls.append((force_path_code, force_config, force_split, force_staged, force_round, packs))
            y = F.conv_transpose2d(x, weight, bias, stride, padding, output_padding, groups, dilation)
            return y, {v: k for k, v in kf.KERNEL_PATHS.items()}[ran]

    monkeypatch.setattr(ops, "load_extension", lambda: FakeExtension)
    x, w = x4(), w4()
    y, path = ops.forward_cuda(x, w, None, normalize_args(), "fp32", force_path=force_path)
    assert calls == [(code, -1, -1, -1, -1, None)]
    assert path == ran
    assert torch.equal(y, F.conv_transpose2d(x, w))


def test_kernel_path_names_cover_every_force_path_name():
    assert kf.KERNEL_PATHS == {0: "simt", 1: "tensor_core", 2: "narrow", 3: "sparse", 4: "gemm", 5: "narrow_tiled",
                               6: "shuffle", 7: "fold", 8: "taps", 9: "taps_fused"}
    assert kf.FORCE_PATHS == {None: -1, "simt": 0, "tensor_core": 1, "narrow": 2, "sparse": 3, "gemm": 4,
                              "narrow_tiled": 5, "shuffle": 6, "fold": 7, "taps": 8, "taps_fused": 9}
