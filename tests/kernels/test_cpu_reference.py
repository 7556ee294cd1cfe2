"""The independent reference ``kernels.reference.conv_transpose2d_scatter`` pins down the index rules.

It must equal PyTorch in float64 on random problems, and hand-computed examples fix each rule (weight not
flipped, stride spacing, padding crops, output_padding extends, dilation spaces the taps, groups stay apart)
without trusting any convolution library. A plain gather form of docs/architecture.md's definition agrees, and its
classic mistakes (flipped kernel, no remainder check before dividing, padding added) are caught by the same
problems, so these tests can fail.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from kernels.reference import conv_transpose2d_reference, conv_transpose2d_scatter
from tests.kernels.models import Config, random_config, torch_output_hw


def _valid_configs(prefix: str, count: int, max_work: int | None = None) -> list[Config]:
    configs: list[Config] = []
    i = 0
    while len(configs) < count:
        cfg = random_config(random.Random(f"{prefix}-{i}"), allow_unbatched=False)
        i += 1
        hw = torch_output_hw(cfg)
        if hw is None:
            continue
        if max_work is not None and hw[0] * hw[1] * cfg.kernel[0] * cfg.kernel[1] > max_work:
            continue
        configs.append(cfg)
    return configs


REF_CONFIGS = _valid_configs("reference", 200)


@pytest.mark.parametrize(("i", "cfg"), list(enumerate(REF_CONFIGS)), ids=[f"cfg{i}" for i in range(200)])
def test_scatter_matches_pytorch_float64(i, cfg):
    x, w, b = cfg.tensors(seed=1000 + i, dtype=torch.float64)
    ref = F.conv_transpose2d(x, w, b, **cfg.kwargs())
    got = conv_transpose2d_scatter(x, w, b, **cfg.kwargs())
    assert got.dtype == torch.float64
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scatter_computes_in_float64_whatever_the_input(dtype):
    x, w, b = Config(2, 4, 6, 5, 4, (3, 2), (2, 1), (1, 0), (1, 0), (1, 2), 2, True, False).tensors(3, dtype)
    got = conv_transpose2d_scatter(x, w, b, stride=(2, 1), padding=(1, 0), output_padding=(1, 0), groups=2,
                                   dilation=(1, 2))
    ref = F.conv_transpose2d(x.double(), w.double(), b.double(), (2, 1), (1, 0), (1, 0), 2, (1, 2))
    assert got.dtype == torch.float64
    assert (got - ref).abs().max().item() < 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_reference_is_pytorch_in_float64_cast_back(dtype):
    x, w, b = Config(2, 4, 6, 5, 4, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 2, True, False).tensors(5, dtype)
    got = conv_transpose2d_reference(x, w, b, 2, 1, 1, 2, 1)
    ref = F.conv_transpose2d(x.double(), w.double(), b.double(), 2, 1, 1, 2, 1).to(dtype)
    assert got.dtype == dtype
    assert torch.equal(got, ref)


# Hand-computed examples: each pins one rule of the definition.


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)[None, None]


def test_weight_is_not_flipped():
    # A single 1 scatters the kernel as it is: y = w, not w rotated by 180 degrees.
    w = _t([[1.0, 2.0], [3.0, 4.0]])
    assert torch.equal(conv_transpose2d_scatter(_t([[1.0]]), w), w)


def test_stride_spaces_the_input_pixels():
    # [1, 10] with a 1x1 kernel of 3 and stride 2: 3, 0, 30 (a zero between, nothing after).
    y = conv_transpose2d_scatter(_t([[1.0, 10.0]]), _t([[3.0]]), stride=2)
    assert torch.equal(y, _t([[3.0, 0.0, 30.0]]))


def test_overlapping_taps_add():
    # [1, 10] with kernel [1, 2, 3], stride 2: taps land at 0..2 and 2..4 and overlap at position 2.
    y = conv_transpose2d_scatter(_t([[1.0, 10.0]]), _t([[1.0, 2.0, 3.0]]), stride=2)
    assert torch.equal(y, _t([[1.0, 2.0, 3.0 + 10.0, 20.0, 30.0]]))


def test_padding_crops_both_ends():
    # Full canvas 1, 2, 13, 20, 30; padding 1 removes one column at each end.
    y = conv_transpose2d_scatter(_t([[1.0, 10.0]]), _t([[1.0, 2.0, 3.0]]), stride=2, padding=(0, 1))
    assert torch.equal(y, _t([[2.0, 13.0, 20.0]]))


def test_output_padding_adds_zeros_at_the_end_then_bias():
    y = conv_transpose2d_scatter(_t([[1.0, 10.0]]), _t([[3.0]]), torch.tensor([0.5], dtype=torch.float64),
                                 stride=2, output_padding=(0, 1))
    assert torch.equal(y, _t([[3.5, 0.5, 30.5, 0.5]]))


def test_output_padding_past_padding_reaches_beyond_the_canvas():
    # Padding 1 and output_padding 2 (< dilation 3): the last output column lies past the full canvas.
    y = conv_transpose2d_scatter(_t([[1.0, 10.0]]), _t([[1.0, 2.0]]), padding=(0, 1), output_padding=(0, 2),
                                 dilation=3)
    # Full canvas: position 0: 1, 1: 10, 3: 2, 4: 20; output = canvas[1 : 1 + 5] = [10, 0, 2, 20, 0].
    assert torch.equal(y, _t([[10.0, 0.0, 2.0, 20.0, 0.0]]))
    assert torch.equal(y, F.conv_transpose2d(_t([[1.0, 10.0]]), _t([[1.0, 2.0]]), padding=(0, 1),
                                             output_padding=(0, 2), dilation=3))


def test_dilation_spaces_the_taps():
    y = conv_transpose2d_scatter(_t([[1.0]]), _t([[1.0], [2.0]]), dilation=(3, 1))
    assert torch.equal(y, _t([[1.0], [0.0], [0.0], [2.0]]))


def test_groups_keep_channels_apart():
    # Two groups of one channel each: output channel 0 sees only input channel 0, channel 1 only channel 1.
    x = torch.tensor([[[[1.0]], [[10.0]]]], dtype=torch.float64)  # [1, 2, 1, 1]
    w = torch.tensor([[[[2.0]]], [[[3.0]]]], dtype=torch.float64)  # [2, 1, 1, 1]
    y = conv_transpose2d_scatter(x, w, groups=2)
    assert torch.equal(y.flatten(), torch.tensor([2.0, 30.0], dtype=torch.float64))
    y1 = conv_transpose2d_scatter(x, w.reshape(1, 2, 1, 1).expand(2, 2, 1, 1).contiguous())
    expected = torch.tensor([1.0 * 2 + 10.0 * 2, 1.0 * 3 + 10.0 * 3], dtype=torch.float64)
    assert torch.equal(y1.flatten(), expected)


def test_weight_layout_is_c_in_by_c_out():
    # w[ci, co]: input channel 0 -> outputs 1, 2, 3 (C_out = 3) with one input channel.
    w = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64).view(1, 3, 1, 1)
    y = conv_transpose2d_scatter(torch.full((1, 1, 1, 1), 2.0, dtype=torch.float64), w)
    assert y.shape == (1, 3, 1, 1)
    assert torch.equal(y.flatten(), torch.tensor([2.0, 4.0, 6.0], dtype=torch.float64))


# Gather form, from docs/architecture.md, written out loop by loop; ``mistake`` plants one classic error.


def _gather(x, w, b, cfg: Config, mistake: str | None = None) -> torch.Tensor:
    n, c_in, h, wd = x.shape
    g = cfg.groups
    cin_g, cout_g = c_in // g, w.shape[1]
    h_out, w_out = torch_output_hw(cfg)  # type: ignore[misc]
    xg = x.reshape(n, g, cin_g, h, wd)
    wg = w.reshape(g, cin_g, cout_g, *cfg.kernel)
    if mistake == "flip":
        wg = wg.flip(-1, -2)
    y = torch.zeros(n, g, cout_g, h_out, w_out, dtype=torch.float64)

    def source(o: int, tap: int, axis: int, size: int) -> int | None:
        s, p, d = cfg.stride[axis], cfg.padding[axis], cfg.dilation[axis]
        t = o - p + tap * d if mistake == "padding_added" else o + p - tap * d
        if mistake == "no_remainder_check":
            q = math.trunc(t / s)  # C division truncates toward zero: -1 / 2 == 0
        else:
            if t % s != 0:
                return None
            q = t // s
        return q if 0 <= q < size else None

    for ho in range(h_out):
        for wo in range(w_out):
            for a in range(cfg.kernel[0]):
                hi = source(ho, a, 0, h)
                if hi is None:
                    continue
                for bb in range(cfg.kernel[1]):
                    wi = source(wo, bb, 1, wd)
                    if wi is None:
                        continue
                    tap = torch.einsum("ngi,gio->ngo", xg[:, :, :, hi, wi], wg[:, :, :, a, bb])
                    y[:, :, :, ho, wo] += tap
    y = y.reshape(n, g * cout_g, h_out, w_out)
    return y if b is None else y + b.view(1, -1, 1, 1)


GATHER_CONFIGS = _valid_configs("gather", 40, max_work=1500)


def test_gather_configs_exercise_the_rules():
    assert any(s > 1 for c in GATHER_CONFIGS for s in c.stride)
    assert any(p > 0 for c in GATHER_CONFIGS for p in c.padding)
    assert any(d > 1 for c in GATHER_CONFIGS for d in c.dilation)
    assert any(c.groups > 1 for c in GATHER_CONFIGS)


def test_gather_definition_matches_scatter_and_pytorch():
    for i, cfg in enumerate(GATHER_CONFIGS):
        x, w, b = cfg.tensors(seed=2000 + i, dtype=torch.float64)
        ref = F.conv_transpose2d(x, w, b, **cfg.kwargs())
        got = _gather(x, w, b, cfg)
        assert (got - ref).abs().max().item() < 1e-10, cfg
        assert (got - conv_transpose2d_scatter(x, w, b, **cfg.kwargs())).abs().max().item() < 1e-10, cfg


@pytest.mark.parametrize("mistake", ["flip", "no_remainder_check", "padding_added"])
def test_each_classic_mistake_is_caught_by_the_random_problems(mistake):
    wrong = 0
    for i, cfg in enumerate(GATHER_CONFIGS):
        x, w, b = cfg.tensors(seed=2000 + i, dtype=torch.float64)
        ref = F.conv_transpose2d(x, w, b, **cfg.kwargs())
        wrong += (_gather(x, w, b, cfg, mistake) - ref).abs().max().item() > 1e-6
    assert wrong >= 3
