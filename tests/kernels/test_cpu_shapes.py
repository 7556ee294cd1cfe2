"""Shape math against PyTorch on hundreds of seeded random configurations."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import ConvTranspose2dArgumentError
from tests.kernels.models import Config, random_config, torch_output_hw

N_CONFIGS = 400
CONFIGS = [random_config(random.Random(f"shape-{i}")) for i in range(N_CONFIGS)]
VALID = [c for c in CONFIGS if torch_output_hw(c) is not None]


def _formula_hw(cfg: Config) -> tuple[int, int]:
    return tuple(  # type: ignore[return-value]
        (size - 1) * s - 2 * p + d * (k - 1) + op + 1
        for size, k, s, p, op, d in zip(
            (cfg.h, cfg.w), cfg.kernel, cfg.stride, cfg.padding, cfg.output_padding, cfg.dilation, strict=True
        )
    )


def test_config_set_covers_the_space():
    # The random set must hold at least 300 problems PyTorch accepts and exercise every corner it claims to.
    valid = VALID
    assert len(valid) >= 300
    assert len(CONFIGS) - len(valid) >= 10  # some invalid ones too, to check that we reject them
    assert {c.groups for c in valid} == {1, 2, 3, 4}
    assert sum(c.unbatched for c in valid) >= 30
    assert {c.bias for c in valid} == {True, False}
    assert {k for c in valid for k in c.kernel} == set(range(1, 8))
    assert {s for c in valid for s in c.stride} == set(range(1, 6))
    assert {p for c in valid for p in c.padding} == set(range(5))
    assert {d for c in valid for d in c.dilation} == {1, 2, 3}
    assert {c.h for c in valid} | {c.w for c in valid} == set(range(1, 10))
    assert {c.n for c in valid} == {1, 2, 3}
    # output_padding at or above the stride (allowed because it is below the dilation) occurs.
    assert any(op >= s for c in valid for op, s in zip(c.output_padding, c.stride, strict=True))


@pytest.mark.parametrize(("i", "cfg"), list(enumerate(CONFIGS)), ids=[f"cfg{i}" for i in range(N_CONFIGS)])
def test_shape_matches_pytorch(i, cfg):
    x, w, b = cfg.tensors(seed=i)
    hw = _formula_hw(cfg)
    ours_hw = tuple(
        kernels.output_size(size, k, s, p, op, d)
        for size, k, s, p, op, d in zip(
            (cfg.h, cfg.w), cfg.kernel, cfg.stride, cfg.padding, cfg.output_padding, cfg.dilation, strict=True
        )
    )
    assert ours_hw == hw
    if min(hw) <= 0:
        # PyTorch rejects a non-positive output size (or, for some zero sizes, returns an empty tensor from
        # one of its backends; we reject those deliberately).
        with pytest.raises(ConvTranspose2dArgumentError, match=r"output size .* is not positive"):
            kernels.conv_transpose2d(x, w, b, **cfg.kwargs())
        try:
            ref = F.conv_transpose2d(x, w, b, **cfg.kwargs())
        except RuntimeError:
            return
        assert min(hw) == 0
        assert ref.shape[-2:] == hw
        return

    ref = F.conv_transpose2d(x, w, b, **cfg.kwargs())
    expected = (cfg.c_out, *hw) if cfg.unbatched else (cfg.n, cfg.c_out, *hw)
    assert ref.shape == expected  # our formula is PyTorch's
    got = kernels.conv_transpose2d(x, w, b, **cfg.kwargs())
    assert got.shape == expected
    assert got.dtype == ref.dtype
    assert torch.equal(got, ref)  # the CPU path is PyTorch's own operator


@pytest.mark.parametrize("cfg", VALID[:60], ids=[f"valid{i}" for i in range(60)])
def test_module_shape_matches_pytorch(cfg):
    torch.manual_seed(0)
    ref = torch.nn.ConvTranspose2d(cfg.c_in, cfg.c_out, cfg.kernel, bias=cfg.bias, **cfg.kwargs())
    torch.manual_seed(0)
    ours = kernels.ConvTranspose2d(cfg.c_in, cfg.c_out, cfg.kernel, bias=cfg.bias, **cfg.kwargs())
    x, _, _ = cfg.tensors(seed=7)
    y_ref, y = ref(x), ours(x)
    assert y.shape == y_ref.shape
    assert torch.equal(y, y_ref)
