"""``ConvTranspose2d``: a drop-in ``nn.ConvTranspose2d`` that runs this project's kernels, and ``convert()``."""

from __future__ import annotations

import torch
from torch import nn

from kernels.functional import PRECISIONS, conv_transpose2d


class ConvTranspose2d(nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` with the forward pass on this project's CUDA kernels.

    It *is* an ``nn.ConvTranspose2d`` (a subclass): the constructor signature, the parameters (``weight``
    ``[C_in, C_out/groups, kH, kW]`` and ``bias`` ``[C_out]``), ``reset_parameters`` (same seed, same weights),
    ``state_dict`` keys and ``forward(input, output_size=None)`` are PyTorch's own, so state dicts load both ways.

    The one addition is the keyword-only ``precision`` (``None``, ``"tf32"`` or ``"fp32"``) for float32 inputs;
    ``None`` follows ``torch.backends.cudnn.allow_tf32``. CPU inputs run PyTorch's reference implementation.

    On CUDA the weights' packed copies are made on the first call and kept until the weight changes in a way PyTorch
    tracks (in-place operations, optimizer steps, ``load_state_dict``, ``.to()``); after writes through
    ``weight.data``, call ``kernels.refresh_weights(module)``.
    """

    precision: str | None = None  # class default, so that modules converted in place have it too

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        output_padding: int | tuple[int, int] = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: int | tuple[int, int] = 1,
        padding_mode: str = "zeros",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        precision: str | None = None,
    ) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, output_padding, groups, bias,
                         dilation, padding_mode, device, dtype)
        if precision is not None and precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS} or None, got {precision!r}")
        self.precision = precision

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        """``[N, C_in, H, W]`` or ``[C_in, H, W]`` -> output; ``output_size`` picks output_padding like PyTorch."""
        output_padding = self._output_padding(
            input, output_size, self.stride, self.padding, self.kernel_size, 2, self.dilation  # type: ignore[arg-type]
        )
        return conv_transpose2d(input, self.weight, self.bias, self.stride, self.padding, output_padding,
                                self.groups, self.dilation, precision=self.precision)

    def extra_repr(self) -> str:
        text = super().extra_repr()
        return text if self.precision is None else f"{text}, precision={self.precision!r}"


def convert(model: nn.Module, *, precision: str | None = None) -> nn.Module:
    """Swap every ``nn.ConvTranspose2d`` inside ``model`` for this project's ``ConvTranspose2d``, in place.

    Each module keeps its identity, parameters (same tensors, device and dtype), buffers, hooks and training
    mode; only its class changes, so ``ModelNew = convert(Model(...))`` in one line. Subclasses of
    ``nn.ConvTranspose2d`` with a forward of their own are left alone. Returns ``model``.
    """
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} or None, got {precision!r}")
    for module in model.modules():
        if type(module) is nn.ConvTranspose2d or type(module) is ConvTranspose2d:
            if module.padding_mode != "zeros":
                continue  # nn.ConvTranspose2d rejects other modes itself; leave such a module untouched
            module.__class__ = ConvTranspose2d
            if precision is not None:
                module.precision = precision
    return model
