"""The kernels' batch calls for serving: a batch's requests read where they are and written where they go, the GIL
released once per batch.

``conv_transpose2d_gathered`` (a batch given as the requests' bytes where they arrived, copied into staging
memory), ``conv_transpose2d_placed`` (a batch read from and written into places the GPU reaches: clients' CUDA
shared memory, memory locked with ``HostPin``; ``conv_transpose2d_direct`` gives it host buffers) and
``conv_transpose2d_staged`` (a host tensor into a host tensor) are what the workers' batch paths
(``service.engine.paths``) run; ``WeightPacks`` keeps a served layer's packed weights. They call the extension
through the kernels' internal layer (``kernels.internal``), as ``kernels.functional`` does; a training user's
``kernels`` never needs them.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from kernels.internal import (
    KERNEL_PATHS,
    SUPPORTED_DTYPES,
    ConvArgs,
    ConvTranspose2dArgumentError,
    check_shapes,
    check_tensors,
    ext_packs,
    load_extension,
    out_hw,
    resolve_precision,
)
from kernels.tuning import DEFAULT, KernelChoice
from service.ipc.shm import address_of


class WeightPacks:
    """Packed copies of one CUDA weight tensor for the tensor-core kernels, made on first use (one per tile layout)
    and kept.

    A tensor-core call packs its weights (channel words in the tile layout, TF32-rounded for TF32) with a kernel of
    its own before the convolution: 1.6-2.7 us on an H100, a large share of a small layer's call. A call given
    ``packs`` runs that kernel only the first time a layout is needed. For weights that do not change while the
    packs live, such as a served layer's: a later write to ``weight`` is not seen by the packed copies.

    Raises:
        ConvTranspose2dArgumentError: ``weight`` is not a contiguous 4-D CUDA tensor.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        if not isinstance(weight, torch.Tensor) or not weight.is_cuda or weight.dim() != 4 \
                or not weight.is_contiguous():
            raise ConvTranspose2dArgumentError("WeightPacks takes a contiguous 4-D CUDA weight tensor")
        self.weight = weight
        self._ext = load_extension().WeightPacks(weight)

    def __len__(self) -> int:
        """Packed layouts made so far."""
        return len(self._ext)


def conv_transpose2d_staged(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    args: ConvArgs,
    precision: str | None,
    out: torch.Tensor,
    choice: KernelChoice = DEFAULT,
    packs: WeightPacks | None = None,
) -> str:
    """``conv_transpose2d`` from host memory into host memory, for a thread that serves batches.

    Uploads ``input`` ([N, C_in, H, W] on the CPU; pinned memory makes the copy asynchronous) to ``weight``'s GPU,
    runs the kernels, writes the output into ``out`` ([N, C_out, H_out, W_out], contiguous, on the CPU) and waits
    for the current CUDA stream, releasing the GIL once for all of it rather than once per tensor operation. No
    autograd. ``choice`` asks for a kernel (kernels.tuning); the default lets the dispatcher choose. ``packs``:
    ``weight``'s packed copies (``WeightPacks``). Returns the kernel family that ran.

    Raises:
        ConvTranspose2dArgumentError: invalid shapes, arguments, dtypes or devices.
    """
    if input.dim() != 4 or input.device.type != "cpu" or out.device.type != "cpu" or not weight.is_cuda:
        raise ConvTranspose2dArgumentError("conv_transpose2d_staged takes a 4-D CPU input and output and CUDA weights")
    if input.dtype not in SUPPORTED_DTYPES:
        raise ConvTranspose2dArgumentError(
            f"unsupported dtype {input.dtype}; use float32, float16, bfloat16 or float64"
        )
    check_tensors(input, weight, bias, args, device=weight.device)
    if out.dtype != input.dtype:
        raise ConvTranspose2dArgumentError(f"out dtype {out.dtype} differs from input dtype {input.dtype}")
    n, c_out = input.shape[0], weight.shape[1] * args.groups
    h_out, w_out = out_hw(input.shape, weight, args)
    if out.shape != (n, c_out, h_out, w_out) or not out.is_contiguous():
        raise ConvTranspose2dArgumentError(f"out must be a contiguous [{n}, {c_out}, {h_out}, {w_out}] tensor for "
                                           f"input {list(input.shape)}, got {list(out.shape)}")
    mode = resolve_precision(input.dtype, precision)
    path = load_extension().forward_staged(input, weight, bias, list(args.stride), list(args.padding),
                                            list(args.output_padding), list(args.dilation), args.groups, mode, out,
                                            *choice.forced(), ext_packs(packs, weight))
    return KERNEL_PATHS[path]


HostPart = torch.Tensor | memoryview | bytes | bytearray
"""Host memory holding whole samples of a gathered input: a contiguous CPU tensor or a C-contiguous buffer."""


def conv_transpose2d_gathered(
    parts: Sequence[HostPart],
    shape: Sequence[int],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    args: ConvArgs,
    precision: str | None,
    choice: KernelChoice = DEFAULT,
    packs: WeightPacks | None = None,
) -> torch.Tensor:
    """``conv_transpose2d`` of an input given as host memory in parts, into a new pinned host tensor.

    The input ``shape`` ([N, C_in, H, W], N >= 1, ``weight``'s dtype) is the parts' bytes one after the other (a
    serving batch: each request's samples where they arrived). In one extension call that releases the GIL once,
    the parts are copied into pinned staging memory, uploaded to ``weight``'s GPU, run through the kernels on the
    current stream, downloaded into a new pinned ``[N, C_out, H_out, W_out]`` tensor, and the stream is waited for.
    No autograd; every check runs here, before the call, without tensor operations. ``choice`` asks for a kernel
    (kernels.tuning); the default lets the dispatcher choose. ``packs``: ``weight``'s packed copies
    (``WeightPacks``).

    Raises:
        ConvTranspose2dArgumentError: invalid shapes, arguments, dtypes, devices, or parts that do not add up to
            ``shape``.
    """
    dims = _check_dims(shape, weight, "conv_transpose2d_gathered")
    check_shapes(dims, weight.dtype, weight.device, weight, bias, args)
    _check_parts(parts, dims, weight.dtype)
    mode = resolve_precision(weight.dtype, precision)
    return load_extension().forward_gathered(  # type: ignore[no-any-return]
        list(parts), list(dims), weight, bias, list(args.stride), list(args.padding), list(args.output_padding),
        list(args.dilation), args.groups, mode, *choice.forced(), ext_packs(packs, weight))


def _check_dims(shape: Sequence[int], weight: torch.Tensor, name: str) -> tuple[int, ...]:
    if not isinstance(weight, torch.Tensor) or not weight.is_cuda:
        raise ConvTranspose2dArgumentError(f"{name} takes CUDA weights")
    dims = tuple(operator.index(d) for d in shape)
    if len(dims) != 4 or dims[0] <= 0:
        raise ConvTranspose2dArgumentError(f"shape must be [N, C_in, H, W] with N >= 1, got {list(dims)}")
    if weight.dtype not in SUPPORTED_DTYPES:
        raise ConvTranspose2dArgumentError(
            f"unsupported dtype {weight.dtype}; use float32, float16, bfloat16 or float64"
        )
    return dims


def _check_parts(parts: Sequence[HostPart], dims: tuple[int, ...], dtype: torch.dtype) -> None:
    """Raise unless ``parts`` are host memory holding exactly a ``dims`` input of ``dtype``."""
    itemsize = dtype.itemsize
    total = 0
    for i, part in enumerate(parts):
        if type(part) is memoryview and part.c_contiguous:  # a request's bytes as served: the common case, first
            total += part.nbytes
        elif isinstance(part, torch.Tensor):
            if part.device.type != "cpu" or part.dtype != dtype or not part.is_contiguous():
                raise ConvTranspose2dArgumentError(
                    f"part {i}: a tensor part must be a contiguous CPU tensor of dtype {dtype}, got "
                    f"{part.dtype} on {part.device}{'' if part.is_contiguous() else ', not contiguous'}")
            total += part.numel() * itemsize
        else:
            view = memoryview(part)
            if not view.c_contiguous:
                raise ConvTranspose2dArgumentError(f"part {i}: the buffer is not C-contiguous")
            total += view.nbytes
    want = math.prod(dims) * itemsize
    if total != want:
        raise ConvTranspose2dArgumentError(f"the parts hold {total} bytes; a {list(dims)} {dtype} input is {want}")


Place = tuple[int, int]
"""Memory the GPU reaches (unified addressing) as (address, bytes): device memory of the weight's GPU, page-locked
host memory (``HostPin``), or other host memory."""


def conv_transpose2d_placed(
    parts: Sequence[Place],
    outs: Sequence[Place],
    shape: Sequence[int],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    args: ConvArgs,
    precision: str | None,
    choice: KernelChoice = DEFAULT,
    packs: WeightPacks | None = None,
) -> str:
    """``conv_transpose2d`` of an input read from ``parts`` into ``outs``: places of memory the GPU reaches, in order
    (a serving batch: each request's input where it arrived, each request's output where it goes).

    The input ``shape`` ([N, C_in, H, W], N >= 1, ``weight``'s dtype) is the parts' bytes one after the other, and the
    output ``[N, C_out, H_out, W_out]`` the places' bytes. In one extension call that releases the GIL once, on the
    current stream: the parts are copied into the batch's input on ``weight``'s GPU (one part in that GPU's memory,
    16-byte aligned, is read in place), the kernels run, the output is copied in pieces into the places (one place in
    that GPU's memory, aligned, is written in place), and this work is waited for (an event behind it, not the whole
    stream, which other threads may share: each waits for its own batch). The caller keeps the memory alive
    and unchanged until this returns; pageable host memory goes at the speed of the driver's own staging. ``choice``
    and ``packs`` as for ``conv_transpose2d_staged``. Returns the kernel family that ran.

    Raises:
        ConvTranspose2dArgumentError: invalid shapes, arguments or dtypes, or places that do not add up to the input
            or the output.
    """
    dims = _check_dims(shape, weight, "conv_transpose2d_placed")
    check_shapes(dims, weight.dtype, weight.device, weight, bias, args)
    _check_places(parts, math.prod(dims) * weight.dtype.itemsize, "input")
    _check_places(outs, _output_bytes(dims, weight, args), "output")
    mode = resolve_precision(weight.dtype, precision)
    path = load_extension().forward_placed(
        list(parts), list(outs), list(dims), weight, bias, list(args.stride), list(args.padding),
        list(args.output_padding), list(args.dilation), args.groups, mode, *choice.forced(), ext_packs(packs, weight))
    return KERNEL_PATHS[path]


def _output_bytes(dims: tuple[int, ...], weight: torch.Tensor, args: ConvArgs) -> int:
    """The bytes of the output of an input of ``dims`` (checked)."""
    h_out, w_out = out_hw(dims, weight, args)
    return dims[0] * weight.shape[1] * args.groups * h_out * w_out * weight.dtype.itemsize


def _check_places(places: Sequence[Place], want: int, tensor: str) -> None:
    """Raise unless ``places`` are (address, bytes) pairs holding exactly ``want`` bytes of the ``tensor``."""
    total = 0
    for i, (address, nbytes) in enumerate(places):
        if address <= 0 or nbytes <= 0:
            raise ConvTranspose2dArgumentError(f"{tensor} place {i}: ({address}, {nbytes}) is not an address and bytes")
        total += nbytes
    if total != want:
        raise ConvTranspose2dArgumentError(f"the {tensor} places hold {total} bytes; the {tensor} is {want}")


def conv_transpose2d_direct(
    parts: Sequence[HostPart],
    outs: Sequence[memoryview],
    shape: Sequence[int],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    args: ConvArgs,
    precision: str | None,
    choice: KernelChoice = DEFAULT,
    packs: WeightPacks | None = None,
) -> str:
    """``conv_transpose2d_placed`` of host memory: an input given as host parts (as ``conv_transpose2d_gathered``)
    and the output ``[N, C_out, H_out, W_out]`` spread over ``outs`` (writable C-contiguous buffers, in order, whose
    sizes add up to the output's: a serving batch's requests in their slots, each its rows into its own place), in one
    extension call that releases the GIL once and returns once the output is there. Parts and places of 256 KiB or
    more (the extension's ``stage_below_bytes``) go straight between their memory and the GPU, by DMA where it is
    page-locked (``HostPin``); smaller ones are staged, copied on the host into (or out of) one page-locked buffer
    that one copy a run of them moves, since a copy costs the driver microseconds whatever its size. Returns the
    kernel family that ran.

    Raises:
        ConvTranspose2dArgumentError: invalid shapes, arguments, dtypes, devices, parts that do not add up to
            ``shape``, or places that do not add up to the output.
    """
    dims = _check_dims(shape, weight, "conv_transpose2d_direct")
    check_shapes(dims, weight.dtype, weight.device, weight, bias, args)
    _check_parts(parts, dims, weight.dtype)
    total = 0
    for i, out in enumerate(outs):
        if not isinstance(out, memoryview) or out.readonly or not out.c_contiguous:
            raise ConvTranspose2dArgumentError(f"out {i}: an output place must be a writable C-contiguous memoryview")
        total += out.nbytes
    want = _output_bytes(dims, weight, args)
    if total != want:
        raise ConvTranspose2dArgumentError(f"the output places hold {total} bytes; the output is {want}")
    mode = resolve_precision(weight.dtype, precision)
    path = load_extension().forward_direct(
        list(parts), list(outs), list(dims), weight, bias, list(args.stride), list(args.padding),
        list(args.output_padding), list(args.dilation), args.groups, mode, *choice.forced(), ext_packs(packs, weight))
    return KERNEL_PATHS[path]


def host_place(part: HostPart) -> Place:
    """Where a host part's bytes are: a contiguous CPU tensor's or a C-contiguous buffer's."""
    if isinstance(part, torch.Tensor):
        return part.data_ptr(), part.numel() * part.element_size()
    view = memoryview(part)
    return address_of(view), view.nbytes


class HostPin:
    """Host memory page-locked for every GPU (``cudaHostRegister``), so that the GPU copies to and from it
    directly (``conv_transpose2d_direct``): ``view`` is the memory to use, and the pages stay locked while any view
    of it lives (anything sliced from ``view``, or made from such a slice), unlocked once the last one is gone and
    before the memory is released. Locking commits the memory (every page resident, none swapped out).

    Raises:
        RuntimeError: the driver refused (the memory is left as it was).
    """

    def __init__(self, buffer: memoryview) -> None:
        # The views handed out are of this array, whose finalizer unlocks the pages before the array lets go of
        # ``buffer`` (numpy clears an array's weak references before it releases its base).
        array = np.frombuffer(buffer, dtype=np.uint8)
        address = int(load_extension().host_register(array))
        self.view = memoryview(array)
        weakref.finalize(array, load_extension().host_unregister, address)
