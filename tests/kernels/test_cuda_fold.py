"""GPU correctness of the fold kernel (kernels/csrc/conv_transpose2d_fold.cu) against float64: layers with few channels
(FCN's score up-samplers, RGB and one-channel output layers), exact fp32 / TF32 / bfloat16 / float16, x, w and y in
either layout as they are.

Fresh random inputs, poisoned outputs, norm-wise relative error as in test_cuda.py. The parameters that change its
indexing: input channels that leave a partial k8 step (21) or several steps a tap (40), kernels that are not a
multiple of the stride (phases with fewer taps, a stride larger than the kernel on an axis), unequal strides (1, 4,
8, 16, 32), column strides below 8 (1, 2, 3, 5) whose C_out s_w columns end inside an n8 tile (the zero columns past
N: no store), columns C_out s_w in one chunk, several chunks (exact fp32 takes 8 n8 tiles a chunk, the others 22:
fcn16s has 2 or 6) or one n8 tile (the two warps along N split its k8 steps), images and rows enough for many tiles
a block (the weights loaded again at a row phase's change), tiles wholly inside y (unchecked pair stores) beside
cropped ones, odd widths, odd padding and an output one element into its storage (element stores instead of pairs);
x and the weights in both layouts, `out` or a new output, bias or none. Then the default choice, its fallbacks, and
the kernels a steady call launches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

import kernels
from kernels.internal import forward_cuda, normalize_args, output_size
from service.engine.ops import WeightPacks
from tests.kernels.launches import kernels_launched
from tests.kernels.test_cuda import MODES, reference
from tests.numerics import rel_err

pytestmark = pytest.mark.cuda

needs_sm80 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                                reason="the fold kernel runs on sm_80 and newer")

# k and s: kernel and stride, an int or (h, w); p: padding; op: output padding.
PROBLEMS = {
    "fcn8s": dict(n=2, c_in=21, c_out=21, h=9, w=10, k=16, s=8),                   # 4 taps, 21 n8 tiles
    "fcn8s_many": dict(n=3, c_in=21, c_out=21, h=48, w=40, k=16, s=8, bias=False),  # 576 tiles: 2-3 a block
    "fcn16s": dict(n=1, c_in=21, c_out=21, h=7, w=6, k=32, s=16),                  # 42 n8 tiles: two chunks
    "fcn32s": dict(n=2, c_in=5, c_out=5, h=4, w=3, k=64, s=32),                    # 20 n8 tiles
    "crop": dict(n=2, c_in=21, c_out=21, h=8, w=8, k=16, s=8, p=4),                # cropped first and last b
    "crop_asym": dict(n=1, c_in=12, c_out=7, h=6, w=9, k=16, s=8, p=(3, 5), op=(2, 7)),
    "partial_taps": dict(n=2, c_in=16, c_out=10, h=5, w=7, k=(12, 20), s=8),       # 2 x 3 taps, some phases fewer
    "stride_gt_kernel": dict(n=2, c_in=8, c_out=6, h=5, w=6, k=(3, 6), s=(4, 8)),  # phases with no tap
    "rows_s1": dict(n=2, c_in=9, c_out=4, h=6, w=5, k=(3, 8), s=(1, 8), p=(1, 0)),  # 3 vertical taps
    "rows_s4": dict(n=2, c_in=24, c_out=8, h=7, w=6, k=(8, 16), s=(4, 8)),
    "deep": dict(n=1, c_in=40, c_out=8, h=6, w=6, k=16, s=8),                      # 5 k8 steps a tap
    "one_channel": dict(n=3, c_in=1, c_out=1, h=5, w=11, k=16, s=8),               # one n8 tile
    "odd_width": dict(n=2, c_in=7, c_out=3, h=4, w=5, k=9, s=8, p=(0, 1), op=(0, 3)),  # odd W_out: element stores
    # Tiles whose every row and column lands in y: unchecked pair stores where every pair starts at an even element
    # (fcn8s_many too), element stores where odd offsets occur (an odd width, an odd padding).
    "inside_pad": dict(n=2, c_in=21, c_out=21, h=40, w=24, k=16, s=8, p=4),       # W_out 320
    "inside_odd_width": dict(n=1, c_in=5, c_out=3, h=36, w=20, k=17, s=8),        # W_out 169
    "inside_odd_pad": dict(n=1, c_in=6, c_out=4, h=36, w=20, k=16, s=8, p=3),     # W_out 162, pad_w 3
    # Column strides below 8: N = C_out s_w padded to whole n8 tiles.
    "rgb_s2": dict(n=2, c_in=20, c_out=3, h=18, w=13, k=4, s=2, p=1),             # N 6: one tile, split k8 steps
    "one_s3": dict(n=2, c_in=10, c_out=1, h=19, w=12, k=9, s=3, p=4, op=2),       # N 3, 3 x 3 taps
    "enet_s2": dict(n=1, c_in=16, c_out=20, h=20, w=17, k=3, s=2, p=1, op=1),     # N 40: 5 tiles, 2 x 2 taps
    "s1": dict(n=2, c_in=12, c_out=5, h=18, w=11, k=3, s=1, p=1),                 # N 5, 3 x 3 taps, stride 1
    "s5_odd": dict(n=1, c_in=9, c_out=7, h=17, w=9, k=(4, 7), s=(2, 5), p=(1, 2)),  # N 35: a tile's channels straddle
    "inside_n6": dict(n=1, c_in=20, c_out=3, h=36, w=20, k=4, s=2),               # unchecked pairs, N 6 of 8
    "deep_s2": dict(n=1, c_in=128, c_out=3, h=12, w=10, k=4, s=2, p=1),           # K 512 (pix2pix's RGB layer)
}


def run(problem: dict, mode: str, *, x_layout: str = "nchw", w_layout: str = "nchw", new_output: bool = False,
        out_offset: int = 0, seed: int = 0, force_path: str | None = "fold", force_config: int | None = None,
        packs: bool = False) -> tuple[float, float, str, torch.Tensor]:
    """Run one problem (``g``: groups) into a poisoned NCHW ``out`` (``out_offset`` elements into its storage, between
    poisoned margins that must stay so) or a new output over poisoned memory, with ``force_path`` (None: the
    default choice) and ``force_config`` and, with ``packs``, the weights packed once (``WeightPacks``). Returns
    (rel_err, tol, path, y). The taps path's and the staged narrow form's tests run it too."""
    p = dict(problem)
    n, c_in, c_out, h, w = p.pop("n"), p.pop("c_in"), p.pop("c_out"), p.pop("h"), p.pop("w")
    kh, kw = (p["k"], p["k"]) if isinstance(p["k"], int) else p["k"]
    groups = p.get("g", 1)
    args = normalize_args(p["s"], p.get("p", 0), p.get("op", 0), groups, 1)
    dtype, precision, tol = MODES[mode]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, c_in, h, w, device="cuda", generator=g).to(dtype)
    wt = torch.randn(c_in, c_out // groups, kh, kw, device="cuda", generator=g).to(dtype)
    b = torch.randn(c_out, device="cuda", generator=g).to(dtype) if p.get("bias", True) else None
    if x_layout == "cl":
        x = x.contiguous(memory_format=torch.channels_last)
    if w_layout == "cl":
        wt = wt.contiguous(memory_format=torch.channels_last)
    ho = output_size(h, kh, args.stride[0], args.padding[0], args.output_padding[0], 1)
    wo = output_size(w, kw, args.stride[1], args.padding[1], args.output_padding[1], 1)
    out = None
    size, margin = n * c_out * ho * wo, 4096
    if new_output:
        torch.full((4 * size,), float("nan"), device="cuda", dtype=dtype)
    else:  # `out` inside a poisoned buffer whose margins must stay poisoned: no write outside y
        buffer = torch.full((margin + out_offset + size + margin,), float("nan"), device="cuda", dtype=dtype)
        out = buffer[margin + out_offset:margin + out_offset + size].view(n, c_out, ho, wo)
    y, path = forward_cuda(x, wt, b, args, precision or "fp32", out=out, force_path=force_path,
                           force_config=force_config, packs=WeightPacks(wt) if packs else None)
    if out is not None:
        assert buffer[:margin + out_offset].isnan().all()
        assert buffer[margin + out_offset + size:].isnan().all()
    ref = reference(x, wt, b, stride=args.stride, padding=args.padding, output_padding=args.output_padding,
                    groups=groups)
    assert y.shape == ref.shape
    return rel_err(y, ref), tol, path, y


def check_forced(problem: dict, mode: str, family: str, *, x_layout: str, w_layout: str, new_output: bool,
                 config: int | None = None) -> None:
    """``run`` with ``family`` (and ``config``) forced: that family ran, wrote every element, returned y in x's layout
    as PyTorch does (an `out` is NCHW; a one-channel x is both layouts, read as NCHW) and is within the mode's
    tolerance. The forced tests of the fold kernel, the taps path, the fused taps kernel and the staged narrow
    form."""
    err, tol, path, y = run(problem, mode, x_layout=x_layout, w_layout=w_layout, new_output=new_output,
                            force_path=family, force_config=config)
    assert path == family
    assert not torch.isnan(y).any()
    cl = x_layout == "cl" and new_output and y.shape[1] > 1 and problem["c_in"] > 1
    assert y.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
    assert err <= tol, f"{family}/{mode}: rel err {err:.3e} > {tol:.0e}"


def forced_cases(problems: Sequence[str], modes: Sequence[str]) -> Callable[[Callable], Callable]:
    """The forced tests' cases: every problem and mode, x and the weights in both layouts, `out` or a new output."""
    def mark(test: Callable) -> Callable:
        for name, values in (("problem", list(problems)), ("mode", list(modes)), ("x_layout", ["nchw", "cl"]),
                             ("w_layout", ["nchw", "cl"]), ("new_output", [False, True])):
            test = pytest.mark.parametrize(name, values)(test)
        return test
    return mark


@needs_sm80
@forced_cases(PROBLEMS, ["fp32", "tf32", "bf16", "fp16"])
def test_fold_forced(problem: str, mode: str, x_layout: str, w_layout: str, new_output: bool) -> None:
    check_forced(PROBLEMS[problem], mode, "fold", x_layout=x_layout, w_layout=w_layout, new_output=new_output)


@needs_sm80
@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("problem", ["fcn8s", "crop_asym", "odd_width", "one_channel", "inside_pad", "rgb_s2",
                                     "inside_n6"])
def test_fold_stores_elements_into_an_output_one_element_into_its_storage(problem: str, mode: str) -> None:
    err, tol, path, y = run(PROBLEMS[problem], mode, out_offset=1)
    assert path == "fold"
    assert not torch.isnan(y).any()
    assert err <= tol, f"{problem}/{mode}: rel err {err:.3e} > {tol:.0e}"


@needs_sm80
@pytest.mark.parametrize("x_layout", ["nchw", "cl"])
@pytest.mark.parametrize("mode", ["tf32", "bf16", "fp16"])
@pytest.mark.parametrize("problem", ["fcn8s", "fcn16s", "crop", "partial_taps"])
def test_fold_is_the_default_for_its_layers(problem: str, mode: str, x_layout: str) -> None:
    err, tol, path, _ = run(PROBLEMS[problem], mode, x_layout=x_layout, new_output=True, force_path=None)
    assert path == "fold"
    assert err <= tol


def _default_path(x: torch.Tensor, w: torch.Tensor, precision: str = "tf32", **kw: object) -> str:
    args = normalize_args(kw.get("stride", 8), kw.get("padding", 0), kw.get("output_padding", 0),
                          kw.get("groups", 1), kw.get("dilation", 1))
    y, path = forward_cuda(x, w, None, args, precision)
    ref = reference(x, w, None, stride=args.stride, padding=args.padding, output_padding=args.output_padding,
                    groups=args.groups, dilation=args.dilation)
    assert rel_err(y, ref) <= MODES[precision if x.dtype == torch.float32 else "bf16"][2]
    return path


@needs_sm80
def test_fold_fallbacks() -> None:
    x = torch.randn(2, 21, 8, 8, device="cuda")
    w = torch.randn(21, 21, 16, 16, device="cuda")
    assert _default_path(x, w) == "fold"
    # Exact fp32 too (3xTF32); float64 is not this kernel's products.
    assert _default_path(x, w, "fp32") == "fold"
    assert _default_path(x.double(), w.double(), "fp32") != "fold"
    # A column stride that is not a multiple of 8 (eligible: forced above), groups, dilation.
    assert _default_path(x, w[:, :, :8, :8].contiguous(), stride=4) != "fold"
    assert _default_path(x[:, :20], w[:20, :10].contiguous(), groups=2) != "fold"
    assert _default_path(x, w[:, :, :8, :8].contiguous(), dilation=2) != "fold"
    # Too many channels for a row phase's weights in shared memory: 256 x 4 taps of K.
    assert _default_path(torch.randn(1, 256, 4, 4, device="cuda"), torch.randn(256, 21, 16, 16, device="cuda")) \
        != "fold"
    # Eligible, but not preferred: 32 input channels (the gemm kernel's tiles fill), and a one-channel mask over
    # enough output pixels for the tiled narrow kernel.
    assert _default_path(torch.randn(2, 32, 8, 8, device="cuda"), torch.randn(32, 16, 16, 16, device="cuda")) \
        != "fold"
    assert _default_path(torch.randn(16, 1, 28, 28, device="cuda"), torch.randn(1, 1, 16, 16, device="cuda"),
                         padding=4) == "narrow_tiled"
    # Still the default at the rule's edge: 24 input channels.
    assert _default_path(torch.randn(2, 24, 8, 8, device="cuda"), torch.randn(24, 16, 16, 16, device="cuda")) \
        == "fold"


@needs_sm80
@pytest.mark.parametrize("x_layout", ["nchw", "cl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_steady_call_launches_only_the_fold_kernel(dtype: torch.dtype, x_layout: str) -> None:
    x = torch.randn(2, 21, 34, 34, device="cuda").to(dtype)
    if x_layout == "cl":
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(21, 21, 16, 16, device="cuda").to(dtype)
    b = torch.randn(21, device="cuda").to(dtype)
    precision = "tf32" if dtype == torch.float32 else "fp32"
    outputs: list[torch.Tensor] = []
    with torch.no_grad():
        launched = kernels_launched(lambda: outputs.append(kernels.conv_transpose2d(x, w, b, 8, precision=precision)))
    y = outputs[-1]  # the profiled call's
    assert len(launched) == 1, launched
    assert "conv_transpose2d_fold_kernel" in launched[0], launched
    assert y.is_contiguous(memory_format=torch.channels_last if x_layout == "cl" else torch.contiguous_format)
    assert rel_err(y, reference(x, w, b, stride=8)) <= MODES["tf32" if dtype == torch.float32 else "bf16"][2]
