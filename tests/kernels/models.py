"""Models and random problem configurations shared by the CPU tests of ``kernels``."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn


class Model(nn.Module):
    """KernelBench-style problem: one ``nn.ConvTranspose2d`` built from the init args."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        output_padding: int | tuple[int, int] = 0,
        groups: int = 1,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.conv_transpose2d = nn.ConvTranspose2d(
            in_channels, out_channels, kernel_size, stride=stride, padding=padding,
            output_padding=output_padding, groups=groups, bias=bias,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_transpose2d(x)


class ScaledConvTranspose2d(nn.ConvTranspose2d):
    """A user subclass with a forward of its own: ``convert()`` must leave it alone."""

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        return 0.5 * super().forward(input, output_size) + 1.0


class Decoder(nn.Module):
    """Nested model: ConvTranspose2d layers in a Sequential and a ModuleDict, plus Conv2d and a subclass."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.ConvTranspose2d(8, 6, 4, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(6, 6, 3, padding=1),
            nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1, groups=2),
            nn.Sequential(nn.Tanh(), ScaledConvTranspose2d(4, 4, 3, padding=1)),
        )
        self.heads = nn.ModuleDict({
            "rgb": nn.ConvTranspose2d(4, 3, (3, 5), padding=(2, 4), dilation=2, bias=False),
            "mask": nn.Conv2d(4, 1, 1),
        })

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return torch.cat([self.heads["rgb"](h), self.heads["mask"](h)], dim=1)


@dataclass(frozen=True)
class Config:
    """One conv_transpose2d problem: input shape, weight shape and the keyword arguments."""

    n: int
    c_in: int
    c_out: int
    h: int
    w: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    output_padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    bias: bool
    unbatched: bool

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.c_in, self.h, self.w) if self.unbatched else (self.n, self.c_in, self.h, self.w)

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        return (self.c_in, self.c_out // self.groups, *self.kernel)

    def kwargs(self) -> dict:
        return {
            "stride": self.stride, "padding": self.padding, "output_padding": self.output_padding,
            "groups": self.groups, "dilation": self.dilation,
        }

    def tensors(
        self, seed: int, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Fresh random (never zero) input, weight and bias for this problem."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(self.input_shape, generator=g, dtype=dtype)
        weight = torch.randn(self.weight_shape, generator=g, dtype=dtype)
        bias = torch.randn(self.c_out, generator=g, dtype=dtype) if self.bias else None
        return x, weight, bias


def random_config(rng: random.Random, *, allow_unbatched: bool = True) -> Config:
    """A random small problem: kernel 1-7, stride 1-5, padding 0-4, dilation 1-3, valid output_padding.

    The output size may come out non-positive (large padding on a small input); callers decide what to do.
    """
    kernel = (rng.randint(1, 7), rng.randint(1, 7))
    stride = (rng.randint(1, 5), rng.randint(1, 5))
    dilation = (rng.randint(1, 3), rng.randint(1, 3))
    padding = (rng.randint(0, 4), rng.randint(0, 4))
    output_padding = tuple(rng.randrange(max(s, d)) for s, d in zip(stride, dilation, strict=True))
    groups = rng.choice((1, 1, 2, 3, 4))
    return Config(
        n=rng.randint(1, 3),
        c_in=groups * rng.randint(1, 3),
        c_out=groups * rng.randint(1, 3),
        h=rng.randint(1, 9),
        w=rng.randint(1, 9),
        kernel=kernel,
        stride=stride,
        padding=padding,
        output_padding=output_padding,  # type: ignore[arg-type]
        dilation=dilation,
        groups=groups,
        bias=rng.random() < 0.5,
        unbatched=allow_unbatched and rng.random() < 0.2,
    )


def torch_output_hw(cfg: Config) -> tuple[int, int] | None:
    """The spatial output size PyTorch's formula gives, or None where it is not positive."""
    hw = tuple(
        (size - 1) * s - 2 * p + d * (k - 1) + op + 1
        for size, k, s, p, op, d in zip(
            (cfg.h, cfg.w), cfg.kernel, cfg.stride, cfg.padding, cfg.output_padding, cfg.dilation, strict=True
        )
    )
    return hw if min(hw) > 0 else None  # type: ignore[return-value]
