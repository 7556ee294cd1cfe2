"""GPU correctness of the shuffle kernel (kernels/csrc/conv_transpose2d_shuffle.cu) against float64: layers whose
kernel is their stride, 16-bit, NCHW tensors read and written as they are; x read by TMA (an image's positions in
whole 16-byte vectors) or by the loader's threads (8-byte vectors: 14 x 14 RoIs, or an x 8 bytes into its storage).

Fresh random inputs, poisoned outputs, norm-wise relative error as in test_cuda.py. The parameters that change its
indexing: input channels that leave a partial stage, (co, a, b) rows that leave a partial tile or a row group across
output channels, positions that leave a partial tile (one or two boxes of x), more tiles than blocks (the ring runs
across tiles), padding that crops (stores that are not whole vectors), non-square kernels, kW of 1, 2 and 4, weights
in either layout, bias or none; then the default choice, its fallbacks, and the kernels a steady call launches.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.internal import forward_cuda, normalize_args, output_size
from tests.kernels.launches import kernels_launched
from tests.kernels.test_cuda import MODES, reference
from tests.numerics import rel_err

pytestmark = pytest.mark.cuda


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="the shuffle kernel runs on sm_90 (H100/H200) only")

# k: kernel and stride (kH = stride_h, kW = stride_w); hw = h * w is a multiple of 8 (TMA rows of x) or of 4.
PROBLEMS = {
    "one_tile": dict(n=2, c_in=128, c_out=32, h=8, w=16, k=2),                  # 128 rows, 128 positions
    "tails": dict(n=3, c_in=40, c_out=36, h=6, w=12, k=2),                      # partial stage, rows, positions
    "one_box": dict(n=2, c_in=64, c_out=48, h=4, w=10, k=2),                    # 40 positions: one box of x
    "crop": dict(n=2, c_in=64, c_out=48, h=8, w=8, k=2, padding=1),             # odd offsets: element stores
    "crop_asym": dict(n=1, c_in=72, c_out=20, h=6, w=12, k=(2, 4), padding=(1, 3)),
    "k4": dict(n=2, c_in=72, c_out=40, h=4, w=6, k=4),                          # 16 taps, kW 4
    "k1": dict(n=2, c_in=64, c_out=130, h=4, w=10, k=1),                        # kW 1, 130 rows
    "k3x2": dict(n=3, c_in=64, c_out=50, h=4, w=4, k=(3, 2)),                   # 6 taps: groups across channels
    "many_tiles": dict(n=4, c_in=64, c_out=256, h=32, w=48, k=2),               # 384 tiles: the ring across tiles
    "deep": dict(n=1, c_in=1024, c_out=64, h=16, w=16, k=2, bias=False),        # 16 stages
    # Positions in 8-byte vectors only: the loader's threads copy x.
    "rois14": dict(n=5, c_in=96, c_out=40, h=14, w=14, k=2),                    # 196: 128 + 68 positions
    "rows12": dict(n=3, c_in=40, c_out=24, h=6, w=2, k=2),                      # 12 positions, partial stage
    "hw4": dict(n=7, c_in=64, c_out=64, h=2, w=2, k=4, bias=False),
    "rois_many": dict(n=40, c_in=128, c_out=64, h=14, w=14, k=2),               # 640 tiles, 2 stages each
}


def run(problem: dict, mode: str, *, new_output: bool = False, weight_layout: str = "nchw", seed: int = 0,
        force: bool = True, x_offset: int = 0) -> tuple[float, float, str, torch.Tensor]:
    """Run one problem with an NCHW input, into a poisoned NCHW ``out`` (or a new output over poisoned memory);
    ``x_offset``: x starts this many elements into its storage. Returns (rel_err, tol, path, y)."""
    p = dict(problem)
    n, c_in, c_out, h, w = p.pop("n"), p.pop("c_in"), p.pop("c_out"), p.pop("h"), p.pop("w")
    k = p.pop("k")
    kh, kw = (k, k) if isinstance(k, int) else k
    bias = p.pop("bias", True)
    args = normalize_args((kh, kw), p.get("padding", 0), 0, 1, 1)
    dtype, _, tol = MODES[mode]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, c_in, h, w, device="cuda", generator=g).to(dtype)
    if x_offset:
        x = torch.empty(x.numel() + x_offset, device="cuda", dtype=dtype)[x_offset:].view_as(x).copy_(x)
    wt = torch.randn(c_in, c_out, kh, kw, device="cuda", generator=g).to(dtype)
    b = torch.randn(c_out, device="cuda", generator=g).to(dtype) if bias else None
    if weight_layout == "cl":
        wt = wt.contiguous(memory_format=torch.channels_last)
    ho = output_size(h, kh, kh, args.padding[0], 0, 1)
    wo = output_size(w, kw, kw, args.padding[1], 0, 1)
    out = None
    if new_output:
        torch.full((n * c_out * ho * wo,), float("nan"), device="cuda", dtype=dtype)
    else:
        out = torch.full((n, c_out, ho, wo), float("nan"), device="cuda", dtype=dtype)
    y, path = forward_cuda(x, wt, b, args, "fp32", out=out, **(dict(force_path="shuffle") if force else {}))
    ref = reference(x, wt, b, stride=args.stride, padding=args.padding)
    assert y.shape == ref.shape
    return rel_err(y, ref), tol, path, y


@needs_sm90
@pytest.mark.parametrize("weight_layout", ["nchw", "cl"])
@pytest.mark.parametrize("new_output", [False, True])
@pytest.mark.parametrize("mode", ["bf16", "fp16"])
@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_shuffle_forced(problem: str, mode: str, new_output: bool, weight_layout: str) -> None:
    err, tol, path, y = run(PROBLEMS[problem], mode, new_output=new_output, weight_layout=weight_layout)
    assert path == "shuffle"
    assert y.is_contiguous()
    assert err <= tol, f"{problem}/{mode}: rel err {err:.3e} > {tol:.0e}"


@needs_sm90
@pytest.mark.parametrize("mode", ["bf16", "fp16"])
@pytest.mark.parametrize("problem", ["one_tile", "tails", "k4", "many_tiles"])
def test_shuffle_copies_x_without_tma_at_an_8_byte_offset(problem: str, mode: str) -> None:
    err, tol, path, _ = run(PROBLEMS[problem], mode, x_offset=4)  # 8 bytes: no TMA, 8-byte copies
    assert path == "shuffle"
    assert err <= tol, f"{problem}/{mode}: rel err {err:.3e} > {tol:.0e}"


@needs_sm90
@pytest.mark.parametrize("mode", ["bf16", "fp16"])
@pytest.mark.parametrize("problem", ["one_tile", "tails", "crop", "k3x2", "rois14"])
def test_shuffle_is_the_default_for_16bit_nchw(problem: str, mode: str) -> None:
    err, tol, path, _ = run(PROBLEMS[problem], mode, force=False)
    assert path == "shuffle"
    assert err <= tol


def _default_path(x: torch.Tensor, w: torch.Tensor, **kw: object) -> str:
    args = normalize_args(kw.get("stride", tuple(w.shape[2:])), kw.get("padding", 0), kw.get("output_padding", 0),
                          kw.get("groups", 1), 1)
    y, path = forward_cuda(x, w, None, args, "tf32" if x.dtype == torch.float32 else "fp32")
    ref = reference(x, w, None, stride=args.stride, padding=args.padding, output_padding=args.output_padding,
                    groups=args.groups)
    assert rel_err(y, ref) <= MODES["tf32" if x.dtype == torch.float32 else "bf16"][2]
    return path


@needs_sm90
def test_shuffle_fallbacks() -> None:
    def t(n, c_in, h, w, dtype=torch.bfloat16):
        return torch.randn(n, c_in, h, w, device="cuda").to(dtype)

    w = torch.randn(64, 64, 2, 2, device="cuda").to(torch.bfloat16)
    assert _default_path(t(2, 64, 8, 8), w) == "shuffle"
    assert _default_path(t(2, 64, 14, 14), w) == "shuffle"  # 8-byte vectors: copied by the loader's threads
    # 7 x 7 positions: an image's rows of x are no whole 8-byte vectors.
    assert _default_path(t(2, 64, 7, 7), w) != "shuffle"
    # A channels-last input goes to the gemm kernel as it is where that kernel is preferred (128 input channels).
    w128 = torch.randn(128, 64, 2, 2, device="cuda").to(torch.bfloat16)
    assert _default_path(t(2, 128, 8, 8).contiguous(memory_format=torch.channels_last), w128) == "gemm"
    # An input one element into its storage: not 8-byte aligned.
    xs = torch.randn(2 * 64 * 64 + 1, device="cuda").to(torch.bfloat16)[1:].view(2, 64, 8, 8)
    assert _default_path(xs, w) != "shuffle"
    # Output padding, groups, a kernel larger than the stride, fp32: not this kernel's layers.
    assert _default_path(t(2, 64, 8, 8), w, stride=3, output_padding=1) != "shuffle"
    assert _default_path(t(2, 64, 8, 8), w[:, :32].contiguous(), groups=2) != "shuffle"
    assert _default_path(t(2, 64, 8, 8), torch.randn(64, 64, 4, 4, device="cuda").to(torch.bfloat16),
                         stride=2, padding=1) != "shuffle"
    assert _default_path(t(2, 64, 8, 8, torch.float32), w.float()) != "shuffle"


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_steady_nchw_call_launches_only_the_shuffle_kernel(dtype: torch.dtype) -> None:
    x = torch.randn(8, 256, 32, 32, device="cuda").to(dtype)
    w = torch.randn(256, 128, 2, 2, device="cuda").to(dtype)
    b = torch.randn(128, device="cuda").to(dtype)
    outputs: list[torch.Tensor] = []
    with torch.no_grad():
        launched = kernels_launched(lambda: outputs.append(kernels.conv_transpose2d(x, w, b, 2)))
    y = outputs[-1]  # the profiled call's
    assert len(launched) == 1, launched
    assert "conv_transpose2d_shuffle_kernel" in launched[0], launched
    assert y.is_contiguous()
    assert rel_err(y, reference(x, w, b, stride=2)) <= MODES["bf16"][2]


@needs_sm90
def test_shuffle_follows_in_place_weight_updates() -> None:
    x = torch.randn(2, 128, 16, 16, device="cuda").to(torch.bfloat16)
    w = torch.randn(128, 64, 2, 2, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        kernels.conv_transpose2d(x, w, None, 2)  # packs w once
        w.mul_(-0.5)
        y = kernels.conv_transpose2d(x, w, None, 2)
    assert rel_err(y, reference(x, w, None, stride=2)) <= MODES["bf16"][2]
