"""Pure-PyTorch references for the kernels.

``conv_transpose2d_reference`` is PyTorch's own operator (also the CPU path). ``conv_transpose2d_scatter`` is
an independent, deliberately plain implementation of the definition in docs/architecture.md (scatter form: every
input pixel adds ``x * w[:, :, a, b]`` at output position ``hi * stride - padding + a * dilation``), used by the
tests to pin down the index rules without trusting any convolution library.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.functional import normalize_args, output_size


def conv_transpose2d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
    output_padding: int | tuple[int, int] = 0,
    groups: int = 1,
    dilation: int | tuple[int, int] = 1,
) -> torch.Tensor:
    """PyTorch's ``F.conv_transpose2d``, computed in float64 and cast back to the input's dtype."""
    y = F.conv_transpose2d(x.double(), weight.double(), None if bias is None else bias.double(), stride, padding,
                           output_padding, groups, dilation)
    return y.to(x.dtype)


def conv_transpose2d_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
    output_padding: int | tuple[int, int] = 0,
    groups: int = 1,
    dilation: int | tuple[int, int] = 1,
) -> torch.Tensor:
    """The definition, in float64: ``x`` [N, C_in, H, W], ``weight`` [C_in, C_out/g, kH, kW] -> [N, C_out, H', W']."""
    a = normalize_args(stride, padding, output_padding, groups, dilation)
    n, c_in, h, w = x.shape
    _, cout_g, kh, kw = weight.shape
    g = a.groups
    cin_g = c_in // g
    h_out = output_size(h, kh, a.stride[0], a.padding[0], a.output_padding[0], a.dilation[0])
    w_out = output_size(w, kw, a.stride[1], a.padding[1], a.output_padding[1], a.dilation[1])
    # Full (uncropped) canvas: input pixel hi lands at hi * stride + a * dilation before padding is removed.
    full_h = max((h - 1) * a.stride[0] + (kh - 1) * a.dilation[0] + 1, a.padding[0] + h_out)
    full_w = max((w - 1) * a.stride[1] + (kw - 1) * a.dilation[1] + 1, a.padding[1] + w_out)
    canvas = torch.zeros(n, g * cout_g, full_h, full_w, dtype=torch.float64)
    xd = x.detach().double().cpu().reshape(n, g, cin_g, h, w)
    wd = weight.detach().double().cpu().reshape(g, cin_g, cout_g, kh, kw)
    for ta in range(kh):
        for tb in range(kw):
            # [N, g, cout_g, H, W]: each input pixel times this tap, summed over the group's input channels.
            contrib = torch.einsum("ngihw,gio->ngohw", xd, wd[:, :, :, ta, tb]).reshape(n, g * cout_g, h, w)
            r0, c0 = ta * a.dilation[0], tb * a.dilation[1]
            canvas[:, :, r0 : r0 + (h - 1) * a.stride[0] + 1 : a.stride[0],
                   c0 : c0 + (w - 1) * a.stride[1] + 1 : a.stride[1]] += contrib
    y = canvas[:, :, a.padding[0] : a.padding[0] + h_out, a.padding[1] : a.padding[1] + w_out]
    if bias is not None:
        y = y + bias.detach().double().cpu().view(1, -1, 1, 1)
    return y.contiguous()
