"""``conv_transpose2d``: the CUDA kernels behind PyTorch's exact semantics, with autograd.

Layers, bottom up: the extension's raw forward (``_forward_cuda``) -> ``_ConvTranspose2dFunction``
(autograd) -> ``conv_transpose2d`` (argument checks, precision, dtype/device routing).

CPU tensors take the PyTorch reference (``torch.nn.functional.conv_transpose2d``), so every call works on a
machine without a GPU. CUDA tensors run our forward kernels; the backward pass uses PyTorch's own
``aten.convolution_backward`` (cuDNN on GPUs) for the input, weight and bias gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels._ops import (
    FORCE_PATHS,
    KERNEL_PATHS,
    MAX_SPLIT,
    PRECISIONS,
    SUPPORTED_DTYPES,
    ConvArgs,
    ConvTranspose2dArgumentError,
    IntPair,
    _forward_cuda,
    _out_hw,
    check_shapes,
    check_tensors,
    normalize_args,
    output_size,
    resolve_precision,
)
from kernels.tuning import DEFAULT, TUNER, KernelChoice

__all__ = [
    "FORCE_PATHS", "KERNEL_PATHS", "MAX_SPLIT", "PRECISIONS", "SUPPORTED_DTYPES", "ConvArgs",
    "ConvTranspose2dArgumentError", "IntPair", "check_shapes", "check_tensors", "conv_transpose2d",
    "normalize_args", "output_size", "resolve_precision", "suggests_channels_last",
]


def suggests_channels_last(t: torch.Tensor) -> bool:
    """Whether PyTorch takes ``t`` as channels-last when it picks a convolution's output layout (c10's
    is_channels_last_strides_2d on the actual strides, so that an [N, C, 1, 1] tensor made channels-last counts,
    though it is NCHW-contiguous as well)."""
    if t.dim() != 4 or not t.is_contiguous(memory_format=torch.channels_last):
        return False
    sizes, strides = t.shape, t.stride()
    smallest = 0
    for d in (1, 3, 2, 0):
        if sizes[d] == 0 or strides[d] < smallest or (d == 0 and smallest == strides[1]):
            return False
        smallest = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return True


def _channels_last(x: torch.Tensor) -> bool:
    """Whether ``x`` is laid out channels-last (and not also NCHW-contiguous), as PyTorch decides the output's."""
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def _rows_aligned(x: torch.Tensor, channels_last: bool) -> bool:
    """Whether the kernels will see ``x`` at a 16-byte aligned address: ``x`` itself when it is contiguous in its
    layout (a channels-last one is read as it is by the gemm kernel), else a fresh, aligned copy."""
    return not (x.is_contiguous() or channels_last) or x.data_ptr() % 16 == 0


class _ConvTranspose2dFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, args: ConvArgs, precision: str,
        choice: KernelChoice = DEFAULT,
    ) -> torch.Tensor:
        y, _ = _forward_cuda(x, weight, bias, args, precision, force_path=choice.path, force_config=choice.config,
                             force_split=choice.split, force_staged=choice.staged, force_round=choice.rounded)
        ctx.save_for_backward(x, weight)
        ctx.args = args
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        a: ConvArgs = ctx.args
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
        # PyTorch's own backward of a transposed convolution (cuDNN on GPUs): exactly the gradients that
        # F.conv_transpose2d would produce.
        gx, gw, gb = torch.ops.aten.convolution_backward(
            grad_y, x, weight, [weight.shape[1] * a.groups] if ctx.has_bias else None,
            list(a.stride), list(a.padding), list(a.dilation), True, list(a.output_padding), a.groups, mask,
        )
        return gx, gw, gb, None, None, None


def conv_transpose2d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntPair = 1,
    padding: IntPair = 0,
    output_padding: IntPair = 0,
    groups: int = 1,
    dilation: IntPair = 1,
    *,
    precision: str | None = None,
) -> torch.Tensor:
    """2-D transposed convolution with ``torch.nn.functional.conv_transpose2d``'s signature and semantics.

    Args:
        input: ``[N, C_in, H, W]`` or unbatched ``[C_in, H, W]``; float32, float16, bfloat16 or float64; any
            memory layout (contiguous, strided views, channels_last).
        weight: ``[C_in, C_out / groups, kH, kW]``, same dtype and device as ``input``.
        bias: optional ``[C_out]``.
        stride, padding, output_padding, dilation: an int or an (height, width) pair. ``output_padding`` must be
            smaller than ``max(stride, dilation)`` per axis.
        groups: splits ``C_in`` and ``C_out`` into this many independent groups.
        precision: for float32 inputs on CUDA, ``"tf32"`` (operands rounded to TF32, sums in fp32, as cuDNN's
            TF32 kernels compute; layers that run on the narrow or SIMT kernels, e.g. few output channels, and
            grouped layers on the sparse kernel compute exact fp32, as cuDNN does for grouped layers) or ``"fp32"``
            (exact IEEE fp32). ``None`` follows ``torch.backends.cudnn.allow_tf32``, as PyTorch does. Ignored for
            other dtypes (bf16/fp16 accumulate in fp32; float64 is exact).

    Returns:
        ``[N, C_out, H_out, W_out]`` (or ``[C_out, H_out, W_out]``) in the input's dtype, with
        ``H_out = (H - 1) * stride - 2 * padding + dilation * (kH - 1) + output_padding + 1`` (same for W);
        channels_last when the input or the weight is channels_last, like PyTorch on CUDA.

    CPU tensors run PyTorch's reference implementation. CUDA tensors run this project's kernels; under
    ``torch.autocast`` they are cast to the autocast dtype first, as PyTorch does for convolutions. With measured
    kernel choice on (``kernels.tuning.enable()`` or ``DECONV_TUNE=1``, like ``torch.backends.cudnn.benchmark``),
    the first call of each problem times the candidate kernels and later calls run the fastest. Gradients
    (input, weight, bias) come from PyTorch's ``aten.convolution_backward``.

    Raises:
        ConvTranspose2dArgumentError: invalid shapes, arguments, dtypes or devices.
    """
    args = normalize_args(stride, padding, output_padding, groups, dilation)
    if isinstance(input, torch.Tensor) and torch.is_autocast_enabled(input.device.type):
        # Autocast casts a convolution's float operands to its lower-precision dtype before anything else, as
        # PyTorch does (float64 is never autocast).
        dt = torch.get_autocast_dtype(input.device.type)

        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            ok = t is not None and t.is_floating_point() and t.dtype != torch.float64
            return t.to(dt) if ok else t  # type: ignore[union-attr]

        input, weight, bias = cast(input), cast(weight), cast(bias)  # type: ignore[assignment]
    check_tensors(input, weight, bias, args)
    if input.dtype not in SUPPORTED_DTYPES:
        raise ConvTranspose2dArgumentError(
            f"unsupported dtype {input.dtype}; use float32, float16, bfloat16 or float64"
        )
    if not input.is_cuda:
        resolve_precision(input.dtype, precision)  # validate the argument on every device
        return F.conv_transpose2d(input, weight, bias, args.stride, args.padding, args.output_padding,
                                  args.groups, args.dilation)

    mode = resolve_precision(input.dtype, precision)

    unbatched = input.dim() == 3
    x = input.unsqueeze(0) if unbatched else input
    if x.shape[0] == 0:
        h_out, w_out = _out_hw(x.shape, weight, args)
        y = x.new_empty((0, weight.shape[1] * args.groups, h_out, w_out))
    else:
        choice = DEFAULT
        if TUNER.enabled:  # measured kernel choice (kernels.tuning), tuned on the first call of this problem
            cl = _channels_last(x)
            choice = TUNER.choose(x.shape, weight, bias, args, mode, aligned=_rows_aligned(x, cl), channels_last=cl)
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            y = _ConvTranspose2dFunction.apply(x, weight, bias, args, mode, choice)
        else:  # nothing to differentiate: the autograd Function's ~4 us per call buys nothing
            y, _ = _forward_cuda(x, weight, bias, args, mode, force_path=choice.path, force_config=choice.config,
                                 force_split=choice.split, force_staged=choice.staged, force_round=choice.rounded)
    # PyTorch's layout on CUDA: channels-last when the input or the weight is (a no-op for a channels-last input,
    # whose output the extension wrote channels-last already).
    if suggests_channels_last(x) or suggests_channels_last(weight):
        y = y.contiguous(memory_format=torch.channels_last)
    return y.squeeze(0) if unbatched else y
