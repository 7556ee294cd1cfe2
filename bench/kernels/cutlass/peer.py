"""NVIDIA CUTLASS's strided dgrad kernels as a ConvTranspose2d peer for the zoo benchmark (bench/kernels/zoo.py).

The kernels are CUTLASS 2.x implicit-GEMM convolutions (``cutlass::conv::device::ImplicitGemmConvolution`` over
``cutlass::conv::kernel::DefaultConv2dDgrad``, ``arch::Sm80``, ``OpClassTensorOp``: mma.sync, which Hopper runs
too) instantiated in ``dgrad.cuh`` / ``dgrad_{bf16,fp16,tf32}.cu`` and built at run time with
``torch.utils.cpp_extension.load`` against the headers of the ``nvidia-cutlass`` wheel (4.2.0.0).

Mapping. ``F.conv_transpose2d(x[N, C_in, H, W], w[C_in, C_out, kh, kw], stride s, padding p, output_padding op,
dilation d, groups 1)`` is the data gradient (dgrad) of the forward convolution y -> x with the same kernel,
stride, padding and dilation. In CUTLASS's ``Conv2dProblemSize`` (activations NHWC, filter KRSC, mode
kCrossCorrelation, split_k 1, groups 1)::

    N = N    H = H_out    W = W_out    C = C_out        (the dgrad result dx = y, [N, H_out, W_out, C_out])
    K = C_in    R = kh    S = kw                        (filter [K, R, S, C] = w.permute(0, 2, 3, 1))
    P = H    Q = W                                      (the output gradient dy = x, [N, H, W, C_in])
    pad = p    stride = s    dilation = d
    H_out = (H - 1) * s - 2 * p + d * (kh - 1) + op + 1       (likewise W_out)

The forward convolution's output-size formula must give back the input: ``(H_out + 2p - d(kh - 1) - 1) // s + 1
== H``, i.e. ``floor(((H - 1) * s + op) / s) == H - 1``, which holds whenever op < s (PyTorch also allows
s <= op < d; those problems are refused). ``dgrad_problem`` computes the 15 integers in
``Conv2dProblemSize``'s constructor order (N, H, W, C, K, R, S, P, Q, pad_h, pad_w, stride_h, stride_w,
dilation_h, dilation_w).

Layouts. The kernels read x as NHWC and w as KRSC and write y as NHWC: ``conv_transpose2d`` takes x and returns y
as channels_last tensors (``x.contiguous(memory_format=torch.channels_last)`` is a no-op for a channels_last x and
a copy for an NCHW one, the same conversion cuDNN's NHWC kernels make an NCHW caller pay). The KRSC filter is
``w.permute(0, 2, 3, 1)``, which is contiguous, i.e. free, for a channels_last w (what
``model.to(memory_format=torch.channels_last)`` leaves) and one small copy otherwise. Bias goes through the epilogue
(the epilogue source C is the bias with all NHWC strides 0, beta = 1).

Kernels (names: dtype, threadblock tile, warp tile, stages, iterator algorithm, alignment in elements):

- bf16 and fp16 (fp32 accumulation, mma.sync 16x8x16): 128x128x32 (warps 64x64, 3 stages), 128x64x32 (64x32,
  4 stages), 64x64x32 (32x32, 5 stages), all ``kOptimized`` with alignment 8 (C_in and C_out multiples of 8).
  Other channel counts run on zero-padded channels (below). A 16-bit alignment-1 kernel (two-stage ``kAnalytic``,
  the only mainloop for it: cp.async cannot copy 2 bytes) gave relative errors of 0.38-0.99 on every shape of
  ``check`` on an H200 and is not built.
- tf32 (float tensors, fp32 accumulation, operands rounded to tf32 in the warp MMA, mma.sync 16x8x8):
  128x128x16 (64x64, 4 stages), 128x64x16 (64x32, 4 stages), 64x64x16 (32x32, 5 stages), ``kOptimized``
  alignment 4; 64x64x16 ``kAnalytic`` alignment 1 with 3 stages (CUTLASS's two-stage mainloop has no float to tf32
  operand conversion and does not compile for float operands).

All use ``StrideSupport::kStrided`` (``ImplicitGemmConvolutionStridedDgrad``: one implicit GEMM per filter phase,
no MMA spent on the zeros of a strided transposed convolution) and ``StridedDgradIdentityThreadblockSwizzle<1>``.
Each call checks ``can_implement`` (CUTLASS's own, through the extension): a configuration that cannot run a
problem raises ``UnsupportedError`` naming CUTLASS's reason and the likely cause. Limits of these kernels: groups
must be 1 (no grouped dgrad here), dilation must be 1 (CUTLASS's strided dgrad refuses dilation > 1), and kOptimized
needs kh, kw <= 32. For channel counts that the aligned kernels refuse, ``best`` also measures the
aligned kernels on zero-padded channels (configuration names ``pad:<name>``: x, w and bias padded to a multiple of
the alignment per call, y sliced back), beside the tf32 alignment-1 kernel.

Hopper. CUTLASS 4.2's SM90 convolutions (``ConvUniversalAdapter`` over the collective builders,
``sm90_implicit_gemm_gmma_ss_warpspecialized``) load dgrad's output gradient with TMA im2col and have no per-phase
decomposition for stride > 1 (the SM100 collective adds one, ``is_strided_dgrad``); they are not built here, so
on an H200 the peer is the Ampere kernels above.

Built on one H200 (16 cores, the five files in parallel): 32 s. On a 2-core machine without a GPU (nvcc 13.0,
one file at a time): 28-59 s a file and architecture; about 1.3 MB of objects per dtype and architecture. On the
H200, ``check`` (float64 reference, NaN-filled outputs, 12 shapes) passes on every configuration above.

API: ``available()``, ``configs(dtype)``, ``dgrad_problem(...)``, ``supported(...)``, ``conv_transpose2d(...)``,
``best(...)``, ``check(dtype)``, ``load()`` (the build and where the headers come from: build.py).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from bench.harness import Timer
from bench.kernels.cutlass.build import CutlassNotFoundError, compile_extension, find_headers, log_stderr

# (name, dtype, alignment) of every kernel in dgrad_{bf16,fp16,tf32}.cu, in order of preference when no
# configuration is named (largest tile first, alignment 1 last). load() checks the extension lists the same.
CONFIGS: tuple[tuple[str, str, int], ...] = (
    ("bf16_128x128x32_w64x64_s3_opt_a8", "bf16", 8),
    ("bf16_128x64x32_w64x32_s4_opt_a8", "bf16", 8),
    ("bf16_64x64x32_w32x32_s5_opt_a8", "bf16", 8),
    ("fp16_128x128x32_w64x64_s3_opt_a8", "fp16", 8),
    ("fp16_128x64x32_w64x32_s4_opt_a8", "fp16", 8),
    ("fp16_64x64x32_w32x32_s5_opt_a8", "fp16", 8),
    ("tf32_128x128x16_w64x64_s4_opt_a4", "tf32", 4),
    ("tf32_128x64x16_w64x32_s4_opt_a4", "tf32", 4),
    ("tf32_64x64x16_w32x32_s5_opt_a4", "tf32", 4),
    ("tf32_64x64x16_w32x32_s3_ana_a1", "tf32", 1),
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}
PAD_PREFIX = "pad:"
# Norm-wise relative error allowed by check() (bench/kernels/kernelbench.py's TOL; fp16 as bf16, as the GPU tests).
TOL = {"tf32": 2e-3, "bf16": 2e-2, "fp16": 2e-2}

TimerFn = Callable[[Callable[[], object]], float]


class UnsupportedError(ValueError):
    """The problem is outside what a CUTLASS configuration (or this peer) can run; the message says why."""


# ----------------------------------------------------------------------------------------------------------------
# Problem mapping (pure Python)


@dataclass(frozen=True)
class DgradProblem:
    """CUTLASS's ``Conv2dProblemSize`` of a transposed convolution, in its constructor's order."""

    N: int
    H: int
    W: int
    C: int
    K: int
    R: int
    S: int
    P: int
    Q: int
    pad_h: int
    pad_w: int
    stride_h: int
    stride_w: int
    dilation_h: int
    dilation_w: int

    def as_list(self) -> list[int]:
        return list(astuple(self))

    def describe(self) -> str:
        return (f"dgrad N={self.N} HxW={self.H}x{self.W} C={self.C} K={self.K} RxS={self.R}x{self.S} "
                f"PxQ={self.P}x{self.Q} pad={self.pad_h},{self.pad_w} stride={self.stride_h},{self.stride_w} "
                f"dilation={self.dilation_h},{self.dilation_w}")


def pair(v: int | Sequence[int], what: str) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    t = tuple(int(e) for e in v)
    if len(t) == 1:
        return t[0], t[0]
    if len(t) != 2:
        raise ValueError(f"{what} must be an int or a pair, got {v!r}")
    return t[0], t[1]


def transposed_out_size(h: int, k: int, s: int, p: int, op: int, d: int) -> int:
    """conv_transpose2d's output length along one axis."""
    return (h - 1) * s - 2 * p + d * (k - 1) + op + 1


def conv_out_size(h: int, k: int, s: int, p: int, d: int) -> int:
    """A forward convolution's output length along one axis (what CUTLASS's P and Q must equal)."""
    return (h + 2 * p - d * (k - 1) - 1) // s + 1


def dgrad_problem(x_shape: Sequence[int], w_shape: Sequence[int], stride: int | Sequence[int] = 1,
                  padding: int | Sequence[int] = 0, output_padding: int | Sequence[int] = 0,
                  dilation: int | Sequence[int] = 1, groups: int = 1) -> DgradProblem:
    """The CUTLASS dgrad problem of ``F.conv_transpose2d`` on tensors of these shapes (x [N, C_in, H, W], w
    [C_in, C_out, kh, kw]); raises ``UnsupportedError`` for what the peer cannot express and ValueError for what
    PyTorch would refuse too."""
    if len(x_shape) != 4 or len(w_shape) != 4:
        raise ValueError(f"x and w must be 4-d, got {tuple(x_shape)} and {tuple(w_shape)}")
    n, c_in, h, w = (int(e) for e in x_shape)
    wc_in, c_out_g, kh, kw = (int(e) for e in w_shape)
    if groups != 1:
        raise UnsupportedError(f"groups={groups}: the CUTLASS peer builds no grouped dgrad (groups must be 1)")
    if wc_in != c_in:
        raise ValueError(f"w has {wc_in} input channels, x has {c_in}")
    sh, sw = pair(stride, "stride")
    ph, pw = pair(padding, "padding")
    oph, opw = pair(output_padding, "output_padding")
    dh, dw = pair(dilation, "dilation")
    if min(n, c_in, c_out_g, h, w, kh, kw, sh, sw, dh, dw) < 1 or min(ph, pw, oph, opw) < 0:
        raise ValueError(f"invalid sizes: x {tuple(x_shape)}, w {tuple(w_shape)}, stride {sh, sw}, padding "
                         f"{ph, pw}, output_padding {oph, opw}, dilation {dh, dw}")
    if oph >= max(sh, dh) or opw >= max(sw, dw):
        raise ValueError(f"output_padding {oph, opw} must be smaller than stride {sh, sw} or dilation {dh, dw}")
    ho, wo = transposed_out_size(h, kh, sh, ph, oph, dh), transposed_out_size(w, kw, sw, pw, opw, dw)
    if ho < 1 or wo < 1:
        raise ValueError(f"output size {ho}x{wo} is empty")
    p_fwd, q_fwd = conv_out_size(ho, kh, sh, ph, dh), conv_out_size(wo, kw, sw, pw, dw)
    if (p_fwd, q_fwd) != (h, w):
        raise UnsupportedError(f"output_padding {oph, opw} with stride {sh, sw}: the dgrad's forward convolution of a "
                          f"{ho}x{wo} input gives {p_fwd}x{q_fwd}, not the {h}x{w} of x")
    return DgradProblem(N=n, H=ho, W=wo, C=c_out_g, K=c_in, R=kh, S=kw, P=h, Q=w, pad_h=ph, pad_w=pw,
                        stride_h=sh, stride_w=sw, dilation_h=dh, dilation_w=dw)


def padded(problem: DgradProblem, multiple: int) -> DgradProblem:
    """The same problem with C (C_out) and K (C_in) rounded up to a multiple (zero channels)."""
    up = lambda c: -(-c // multiple) * multiple  # noqa: E731
    return DgradProblem(**{**problem.__dict__, "C": up(problem.C), "K": up(problem.K)})


# ----------------------------------------------------------------------------------------------------------------
# Configurations and headers (pure Python)


def dtype_name(dtype: torch.dtype | str) -> str:
    """"bf16", "fp16" or "tf32" (float32 tensors run as TF32) for a torch dtype or one of those names."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is none of {sorted(DTYPES)}")
        return dtype
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise UnsupportedError(f"the CUTLASS peer has no kernels for {dtype} (bf16, fp16 and float32 as tf32)")


def configs(dtype: torch.dtype | str) -> list[str]:
    """The compiled configurations for a dtype, in the order ``conv_transpose2d`` tries them by default."""
    name = dtype_name(dtype)
    return [c for c, d, _ in CONFIGS if d == name]


def alignment(config: str) -> int:
    for c, _, a in CONFIGS:
        if c == config:
            return a
    raise ValueError(f"no CUTLASS configuration named {config!r}")


# ----------------------------------------------------------------------------------------------------------------
# The build


_EXT: Any = None
_LOCK = threading.Lock()


def load(log: Callable[[str], None] | None = log_stderr) -> Any:
    """The compiled extension (bench/kernels/cutlass/build.py: built on first use, minutes; then cached)."""
    global _EXT
    with _LOCK:
        if _EXT is None:
            ext = compile_extension(log, len(CONFIGS))
            listed = tuple((str(n), str(d), int(a)) for n, d, a in ext.configs())
            if listed != CONFIGS:
                raise RuntimeError(f"the extension's configurations {listed} differ from peer.CONFIGS {CONFIGS}")
            _EXT = ext
        return _EXT

def available() -> bool:
    """Whether the peer can run here: CUTLASS headers found, a CUDA GPU of sm_80 or newer, and a CUDA torch."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    if torch.cuda.get_device_capability() < (8, 0):
        return False
    try:
        find_headers()
    except CutlassNotFoundError:
        return False
    return True


# ----------------------------------------------------------------------------------------------------------------
# Running


_CAN: dict[tuple[str, tuple[int, ...]], str] = {}


def _hint(problem: DgradProblem, config: str, reason: str) -> str:
    notes = []
    a = alignment(config)
    if problem.C % a or problem.K % a:
        a1 = [c for c in configs(config.split("_", 1)[0]) if alignment(c) == 1]
        notes.append(f"{config} needs C_in and C_out multiples of {a} (here {problem.K} and {problem.C}); use "
                     f"'{PAD_PREFIX}{config}'" + (f" or {a1[0]}" if a1 else ""))
    if (problem.dilation_h, problem.dilation_w) != (1, 1):
        notes.append("CUTLASS's strided dgrad does not support dilation > 1")
    if max(problem.R, problem.S) > 32 and "_opt_" in config:
        notes.append("the optimized iterators take kernels up to 32x32")
    return f"{reason}" + (f" ({'; '.join(notes)})" if notes else "")


def can_implement(config: str, problem: DgradProblem) -> str:
    """"" if the configuration runs the problem, else why not (CUTLASS's can_implement status, with the cause)."""
    base = config.removeprefix(PAD_PREFIX)
    alignment(base)
    if config.startswith(PAD_PREFIX):
        problem = padded(problem, alignment(base))
    key = (base, tuple(problem.as_list()))
    if key not in _CAN:
        reason = load().can_implement(base, problem.as_list())
        _CAN[key] = _hint(problem, base, reason) if reason else ""
    return _CAN[key]


def supported(x: torch.Tensor, w: torch.Tensor, stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
              output_padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, groups: int = 1,
              *, pad: bool = True) -> dict[str, str]:
    """Every candidate configuration for these tensors and why each can or cannot run ("" = it can); with
    ``pad``, the aligned configurations on zero-padded channels too (when the channels are not aligned)."""
    problem = dgrad_problem(x.shape, w.shape, stride, padding, output_padding, dilation, groups)
    out = {}
    for c in configs(x.dtype):
        out[c] = can_implement(c, problem)
        a = alignment(c)
        if pad and a > 1 and (problem.C % a or problem.K % a):
            out[PAD_PREFIX + c] = can_implement(PAD_PREFIX + c, problem)
    return out


def _pad_channels(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size
    fmt = torch.channels_last if t.dim() == 4 and dim == 1 else torch.contiguous_format
    out = torch.zeros(shape, dtype=t.dtype, device=t.device).contiguous(memory_format=fmt)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def _aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, or a copy of it when its data does not start on 16 bytes (the kernels' widest access)."""
    if t is None or t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.preserve_format)


def conv_transpose2d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                     stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
                     output_padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, groups: int = 1,
                     config: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.conv_transpose2d`` by a CUTLASS dgrad kernel: a channels_last y (NCHW x pays a conversion to NHWC).

    bf16 and fp16 tensors run in their type with fp32 accumulation; float32 tensors run as TF32. ``config``: one
    of ``configs(x.dtype)`` or ``"pad:" + one``; None takes the first that can run the problem. ``out``: a
    channels_last [N, C_out, H_out, W_out] tensor to write into. Raises ``UnsupportedError`` with the reason when the
    configuration cannot run the problem."""
    name = dtype_name(x.dtype)
    if w.dtype != x.dtype:
        raise ValueError(f"w is {w.dtype}, x is {x.dtype}")
    problem = dgrad_problem(x.shape, w.shape, stride, padding, output_padding, dilation, groups)
    if config is None:
        reasons = {c: can_implement(c, problem) for c in configs(name)}
        config = next((c for c, r in reasons.items() if not r), None)
        if config is None:
            raise UnsupportedError(f"no CUTLASS {name} configuration runs {problem.describe()}: {reasons}")
    reason = can_implement(config, problem)
    if reason:
        raise UnsupportedError(f"CUTLASS configuration {config} cannot run {problem.describe()}: {reason}")
    base = config.removeprefix(PAD_PREFIX)
    if not base.startswith(name + "_"):
        raise ValueError(f"configuration {config} is not for {x.dtype}")
    shape_y = (problem.N, problem.C, problem.H, problem.W)
    if out is not None and (tuple(out.shape) != shape_y or out.dtype != x.dtype or out.device != x.device
                            or not out.is_contiguous(memory_format=torch.channels_last)):
        raise ValueError(f"out must be a channels_last {x.dtype} tensor of shape {shape_y} on {x.device}")
    xc = x.contiguous(memory_format=torch.channels_last)
    w_krsc = w.permute(0, 2, 3, 1).contiguous()
    b = None if bias is None else bias.to(dtype=x.dtype).contiguous()
    run_problem = problem
    if config.startswith(PAD_PREFIX):
        run_problem = padded(problem, alignment(base))
        xc = _pad_channels(xc, 1, run_problem.K)
        w_krsc = _pad_channels(_pad_channels(w_krsc, 0, run_problem.K), 3, run_problem.C)
        b = None if b is None else _pad_channels(b, 0, run_problem.C)
    xc, w_krsc, b = _aligned(xc), _aligned(w_krsc), _aligned(b)
    if out is not None and out.data_ptr() % 16:
        raise ValueError("out must start on a 16-byte boundary")
    exact = run_problem == problem
    y = out if (out is not None and exact) else torch.empty(
        (run_problem.N, run_problem.C, run_problem.H, run_problem.W), dtype=x.dtype, device=x.device,
        memory_format=torch.channels_last)
    err = load().run(base, run_problem.as_list(), xc, w_krsc, b, y)
    if err:
        raise RuntimeError(f"CUTLASS configuration {config} failed on {run_problem.describe()}: {err}")
    if exact:
        return y
    y = y[:, : problem.C]
    if out is not None:
        return out.copy_(y)
    return y.contiguous(memory_format=torch.channels_last)


@dataclass(frozen=True)
class Pick:
    config: str
    ms: float
    times: dict[str, float]  # every configuration that ran, ms
    refused: dict[str, str]  # every configuration that could not, and why


def candidates(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
               output_padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, groups: int = 1,
               *, pad: bool = True) -> dict[str, Callable[[], torch.Tensor]]:
    """One call per configuration that can run the problem on these tensors as given (what bench/kernels/zoo.py
    times beside ours and cuDNN); ``UnsupportedError`` with every configuration's reason when none can."""
    cands = supported(x, w, stride, padding, output_padding, dilation, groups, pad=pad)
    runs = {c: partial(conv_transpose2d, x, w, bias, stride, padding, output_padding, dilation, groups, config=c)
            for c, reason in cands.items() if not reason}
    if not runs:
        raise UnsupportedError(f"no CUTLASS configuration runs this problem: {cands}")
    return runs


def best(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, stride: int | Sequence[int] = 1,
         padding: int | Sequence[int] = 0, output_padding: int | Sequence[int] = 0,
         dilation: int | Sequence[int] = 1, groups: int = 1, timer: TimerFn | None = None,
         *, pad: bool = True) -> Pick:
    """Times every configuration that can run the problem (``timer(fn) -> ms``; default bench/harness.py's
    ``Timer``, L2 flushed before each call, as the zoo times ours and cuDNN) on these tensors as given and returns the
    fastest; ``UnsupportedError`` when none can run it."""
    if timer is None:
        timer = Timer(reps=20, warmup=1)
    refused = {c: r for c, r in supported(x, w, stride, padding, output_padding, dilation, groups, pad=pad).items()
               if r}
    times = {c: timer(fn) for c, fn in candidates(x, w, bias, stride, padding, output_padding, dilation, groups,
                                                   pad=pad).items()}
    c = min(times, key=times.__getitem__)
    return Pick(c, times[c], times, refused)


# ----------------------------------------------------------------------------------------------------------------
# Numerics


# (N, C_in, C_out, kernel, stride, padding, output_padding, H, W, bias)
CHECK_SHAPES: tuple[tuple[Any, ...], ...] = (
    (2, 64, 32, 4, 2, 1, 0, 8, 8, True),  # k4 s2 p1 (DCGAN, pix2pix)
    (2, 32, 64, 2, 2, 0, 0, 7, 9, False),  # k2 s2 p0 (U-Net, Mask R-CNN)
    (2, 48, 24, 3, 2, 1, 1, 9, 6, True),  # k3 s2 p1 op1 (CycleGAN)
    (2, 21, 21, 4, 2, 0, 0, 7, 7, False),  # odd channels (FCN-8s)
    (2, 16, 3, 4, 2, 1, 0, 8, 8, True),  # 3 output channels (RGB layers)
    (2, 56, 1, 9, 3, 4, 2, 6, 6, True),  # k9 s3 p4 op2, 1 output channel (FSRCNN)
    (1, 32, 16, 16, 8, 0, 0, 3, 3, False),  # k16 s8 (FCN-8s upscore8)
    (2, 16, 8, 1, 2, 0, 0, 5, 5, True),  # k1 s2: phases no tap reaches (bias only)
    (1, 8, 8, 3, 1, 1, 0, 10, 12, True),  # stride 1
    (2, 16, 24, (3, 5), (2, 1), (1, 2), (1, 0), 6, 7, True),  # asymmetric kernel, stride, padding
    (4, 128, 64, 4, 2, 1, 0, 16, 16, True),  # several tiles in M and N
    (3, 40, 72, 3, 2, 1, 1, 13, 11, False),  # ragged tiles
)


def check(dtype: torch.dtype | str, shapes: Sequence[tuple[Any, ...]] = CHECK_SHAPES, *, pad: bool = True,
          log: Callable[[str], None] | None = log_stderr, seed: int = 0) -> list[dict[str, Any]]:
    """Every configuration of ``dtype`` that can run each shape against float64 ``F.conv_transpose2d`` on the GPU,
    writing into a NaN-filled output: one row per (shape, configuration) with the norm-wise relative error and
    ``ok`` (finite and within ``TOL``). Configurations that cannot run a shape are listed with their reason."""
    name = dtype_name(dtype)
    dt = DTYPES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = []
    for shape in shapes:
        n, ci, co, k, s, p, op, h, w_, has_bias = shape
        kh, kw = pair(k, "kernel")
        x = torch.randn(n, ci, h, w_, device="cuda", generator=gen).to(dt)
        w = (torch.randn(ci, co, kh, kw, device="cuda", generator=gen) / math.sqrt(ci * kh * kw)).to(dt)
        b = torch.randn(co, device="cuda", generator=gen).to(dt) if has_bias else None
        ref = F.conv_transpose2d(x.double(), w.double(), None if b is None else b.double(), s, p, op)
        for c, reason in supported(x, w, s, p, op, pad=pad).items():
            row: dict[str, Any] = {"dtype": name, "shape": shape, "config": c, "ran": not reason, "reason": reason}
            if not reason:
                y = torch.full(ref.shape, float("nan"), dtype=dt, device="cuda").contiguous(
                    memory_format=torch.channels_last)
                conv_transpose2d(x, w, b, s, p, op, config=c, out=y)
                torch.cuda.synchronize()
                finite = bool(torch.isfinite(y).all())
                err = ((y.double() - ref).norm() / ref.norm()).item() if finite else float("inf")
                row.update(rel_err=err, finite=finite, ok=finite and err <= TOL[name])
                if log:
                    log(f"{name} {shape} {c}: rel_err {err:.2e} {'ok' if row['ok'] else 'WRONG'}")
            rows.append(row)
        if not any(r["ran"] for r in rows if r["shape"] == shape):
            rows.append({"dtype": name, "shape": shape, "config": None, "ran": False, "ok": False,
                         "reason": "no configuration ran this shape"})
    return rows
