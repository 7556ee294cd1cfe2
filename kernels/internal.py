"""The kernels' internal layer: argument parsing and checks, the extension's loading and its raw forward call.

For the project's own code above the kernels, not for library users (whose API is the package ``kernels``):
``kernels.functional`` (the public ``conv_transpose2d`` and its autograd), ``kernels.op`` and ``kernels.tuning``
(measured kernel choice) inside the package; the service's batch calls (``service.engine.ops``) and the benchmarks
(``bench/``) outside it. What they use:

- ``forward_cuda``: the raw forward on CUDA tensors, with the kernel choice forced or left to the extension;
- ``load_extension`` (builds it on first use) and ``loaded_extension`` (never builds): the extension itself, for
  its other calls (``forward_gathered``, ``forward_placed``, ``host_register``, its configuration counts);
- ``out_hw``: the output's (H, W); ``check_tensors`` / ``check_shapes``, ``normalize_args``, ``resolve_precision``;
- ``PackedWeights`` and ``ext_packs``: packed weights as the extension takes them.

Names with a leading underscore are this module's own; code outside ``kernels`` imports none of them (a test under
tests/ checks every import). Nothing here imports another module of the project but ``kernels.build``.
"""

from __future__ import annotations

import functools
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

IntPair = int | Sequence[int]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
PRECISIONS = ("fp32", "tf32")

# Which kernel family ran, as the extension reports it: the SIMT kernel (any problem), the tensor-core kernels (dense
# float32 / bfloat16 / float16 layers), the narrow kernel (C_out / groups <= 8, every dtype), the sparse kernel (few
# multiply-adds an output element: large strides, few input channels), the gemm kernel (channel-heavy TF32 / bfloat16 /
# float16 layers on sm_90, reading the input channels-last), the narrow kernel's tiled form (large narrow layers in
# float32 / bfloat16 / float16, up to 3 taps a phase per axis; its staged configuration reads either layout as it is),
# the shuffle kernel (bfloat16 / float16 layers whose kernel is their stride, NCHW tensors as they are, on sm_90), the
# fold kernel (few channels, every precision but float64, either layout as it is), the taps path (fp32 layers with few
# output channels: the gemm kernel with every tap as a column, then the taps' sum) and the fused taps kernel (the same
# in one kernel, a tile's taps in shared memory; every precision but float64, either layout as it is).
KERNEL_PATHS = {0: "simt", 1: "tensor_core", 2: "narrow", 3: "sparse", 4: "gemm", 5: "narrow_tiled",
                6: "shuffle", 7: "fold", 8: "taps", 9: "taps_fused"}
# force_path names (tests and tuning) -> the extension's force_path argument; None lets the dispatcher choose.
FORCE_PATHS = {None: -1, **{name: code for code, name in KERNEL_PATHS.items()}}
# Split-K factors force_split takes: the halo kernel's blocks of a cluster sharing a tile (at most 8, kMaxSplit in
# conv_transpose2d_halo.cu; larger values run as 8) and the gemm kernel's blocks (kGemmMaxSplit).
MAX_SPLIT = 16


class ConvTranspose2dArgumentError(ValueError, RuntimeError):
    """Invalid arguments to conv_transpose2d.

    A ``ValueError``, and also a ``RuntimeError`` so that code written against PyTorch's errors still catches it.
    """


@dataclass(frozen=True)
class ConvArgs:
    """Normalised convolution arguments: every field a (height, width) pair except groups."""

    stride: tuple[int, int]
    padding: tuple[int, int]
    output_padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int


def _as_int(value: object) -> int | None:
    """``value`` as an int if it is an integer (Python, numpy, 0-d tensor), else None. Bools are not integers."""
    if isinstance(value, (bool, tuple, list)):
        # Sequences are never integers: said without operator.index's TypeError, which torch.compile's tracer
        # (torch 2.11) does not hand back to this function's except clause.
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _pair(value: IntPair, name: str) -> tuple[int, int]:
    single = _as_int(value)
    if single is not None:
        return (single, single)
    try:
        items = tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConvTranspose2dArgumentError(f"{name} must be an int or a pair of ints, got {value!r}") from None
    if len(items) == 1:
        items = items * 2
    ints = tuple(_as_int(v) for v in items)
    if len(ints) != 2 or any(v is None for v in ints):
        raise ConvTranspose2dArgumentError(
            f"{name} must be an int or a pair of ints (height, width), got {value!r}"
        )
    return (ints[0], ints[1])  # type: ignore[return-value]


def output_size(
    in_size: int, kernel: int, stride: int = 1, padding: int = 0, output_padding: int = 0, dilation: int = 1
) -> int:
    """One axis of the output: ``(in - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1``."""
    return (in_size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1


def _plain(value: object) -> bool:
    """Whether ``value`` is an int or a tuple of ints, exactly (no bool, float, numpy or tensor, whose equal hashes
    would otherwise make a cached valid entry answer for an invalid argument)."""
    return type(value) is int or (type(value) is tuple and all(type(v) is int for v in value))  # type: ignore[union-attr]


def normalize_args(
    stride: IntPair = 1, padding: IntPair = 0, output_padding: IntPair = 0, groups: int = 1, dilation: IntPair = 1
) -> ConvArgs:
    """Parse and range-check the non-tensor arguments (PyTorch's rules).

    Valid sets made only of Python ints and tuples of them (a module passes the same ones on every call) are
    cached: a lookup costs ~0.5 us where parsing costs ~6 us. Invalid sets raise every time.
    """
    if torch.compiler.is_compiling():  # traced once per graph: nothing to cache (and no cache for the tracer)
        return _normalize_args(stride, padding, output_padding, groups, dilation)
    if all(_plain(v) for v in (stride, padding, output_padding, groups, dilation)):
        return _normalize_plain(stride, padding, output_padding, groups, dilation)
    return _normalize_args(stride, padding, output_padding, groups, dilation)


def _normalize_args(
    stride: IntPair, padding: IntPair, output_padding: IntPair, groups: int, dilation: IntPair
) -> ConvArgs:
    s = _pair(stride, "stride")
    p = _pair(padding, "padding")
    op = _pair(output_padding, "output_padding")
    d = _pair(dilation, "dilation")
    g = _as_int(groups)
    if g is None:
        raise ConvTranspose2dArgumentError(f"groups must be an int, got {groups!r}")
    groups = g
    if min(s) <= 0:
        raise ConvTranspose2dArgumentError(f"stride must be positive, got {s}")
    if min(d) <= 0:
        raise ConvTranspose2dArgumentError(f"dilation must be positive, got {d}")
    if min(p) < 0:
        raise ConvTranspose2dArgumentError(f"padding must be non-negative, got {p}")
    if groups <= 0:
        raise ConvTranspose2dArgumentError(f"groups must be positive, got {groups}")
    for axis, (o, st, di) in enumerate(zip(op, s, d, strict=True)):
        if o < 0 or o >= max(st, di):
            name = ("height", "width")[axis]
            raise ConvTranspose2dArgumentError(
                f"output_padding must be non-negative and smaller than max(stride, dilation) in each axis; "
                f"got output_padding={op}, stride={s}, dilation={d} ({name}: {o} >= max({st}, {di}))"
            )
    return ConvArgs(s, p, op, d, groups)


_normalize_plain = functools.lru_cache(maxsize=1024)(_normalize_args)


def check_tensors(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, args: ConvArgs,
                  device: torch.device | None = None) -> None:
    """Check shapes, dtypes and devices of the tensors against each other and the arguments.

    ``device``: where weight and bias must be (default: the input's device).
    """
    if not isinstance(input, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise ConvTranspose2dArgumentError("input and weight must be tensors")
    check_shapes(tuple(input.shape), input.dtype, input.device, weight, bias, args, device)


def check_shapes(shape: tuple[int, ...], dtype: torch.dtype, input_device: torch.device, weight: torch.Tensor,
                 bias: torch.Tensor | None, args: ConvArgs, device: torch.device | None = None) -> tuple[int, int]:
    """``check_tensors`` for an input known by its shape, dtype and device. Returns the output's (H, W).

    Uses no tensor operation (none releases the GIL), so that a serving thread can check a batch before its one
    GIL-released kernel call.
    """
    if len(shape) not in (3, 4):
        raise ConvTranspose2dArgumentError(
            f"expected a 3-D (unbatched) [C_in, H, W] or 4-D (batched) [N, C_in, H, W] input, "
            f"got shape {list(shape)}"
        )
    if weight.dim() != 4:
        raise ConvTranspose2dArgumentError(
            f"expected a 4-D weight [C_in, C_out/groups, kH, kW], got shape {list(weight.shape)}"
        )
    want = input_device if device is None else device
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != want:
            raise ConvTranspose2dArgumentError(
                f"{name} is on {t.device} but input is on {input_device}; move both to the same device"
                if device is None else f"{name} is on {t.device}; it must be on {want}"
            )
        if t is not None and t.dtype != dtype:
            raise ConvTranspose2dArgumentError(
                f"{name} dtype {t.dtype} differs from input dtype {dtype}; cast one of them"
            )
    c_in = shape[-3]
    if weight.shape[0] != c_in:
        raise ConvTranspose2dArgumentError(
            f"input has {c_in} channels but weight {list(weight.shape)} expects {weight.shape[0]} "
            f"(weight is [C_in, C_out/groups, kH, kW])"
        )
    if c_in == 0 or c_in % args.groups != 0:
        raise ConvTranspose2dArgumentError(
            f"input channels ({c_in}) must be a positive multiple of groups ({args.groups})"
        )
    if min(weight.shape[1:]) <= 0:
        raise ConvTranspose2dArgumentError(
            f"weight {list(weight.shape)} must have at least one output channel and a kernel of at least 1x1"
        )
    if shape[-1] == 0 or shape[-2] == 0:
        raise ConvTranspose2dArgumentError(
            f"input height and width must be positive, got shape {list(shape)} "
            f"(an empty batch, N = 0, is allowed)"
        )
    c_out = weight.shape[1] * args.groups
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != c_out):
        raise ConvTranspose2dArgumentError(f"bias must have shape [{c_out}] (C_out), got {list(bias.shape)}")
    h_out, w_out = out_hw(shape, weight, args)
    if h_out <= 0 or w_out <= 0:
        raise ConvTranspose2dArgumentError(
            f"output size {h_out} x {w_out} is not positive for input {shape[-2]} x {shape[-1]}, "
            f"kernel {tuple(weight.shape[2:])}, stride {args.stride}, padding {args.padding}, "
            f"dilation {args.dilation}, output_padding {args.output_padding}"
        )
    return h_out, w_out


def out_hw(shape: Sequence[int], weight: torch.Tensor, args: ConvArgs) -> tuple[int, int]:
    """The output's (H, W) for an input of ``shape`` ([..., H, W]), unchecked (``check_shapes`` checks it)."""
    return tuple(  # type: ignore[return-value]
        output_size(shape[-2 + i], weight.shape[2 + i], args.stride[i], args.padding[i],
                    args.output_padding[i], args.dilation[i])
        for i in range(2)
    )


def resolve_precision(dtype: torch.dtype, precision: str | None) -> str:
    """The multiply precision for a float32 problem: explicit, else PyTorch's ``cudnn.allow_tf32`` setting.

    Other dtypes ignore it: bf16/fp16 multiply natively and accumulate in fp32, float64 is exact.
    """
    if precision is not None and precision not in PRECISIONS:
        raise ConvTranspose2dArgumentError(f"precision must be one of {PRECISIONS} or None, got {precision!r}")
    if dtype != torch.float32:
        return "fp32"
    if precision is not None:
        return precision
    return "tf32" if torch.backends.cudnn.allow_tf32 else "fp32"


class PackedWeights(Protocol):
    """Packed copies of one weight tensor, as the extension takes them (the service's ``WeightPacks``)."""

    weight: torch.Tensor
    _ext: Any


def load_extension() -> Any:
    """The compiled extension (``kernels/csrc``), built and loaded on the first call (``kernels.build``)."""
    from kernels.build import load

    return load(verbose=os.environ.get("DECONV_BUILD_VERBOSE", "") == "1")


def loaded_extension() -> Any:
    """The extension if this process has loaded it, else None (never builds it)."""
    from kernels.build import loaded

    return loaded()


def forward_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    args: ConvArgs,
    precision: str,
    out: torch.Tensor | None = None,
    force_path: str | None = None,
    force_config: int | None = None,
    force_split: int | None = None,
    force_staged: bool | None = None,
    force_round: bool | None = None,
    packs: PackedWeights | None = None,
) -> tuple[torch.Tensor, str]:
    """Raw kernel call on a 4-D CUDA input of any memory layout. Returns the output and the kernel family that ran.

    The output is in the input's layout: channels-last when the input is channels-last (and no ``out`` is given),
    else NCHW. ``packs``: ``weight``'s packed copies (``WeightPacks``), which
    spare a tensor-core or gemm call its packing kernel.

    ``out``, when given, is a contiguous ``[N, C_out, H_out, W_out]`` tensor written in place (the tests poison
    it first to catch unwritten elements). ``force_path`` (``"simt"``, ``"tensor_core"``, ``"narrow"``,
    ``"sparse"``, ``"gemm"``, ``"narrow_tiled"``, ``"shuffle"``, ``"fold"``, ``"taps"`` or ``"taps_fused"``) and
    ``force_config`` (a tile configuration index of the tensor-core kernels, or of the gemm kernel with ``"gemm"`` or
    ``"taps"``, or with ``"narrow_tiled"`` 0 or 1 for one or two columns a thread, 2 for the staged form) override the
    kernel choice, for tests and tuning;
    a forced path other than ``"simt"`` that does not suit the problem falls back to the default choice (the
    returned name says which ran).
    ``force_split`` (1 to 16) sets how many blocks share each tile, each over a part of K (split-K): blocks of a
    cluster of the halo tensor-core kernel (at most 8; sm_90 and newer, else 1), or of the gemm kernel.
    ``force_staged`` (the gemm kernel with an NCHW output): True writes the output channels-last into scratch and
    changes its layout after, False stores it straight; None lets the extension choose.
    ``force_round`` (the gemm kernel's TF32 products on a dense fp32 input): True rounds the input to TF32 before
    the kernel (an NCHW input in the layout change it needs anyway, a channels-last one in a pass of its own), so
    that the kernel need not round each stage it loads; False leaves that to the kernel; None lets the extension
    choose (an NCHW input rounded on its way, a channels-last one by the kernel).

    Raises:
        ConvTranspose2dArgumentError: ``force_path`` is not one of those names (or None), or ``force_split`` is not
            None or an int from 1 to 16.
    """
    if force_path is not None and (not isinstance(force_path, str) or force_path not in FORCE_PATHS):
        names = ", ".join(repr(name) for name in FORCE_PATHS if name is not None)
        raise ConvTranspose2dArgumentError(f"force_path must be None or one of {names}, got {force_path!r}")
    if force_split is not None and (type(force_split) is not int or not 1 <= force_split <= MAX_SPLIT):
        raise ConvTranspose2dArgumentError(f"force_split must be None or an int from 1 to {MAX_SPLIT}, "
                                           f"got {force_split!r}")
    ext = load_extension()
    y, path = ext.forward(x, weight, bias, list(args.stride), list(args.padding), list(args.output_padding),
                          list(args.dilation), args.groups, precision, out, FORCE_PATHS[force_path],
                          -1 if force_config is None else force_config, -1 if force_split is None else force_split,
                          -1 if force_staged is None else int(force_staged),
                          -1 if force_round is None else int(force_round), ext_packs(packs, weight))
    return y, KERNEL_PATHS[path]


def ext_packs(packs: PackedWeights | None, weight: torch.Tensor) -> Any:
    """The extension's packs object of ``packs`` (None for none), after checking it holds ``weight``."""
    if packs is None:
        return None
    if packs.weight is not weight:
        raise ConvTranspose2dArgumentError("packs were made for another weight tensor")
    return packs._ext

