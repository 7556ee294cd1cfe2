"""``conv_transpose2d``: the CUDA kernels behind PyTorch's exact semantics, with autograd.

Layers, bottom up: the extension (``kernels.internal``) -> ``kernels.op`` (the CUDA call, and the registered operator
``deconv::conv_transpose2d`` with its autograd) -> ``conv_transpose2d`` (argument checks, precision, dtype/device
routing).

A call goes one of three ways. A repeat of a call already made (same shapes, strides, dtypes, arguments; no
autograd, autocast or tracing) is one extension call that launches from the problem's remembered plan
(``fast_forward`` in kernels/csrc/binding.cpp). A call that needs gradients, or that torch.compile, torch.export or a
dispatch mode traces, goes through the registered operator, so that the tracer sees it and autograd uses its
backward. Every other CUDA call runs ``kernels.op.run_cuda`` directly (and is remembered); CPU tensors take
PyTorch's reference (``torch.nn.functional.conv_transpose2d``), so every call works on a machine without a GPU.
The backward pass uses PyTorch's own ``aten.convolution_backward`` (cuDNN on GPUs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from kernels.internal import (
    FORCE_PATHS,
    KERNEL_PATHS,
    MAX_SPLIT,
    PRECISIONS,
    SUPPORTED_DTYPES,
    ConvArgs,
    ConvTranspose2dArgumentError,
    IntPair,
    check_shapes,
    check_tensors,
    loaded_extension,
    normalize_args,
    output_size,
    resolve_precision,
)
from kernels.op import run_cuda, suggests_channels_last

__all__ = [
    "FORCE_PATHS", "KERNEL_PATHS", "MAX_SPLIT", "PRECISIONS", "SUPPORTED_DTYPES", "ConvArgs",
    "ConvTranspose2dArgumentError", "IntPair", "check_shapes", "check_tensors", "conv_transpose2d",
    "normalize_args", "output_size", "resolve_precision", "suggests_channels_last",
]

# The extension's fast_forward once the extension is loaded (the first CUDA call loads it), else None.
_fast_forward: Any = None
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _traced(*tensors: torch.Tensor | None) -> bool:
    """Whether the call is being traced outside torch.compile (a dispatch mode such as torch.export's or
    FakeTensorMode, or tensor subclasses): then the registered operator must be what runs, so that it is seen."""
    return _get_current_dispatch_mode() is not None or any(
        t is not None and type(t) not in _PLAIN_TENSORS for t in tensors)


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
            (exact fp32: FFMA, or 3xTF32 on the tensor cores, with an error on the order of cuDNN's strict fp32;
            docs/architecture.md, "Kernels"). ``None`` follows ``torch.backends.cudnn.allow_tf32``, as PyTorch
            does. Ignored for other dtypes (bf16/fp16 accumulate in fp32; float64 is exact).

    Returns:
        ``[N, C_out, H_out, W_out]`` (or ``[C_out, H_out, W_out]``) in the input's dtype, with
        ``H_out = (H - 1) * stride - 2 * padding + dilation * (kH - 1) + output_padding + 1`` (same for W);
        channels_last when the input or the weight is channels_last, like PyTorch on CUDA.

    CPU tensors run PyTorch's reference implementation. CUDA tensors run this project's kernels; under
    ``torch.autocast`` they are cast to the autocast dtype first, as PyTorch does for convolutions. With measured
    kernel choice (``kernels.tuning``, on unless ``DECONV_TUNE=0``; like ``torch.backends.cudnn.benchmark``), the
    first call of each problem times the candidate kernels and later calls run the fastest. Gradients
    (input, weight, bias) come from PyTorch's ``aten.convolution_backward``.

    Raises:
        ConvTranspose2dArgumentError: invalid shapes, arguments, dtypes or devices.
    """
    if _fast_forward is not None and not torch.compiler.is_compiling():
        y = _fast_forward(input, weight, bias, stride, padding, output_padding, groups, dilation, precision)
        if y is not None:
            return y  # type: ignore[no-any-return]
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
    resolve_precision(input.dtype, precision)  # validate the argument on every device
    unbatched = input.dim() == 3
    x = input.unsqueeze(0) if unbatched else input
    if torch.compiler.is_compiling() or _traced(x, weight, bias) or (x.is_cuda and _needs_grad(x, weight, bias)):
        # Prepared weight copies unless the weight is being trained (kernels.op: ``prepare``).
        prepare = not (torch.is_grad_enabled() and weight.requires_grad)
        y = torch.ops.deconv.conv_transpose2d.default(
            x, weight, bias, list(args.stride), list(args.padding), list(args.output_padding), args.groups,
            list(args.dilation), precision, prepare)
    elif not x.is_cuda:
        return F.conv_transpose2d(input, weight, bias, args.stride, args.padding, args.output_padding, args.groups,
                                  args.dilation)
    else:
        y = run_cuda(x, weight, bias, args, precision, remember=not unbatched)
        _enable_fast_path()
    return y.squeeze(0) if unbatched else y


def _needs_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))


def _enable_fast_path() -> None:
    global _fast_forward
    if _fast_forward is None:
        ext = loaded_extension()
        _fast_forward = None if ext is None else ext.fast_forward
