"""``deconv::conv_transpose2d``: the CUDA call behind ``kernels.conv_transpose2d``, registered as a PyTorch operator.

``run_cuda`` is the call on CUDA tensors: the kernel choice (``kernels.tuning``; never measured while the stream
captures a CUDA graph), the weights' packed copies prepared once per weight version (kept by the extension, see
``refresh_weights``) and the extension's launch, which also remembers the problem so that a repeat of the same call
goes from ``kernels.conv_transpose2d`` to the launch in one extension call (the extension's ``fast_forward``).

The operator (``torch.ops.deconv.conv_transpose2d``) is what torch.compile, torch.export, CUDA-graph captures and
other tracers see. Its schema and Python kernels are defined here: a fake (meta) implementation that gives the
output's shape and strides, autograd through PyTorch's own ``aten.convolution_backward`` (cuDNN on GPUs), and a
kernel for every device (PyTorch's reference on the CPU, ``run_cuda`` on CUDA). Once the extension is loaded, it
adds C++ kernels for CUDA tensors (kernels/csrc/binding.cpp): the autograd step and the call itself, which runs a
remembered problem's plan without entering Python and hands any other call to ``conv_transpose2d_op`` below. So
a compiled model's call of the operator costs what a call of PyTorch's own convolution costs on the host.
``kernels.functional`` calls the operator whenever gradients are needed or the call is being traced, and
``run_cuda`` directly otherwise.

``prepare`` (the schema's last argument): whether the call may use the weight's prepared copies. The functional call
passes True unless the weight is being trained (grad mode on and the weight requires gradients): then packed copies
would be made anew every step, and writes through ``.data`` (still common in training code) would go unseen.
"""

from typing import Optional  # torch.library reads the annotations at run time: no string annotations here

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.internal import ConvArgs, load_extension, loaded_extension, out_hw, resolve_precision
from kernels.tuning import DEFAULT, TUNER

OP_NAME = "deconv::conv_transpose2d"


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


def _empty_output(x: torch.Tensor, weight: torch.Tensor, args: ConvArgs) -> torch.Tensor:
    """An uninitialised output of a 4-D problem in PyTorch's layout (channels-last when x or the weight suggests
    it)."""
    h_out, w_out = out_hw(x.shape, weight, args)
    cl = suggests_channels_last(x) or suggests_channels_last(weight)
    return torch.empty((x.shape[0], weight.shape[1] * args.groups, h_out, w_out), dtype=x.dtype, device=x.device,
                       memory_format=torch.channels_last if cl else torch.contiguous_format)


def run_cuda(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, args: ConvArgs,
             precision: str | None, *, prepare: bool = True, remember: bool = False) -> torch.Tensor:
    """The forward pass of a checked 4-D problem on CUDA tensors, no autograd, in PyTorch's output layout.

    ``prepare``: use (and make, the first time) the weight's packed copies kept by the extension, rather than
    packing them in this call; never while the stream captures a CUDA graph. ``remember``: keep the problem's plan
    for the extension's ``fast_forward`` (``kernels.conv_transpose2d``'s repeats).
    """
    mode = resolve_precision(x.dtype, precision)
    if x.shape[0] == 0:
        return _empty_output(x, weight, args)
    choice = DEFAULT
    if TUNER.enabled:  # measured kernel choice (kernels.tuning), tuned on the first call of this problem
        if torch.cuda.is_current_stream_capturing():
            remember = False  # the default runs in a capture; the choice is measured by a later call outside one
        cl = _channels_last(x)
        choice = TUNER.choose(x.shape, weight, bias, args, mode, aligned=_rows_aligned(x, cl), channels_last=cl)
    y, _ = load_extension().forward(
        x, weight, bias, list(args.stride), list(args.padding), list(args.output_padding), list(args.dilation),
        args.groups, mode, None, *choice.forced(), None, prepare=prepare, torch_layout=True, remember=remember)
    return y  # type: ignore[no-any-return]


def refresh_weights(target: torch.Tensor | nn.Module | None = None) -> int:
    """Drop the prepared (packed) copies of weights, so that the next call prepares them from what the weights hold.

    Prepared copies follow every change PyTorch tracks: in-place operations on the weight or its views (optimizer
    steps, ``copy_``, ``load_state_dict``) bump its version counter, and ``.to()``, ``.data = ...`` or
    ``module._apply`` give it new memory. Writes PyTorch does not track -- through ``weight.data`` (which has a
    version counter of its own), DLPack or raw pointers -- are not seen: call this after them. ``target``: a
    weight tensor, a module (its parameters), or None for every weight. Returns how many were dropped.
    """
    ext = loaded_extension()
    if ext is None:
        return 0  # nothing was prepared in this process
    if target is None:
        return int(ext.forget_prepared(None))
    tensors = list(target.parameters()) if isinstance(target, nn.Module) else [target]
    return sum(int(ext.forget_prepared(t)) for t in tensors if t.is_cuda)


SCHEMA = ("conv_transpose2d(Tensor input, Tensor weight, Tensor? bias, int[] stride, int[] padding, "
          "int[] output_padding, int groups, int[] dilation, str? precision, bool prepare=False) -> Tensor")
_LIB = torch.library.Library("deconv", "DEF")
# flexible_layout: the operator takes inputs in any layout (it reads channels-last and NCHW tensors as they are, and
# its output follows PyTorch's layout rule, as the fake kernel says), so torch.compile may keep the layout it chose
# for the graph's convolutions (channels-last) instead of copying tensors back to the layout they had when traced.
_LIB.define(SCHEMA, tags=(torch.Tag.flexible_layout,))


def _args(stride: list[int], padding: list[int], output_padding: list[int], groups: int,
          dilation: list[int]) -> ConvArgs:
    return ConvArgs(tuple(stride), tuple(padding), tuple(output_padding), tuple(dilation), groups)  # type: ignore[arg-type]


def conv_transpose2d_op(input: Tensor, weight: Tensor, bias: Optional[Tensor], stride: list[int],  # noqa: UP045
                        padding: list[int], output_padding: list[int], groups: int, dilation: list[int],
                        precision: Optional[str], prepare: bool = False) -> Tensor:  # noqa: UP045
    """``conv_transpose2d`` of a checked 4-D problem (``kernels.functional`` checks and normalises the arguments):
    on CUDA tensors our kernels, on others PyTorch's reference, the output in PyTorch's layout on both.

    The operator's kernel for every device until the extension adds its own for CUDA; after that, the extension's
    kernel calls it for a CUDA call whose problem it has not remembered yet, so that the kernel choice is made (or
    measured) and the problem remembered, and the next call stays in C++."""
    args = _args(stride, padding, output_padding, groups, dilation)
    if input.is_cuda:
        return run_cuda(input, weight, bias, args, precision, prepare=prepare, remember=True)
    y = F.conv_transpose2d(input, weight, bias, args.stride, args.padding, args.output_padding, args.groups,
                           args.dilation)
    if suggests_channels_last(input) or suggests_channels_last(weight):
        y = y.contiguous(memory_format=torch.channels_last)
    return y


_LIB.impl("conv_transpose2d", conv_transpose2d_op, "CompositeExplicitAutograd")


@torch.library.register_fake(OP_NAME, lib=_LIB)
def _fake(input: Tensor, weight: Tensor, bias: Optional[Tensor], stride: list[int],  # noqa: UP045
          padding: list[int], output_padding: list[int], groups: int, dilation: list[int],
          precision: Optional[str], prepare: bool = False) -> Tensor:  # noqa: UP045
    return _empty_output(input, weight, _args(stride, padding, output_padding, groups, dilation))


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: Tensor) -> None:
    input, weight, bias, stride, padding, output_padding, groups, dilation, *_ = inputs
    ctx.save_for_backward(input, weight)
    ctx.conv = (list(stride), list(padding), list(output_padding), groups, list(dilation))  # type: ignore[attr-defined]
    ctx.has_bias = bias is not None  # type: ignore[attr-defined]


def _backward(ctx: torch.autograd.function.FunctionCtx, grad_y: Tensor) -> tuple:
    x, weight = ctx.saved_tensors  # type: ignore[attr-defined]
    stride, padding, output_padding, groups, dilation = ctx.conv  # type: ignore[attr-defined]
    needs = ctx.needs_input_grad  # type: ignore[attr-defined]
    mask = [needs[0], needs[1], ctx.has_bias and needs[2]]  # type: ignore[attr-defined]
    # PyTorch's own backward of a transposed convolution (cuDNN on GPUs): exactly the gradients that
    # F.conv_transpose2d would produce.
    gx, gw, gb = torch.ops.aten.convolution_backward(
        grad_y, x, weight, [weight.shape[1] * groups] if ctx.has_bias else None,  # type: ignore[attr-defined]
        stride, padding, dilation, True, output_padding, groups, mask,
    )
    return gx, gw, gb, None, None, None, None, None, None, None


torch.library.register_autograd(OP_NAME, _backward, setup_context=_setup_context, lib=_LIB)
