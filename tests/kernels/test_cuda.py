"""GPU correctness of the CUDA kernels against a float64 reference (run on a GPU machine: ``pytest -m cuda``).

Every check draws fresh random inputs (never zeros), poisons the output with NaN before the kernel writes it,
and compares by norm-wise relative error ``||y - ref|| / ||ref||`` with docs/architecture.md's tolerances.
"""

from __future__ import annotations

import gc
import json
import math
import mmap
import random
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.functional import normalize_args, output_size
from kernels.internal import forward_cuda, load_extension
from service.engine.ops import (
    HostPin,
    conv_transpose2d_direct,
    conv_transpose2d_gathered,
    conv_transpose2d_placed,
    conv_transpose2d_staged,
)
from tests.kernels.launches import kernels_launched
from tests.numerics import rel_err

pytestmark = pytest.mark.cuda

# (dtype, precision) -> tolerance on the norm-wise relative error vs float64.
MODES = {
    "fp32": (torch.float32, "fp32", 1e-5),
    "tf32": (torch.float32, "tf32", 2e-3),
    "bf16": (torch.bfloat16, None, 2e-2),
    "fp16": (torch.float16, None, 2e-2),
    "fp64": (torch.float64, None, 1e-12),
}
# Tensor-core tile configurations: 0-3 the gather kernel, 4-13 the halo kernel, of which 9-12 are the
# warp-specialized wgmma tiles on sm_90 (their mma.sync fallbacks elsewhere and in exact fp32) and 13 the small
# tile for one-image layers
# (kernels/csrc/halo.cuh).
NUM_TC_CONFIGS = 14
HALO_CONFIGS = range(4, NUM_TC_CONFIGS)
BENCH = Path(__file__).resolve().parents[2] / "bench" / "kernels" / "kernelbench_conv_transpose2d.json"


def round_tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> TF32 as cvt.rna does it for finite values: add half a TF32 unit to the magnitude, drop 13 bits."""
    return ((t.view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, **kw: object) -> torch.Tensor:
    """float64 reference from the (already rounded) operands, on the GPU (cuDNN in double)."""
    return F.conv_transpose2d(x.double(), w.double(), None if b is None else b.double(), **kw)  # type: ignore[arg-type]


def run_case(n, c_in, c_out, h, w, k, mode, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
             bias=True, seed=0, force_path=None, force_config=None, force_split=None, tf32_reference=False):
    """Build a random problem, run the kernel into a poisoned output, return (rel_err, tol, path).

    ``tf32_reference``: the reference takes x and w rounded to TF32 (round to nearest, ties away from zero), so that
    what is left of the error is the accumulation's alone."""
    dtype, precision, tol = MODES[mode]
    g = torch.Generator(device="cuda").manual_seed(seed)
    kh, kw = (k, k) if isinstance(k, int) else k
    x = torch.randn(n, c_in, h, w, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    wt = torch.randn(c_in, c_out // groups, kh, kw, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    b = torch.randn(c_out, device="cuda", dtype=torch.float32, generator=g).to(dtype) if bias else None
    args = normalize_args(stride, padding, output_padding, groups, dilation)
    ho = output_size(h, kh, args.stride[0], args.padding[0], args.output_padding[0], args.dilation[0])
    wo = output_size(w, kw, args.stride[1], args.padding[1], args.output_padding[1], args.dilation[1])
    out = torch.full((n, c_out, ho, wo), float("nan"), device="cuda", dtype=dtype)
    mode_prec = precision or "fp32"
    y, path = forward_cuda(x, wt, b, args, mode_prec, out=out, force_path=force_path, force_config=force_config,
                            force_split=force_split)
    assert y.data_ptr() == out.data_ptr()
    if tf32_reference:
        x, wt = round_tf32(x), round_tf32(wt)
    ref = reference(x, wt, b, stride=args.stride, padding=args.padding, output_padding=args.output_padding,
                    groups=groups, dilation=args.dilation)
    assert y.shape == ref.shape
    return rel_err(y, ref), tol, path


# Each family exercises one parameter (or a known trap) across every mode.
FAMILIES = {
    "plain3x3": dict(n=2, c_in=8, c_out=16, h=9, w=11, k=3),
    "kernel1x1": dict(n=2, c_in=16, c_out=8, h=7, w=5, k=1),
    "asym_kernel": dict(n=2, c_in=8, c_out=8, h=6, w=9, k=(2, 5)),
    "stride2": dict(n=2, c_in=8, c_out=8, h=7, w=7, k=4, stride=2, padding=1),
    "stride_asym": dict(n=1, c_in=6, c_out=10, h=5, w=8, k=(3, 5), stride=(2, 3), padding=(1, 2)),
    "stride_gt_kernel": dict(n=2, c_in=4, c_out=4, h=5, w=6, k=2, stride=3),
    "output_padding": dict(n=2, c_in=8, c_out=8, h=5, w=7, k=3, stride=2, padding=1, output_padding=1),
    "output_padding_dilation": dict(n=1, c_in=4, c_out=4, h=6, w=6, k=3, stride=1, dilation=3, output_padding=2),
    "dilation": dict(n=2, c_in=8, c_out=8, h=8, w=8, k=3, dilation=2),
    "dilation_stride": dict(n=2, c_in=8, c_out=12, h=6, w=9, k=3, stride=5, padding=1, dilation=2),
    "big_padding": dict(n=1, c_in=4, c_out=4, h=9, w=9, k=5, padding=3),
    "groups2": dict(n=2, c_in=8, c_out=12, h=7, w=6, k=3, groups=2),
    "groups4_strided": dict(n=2, c_in=8, c_out=16, h=9, w=7, k=(3, 5), stride=(2, 3), padding=(1, 2),
                            dilation=(2, 1), groups=4),
    "depthwise": dict(n=2, c_in=16, c_out=16, h=9, w=9, k=3, groups=16, stride=2, padding=1),
    "no_bias": dict(n=2, c_in=8, c_out=8, h=5, w=5, k=3, bias=False),
    "batch1_1x1_input": dict(n=1, c_in=8, c_out=8, h=1, w=1, k=3),
    "odd_channels": dict(n=3, c_in=65, c_out=129, h=7, w=5, k=3),
    "wide_odd": dict(n=1, c_in=3, c_out=5, h=13, w=67, k=(1, 3), stride=(1, 2)),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family(family: str, mode: str) -> None:
    err, tol, _ = run_case(**FAMILIES[family], mode=mode, seed=zlib.crc32(family.encode()) % 10_000)
    assert err <= tol, f"{family}/{mode}: rel err {err:.3e} > {tol:.0e}"


def _random_config(rng: random.Random) -> dict:
    while True:
        groups = rng.choice([1, 1, 1, 2, 3, 4])
        cfg = dict(
            n=rng.randint(1, 3),
            c_in=groups * rng.randint(1, 12),
            c_out=groups * rng.randint(1, 12),
            h=rng.randint(1, 17),
            w=rng.randint(1, 17),
            k=(rng.randint(1, 6), rng.randint(1, 6)),
            stride=(rng.randint(1, 4), rng.randint(1, 4)),
            dilation=(rng.randint(1, 3), rng.randint(1, 3)),
            groups=groups,
            bias=rng.random() < 0.7,
        )
        cfg["padding"] = (rng.randint(0, 3), rng.randint(0, 3))
        cfg["output_padding"] = tuple(
            rng.randint(0, max(s, d) - 1) for s, d in zip(cfg["stride"], cfg["dilation"], strict=True))
        ok = all(
            output_size(cfg[a], cfg["k"][i], cfg["stride"][i], cfg["padding"][i], cfg["output_padding"][i],
                        cfg["dilation"][i]) > 0
            for i, a in enumerate(("h", "w"))
        )
        if ok:
            return cfg


@pytest.mark.parametrize("seed", range(240))
def test_random_config(seed: int) -> None:
    rng = random.Random(seed)
    cfg = _random_config(rng)
    mode = rng.choice(list(MODES))
    err, tol, _ = run_case(**cfg, mode=mode, seed=seed)
    assert err <= tol, f"seed {seed} {cfg} {mode}: rel err {err:.3e} > {tol:.0e}"


FORCED = {
    "odd_all": dict(n=3, c_in=13, c_out=37, h=11, w=19, k=(3, 2), stride=(2, 3), padding=(1, 0), dilation=(1, 2),
                    output_padding=(1, 1)),
    "groups_bias": dict(n=2, c_in=24, c_out=150, h=5, w=9, k=3, stride=2, padding=1, groups=3),
    "tiny_channels": dict(n=2, c_in=3, c_out=2, h=7, w=6, k=4, stride=2, padding=1),
    "many_pixels": dict(n=2, c_in=40, c_out=20, h=33, w=47, k=(5, 3), padding=(2, 1)),
    # Rows a multiple of 16 bytes: the halo kernel's 16-byte copies, with halos crossing every border.
    "aligned_rows": dict(n=2, c_in=24, c_out=40, h=21, w=72, k=(3, 5), padding=(1, 2), dilation=(1, 2)),
    "aligned_strided": dict(n=2, c_in=20, c_out=70, h=9, w=40, k=4, stride=2, padding=1, output_padding=1),
}


@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("route", ["simt", *(f"tc{i}" for i in range(NUM_TC_CONFIGS))])
@pytest.mark.parametrize("problem", list(FORCED))
def test_forced_paths(problem: str, route: str, mode: str) -> None:
    """Every kernel family and every tensor-core tile configuration (gather 0-3, halo 4-13) on awkward shapes."""
    kw = dict(force_path="simt") if route == "simt" else dict(force_path="tensor_core", force_config=int(route[2:]))
    err, tol, path = run_case(**FORCED[problem], mode=mode, seed=zlib.crc32(problem.encode()), **kw)
    assert path == ("simt" if route == "simt" else "tensor_core")
    assert err <= tol, f"{problem}/{route}/{mode}: rel err {err:.3e} > {tol:.0e}"


# TF32 operands are rounded to nearest (cvt.rna), not truncated: against a reference from rounded operands only the
# accumulation's error is left (about 7e-9 x K; K = 80 and 360 here), while truncated or unrounded operands leave
# ~3e-4. On sm_90 tc11 rounds the patch in shared memory and tc9, tc10 and tc12 in the consumers' registers
# (conv_transpose2d_wgmma.cu); odd_all's rows are not 16-byte aligned (their mma.sync fallbacks).
@pytest.mark.parametrize("route", [f"tc{i}" for i in range(NUM_TC_CONFIGS)])
@pytest.mark.parametrize("problem", ["aligned_rows", "aligned_strided", "odd_all"])
def test_tf32_rounds_operands_to_nearest(problem: str, route: str) -> None:
    err, _, path = run_case(**FORCED[problem], mode="tf32", seed=zlib.crc32(problem.encode()),
                            force_path="tensor_core", force_config=int(route[2:]), tf32_reference=True)
    assert path == "tensor_core"
    assert err <= 3e-5, f"{problem}/{route}: rel err {err:.3e} against TF32-rounded operands"


# Split-K over thread-block clusters (halo kernel, sm_90): `split` blocks share each tile, each over a range of
# input-channel stages, and reduce through distributed shared memory. aligned_strided has 3 fp32 stages (2 in
# 16 bits), so split 8 leaves most blocks without a stage; one_image is a batch-1 decoder layer.
SPLIT = {
    "aligned_rows": FORCED["aligned_rows"],
    "aligned_strided": FORCED["aligned_strided"],
    "one_image": dict(n=1, c_in=72, c_out=48, h=8, w=32, k=4, stride=2, padding=1),
}


@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("split", [2, 3, 8])
@pytest.mark.parametrize("config", list(HALO_CONFIGS))
@pytest.mark.parametrize("problem", list(SPLIT))
def test_forced_split(problem: str, config: int, split: int, mode: str) -> None:
    err, tol, path = run_case(**SPLIT[problem], mode=mode, seed=zlib.crc32(problem.encode()) + split,
                              force_path="tensor_core", force_config=config, force_split=split)
    assert path == "tensor_core"
    assert err <= tol, f"{problem}/tc{config}/split {split}/{mode}: rel err {err:.3e} > {tol:.0e}"


@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16"])
def test_split_is_deterministic_and_matches_no_split(mode: str) -> None:
    """The split reduces in a fixed order: the same bits every run, and the default choice for a batch-1 layer
    (which splits on an H100/H200) agrees with the unsplit kernel to rounding."""
    dtype, precision, tol = MODES[mode]
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(1, 128, 32, 32, device="cuda", generator=g).to(dtype)
    w = torch.randn(128, 64, 4, 4, device="cuda", generator=g).to(dtype)
    b = torch.randn(64, device="cuda", generator=g).to(dtype)
    args = normalize_args(2, 1, 0, 1, 1)
    runs = [forward_cuda(x, w, b, args, precision or "fp32")[0] for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    whole, _ = forward_cuda(x, w, b, args, precision or "fp32", force_split=1)
    ref = reference(x, w, b, stride=2, padding=1)
    assert rel_err(runs[0], ref) <= tol
    assert rel_err(whole, ref) <= tol
    assert rel_err(runs[0], whole.double()) <= tol


def test_every_tile_configuration_is_forced_above() -> None:
    """The forced-path tests cover every configuration the extension has (a new tile is not left out)."""
    assert int(load_extension().num_tensor_core_configs) == NUM_TC_CONFIGS
    assert int(load_extension().num_narrow_tiled_configs) == 3


def test_extension_checks_raise_with_their_numbers() -> None:
    """The binding's own checks (behind Python's) raise RuntimeError naming the values; they once ended the
    interpreter with SIGSEGV when a message streamed an integer."""
    from kernels.internal import load_extension

    ext = load_extension()
    x = torch.randn(1, 16, 8, 32, device="cuda")
    w = torch.randn(16, 16, 3, 3, device="cuda")
    base = dict(stride=[1, 1], padding=[1, 1], output_padding=[0, 0], dilation=[1, 1], groups=1, precision="tf32")
    cases = [
        (w, dict(force_split=0), r"force_split must be -1 \(choose\) or 1 to 16, got 0\."),
        (w, dict(force_path=10), r"force_path must be .* got 10\."),
        (w, dict(groups=3), r"input channels \(16\) must be a positive multiple of groups \(3\)"),
        (w, dict(out=torch.empty(2, 16, 8, 32, device="cuda")), r"out must be a contiguous \[1, 16, 8, 32\] tensor"),
        (w, dict(stride=[1]), r"stride as 2 values \(height, width\), got 1\."),
        (w.double(), {}, r"weight dtype Double differs from input dtype Float"),
        (w[:8], {}, r"input has 16 channels but weight expects 8\."),
    ]
    for weight, change, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ext.forward(x, weight, None, **{**base, **change})


# K = C_in x taps = 9216 products an output: tensor-core accumulation truncates toward zero, a bias of about
# 7e-9 x K (6e-5 here) when one accumulator takes every product; exact fp32 must stay within 1e-5 regardless.
DEEP = dict(n=1, c_in=1024, c_out=72, h=8, w=40, k=3, padding=1)


@pytest.mark.parametrize("route", ["default", "simt", *(f"tc{i}" for i in range(NUM_TC_CONFIGS))])
def test_exact_fp32_deep_reduction(route: str) -> None:
    kw = {} if route == "default" else (
        dict(force_path="simt") if route == "simt" else dict(force_path="tensor_core", force_config=int(route[2:])))
    if route.startswith("tc") and int(route[2:]) in HALO_CONFIGS:
        kw["force_split"] = 8  # 1024 channels: 128 stages, 16 a block
    err, tol, path = run_case(**DEEP, mode="fp32", seed=7, **kw)
    assert err <= tol, f"deep/{route} ran {path}: rel err {err:.3e} > {tol:.0e}"


def _path(mode: str, **problem) -> str:
    """The kernel family the dispatcher picks for a problem (whose result must be right as well)."""
    err, tol, path = run_case(**problem, mode=mode)
    assert err <= tol, f"{problem}/{mode} ran {path}: rel err {err:.3e} > {tol:.0e}"
    return path


def test_default_path_choice() -> None:
    """Dense problems go to the tensor cores, few output channels per group (<= 8) to the narrow kernel, float64
    with many output channels to the SIMT kernel."""
    dense = dict(n=1, c_in=64, c_out=64, h=8, w=8, k=3)
    assert _path("tf32", **dense) == "tensor_core"
    assert _path("fp32", **dense) == "tensor_core"
    assert _path("bf16", **dense) == "tensor_core"
    assert _path("fp64", **dense) == "simt"
    assert _path("tf32", n=1, c_in=2, c_out=2, h=8, w=8, k=3) == "narrow"
    # The bundled dcgan_rgb layer's shape (C_in 16 -> C_out 3, 4x4, stride 2), in every mode.
    rgb = dict(n=2, c_in=16, c_out=3, h=16, w=16, k=4, stride=2, padding=1, bias=False)
    for mode in MODES:
        assert _path(mode, **rgb) == "narrow", mode
    # The boundary: 8 output channels per group run narrow, 9 the tensor cores.
    up = dict(n=1, c_in=16, h=8, w=8, k=4, stride=2, padding=1)
    assert _path("tf32", **up, c_out=8) == "narrow"
    assert _path("bf16", **up, c_out=8) == "narrow"
    assert _path("tf32", **up, c_out=9) == "tensor_core"
    assert _path("bf16", c_in=64, c_out=64, groups=8, n=1, h=8, w=8, k=3) == "narrow"  # 8 per group
    assert _path("bf16", c_in=64, c_out=72, groups=8, n=1, h=8, w=8, k=3) == "tensor_core"  # 9 per group


def test_narrow_falls_back_when_not_eligible() -> None:
    """Forcing the narrow kernel where it does not apply runs the default choice but for the families that run only
    by default or when forced themselves (and the right answer)."""
    # Weights of the largest phase beyond 48 KiB of shared memory: 1024 channels x 9 taps x 4 lanes x 4 bytes. By
    # default a small layer of few output channels and many input channels: the fused taps kernel.
    big = dict(n=1, c_in=1024, c_out=3, h=4, w=4, k=3)
    assert _path("fp32", **big) == "taps_fused"
    assert run_case(**big, mode="fp32", force_path="narrow")[2] == "simt"
    # A stride beyond the narrow kernel's phase table (32 per axis).
    assert run_case(n=2, c_in=4, c_out=3, h=3, w=3, k=2, stride=(33, 1), mode="bf16", force_path="narrow")[2] == "simt"
    # Too many output channels per group.
    wide = dict(n=1, c_in=16, c_out=16, h=8, w=8, k=3)
    assert run_case(**wide, mode="tf32", force_path="narrow")[2] == "tensor_core"
    assert run_case(**wide, mode="fp64", force_path="narrow")[2] == "simt"


# Narrow-kernel problems (C_out / groups <= 8): every output-channel count it specialises (1-8, 4- and 8-lane
# accumulators), groups, strides with zero-tap phases, dilation, output_padding, odd and tiny sizes, and the
# launch shapes (128 or 256 threads, one or two pixels a thread, more (phase, group)s than grid.z holds).
NARROW_FAMILIES = {
    "cout1": dict(n=2, c_in=5, c_out=1, h=9, w=11, k=3),
    "cout2_stride2": dict(n=3, c_in=7, c_out=2, h=7, w=6, k=4, stride=2, padding=1),
    "dcgan_rgb": dict(n=1, c_in=16, c_out=3, h=32, w=32, k=4, stride=2, padding=1, bias=False),
    "dcgan_rgb_batch3": dict(n=3, c_in=16, c_out=3, h=32, w=32, k=4, stride=2, padding=1),
    "cout4_asym": dict(n=1, c_in=9, c_out=4, h=6, w=13, k=(2, 5), stride=(1, 3), padding=(0, 2)),
    "cout5_groups2": dict(n=2, c_in=6, c_out=10, h=7, w=8, k=3, stride=2, padding=1, groups=2),
    "cout7_dilation": dict(n=2, c_in=5, c_out=7, h=8, w=9, k=3, dilation=(2, 3), padding=(1, 0)),
    "cout8_output_padding": dict(n=3, c_in=6, c_out=8, h=5, w=7, k=3, stride=2, padding=1, output_padding=1),
    "groups3_strided_dilated": dict(n=2, c_in=9, c_out=6, h=7, w=9, k=(3, 5), stride=(2, 3), padding=(1, 2),
                                    dilation=(2, 1), groups=3),
    "depthwise": dict(n=2, c_in=6, c_out=6, h=9, w=8, k=3, stride=2, padding=1, groups=6),
    "stride_gt_kernel": dict(n=2, c_in=4, c_out=3, h=5, w=6, k=2, stride=3),  # zero-tap phases: bias only
    "stride_gt_kernel_no_bias": dict(n=1, c_in=4, c_out=5, h=4, w=5, k=(1, 2), stride=(4, 3), bias=False),
    "dilation_stride": dict(n=2, c_in=8, c_out=3, h=6, w=9, k=3, stride=5, padding=1, dilation=2),
    "output_padding_dilation": dict(n=1, c_in=4, c_out=4, h=6, w=6, k=3, dilation=3, output_padding=2),
    "big_padding": dict(n=1, c_in=4, c_out=2, h=9, w=9, k=5, padding=3),
    "input_1x1": dict(n=1, c_in=8, c_out=3, h=1, w=1, k=3, stride=2),
    "input_1x37": dict(n=3, c_in=5, c_out=4, h=1, w=37, k=(3, 4), stride=(1, 2), padding=(1, 1)),
    "input_33x65": dict(n=1, c_in=6, c_out=3, h=33, w=65, k=3, stride=2, padding=1, output_padding=1),
    "many_channels": dict(n=2, c_in=96, c_out=6, h=5, w=9, k=(2, 3)),  # 36 KiB of fp64 weights
    "stride32_zero_taps": dict(n=1, c_in=3, c_out=2, h=3, w=4, k=(3, 5), stride=(32, 7), padding=(1, 2)),
    # 12 phases x 5500 groups = 66000 (phase, group)s, past grid.z's 65535: the kernel loops over z.
    "z_loop_many_groups": dict(n=1, c_in=5500, c_out=5500, h=2, w=3, k=(2, 3), stride=(3, 4), groups=5500),
    # 81920 output pixels: 256-thread blocks, one pixel a thread.
    "threads256": dict(n=5, c_in=16, c_out=3, h=64, w=64, k=4, stride=2, padding=1),
    # Over 2^20 output pixels: two pixels a thread, with phase rows of odd length (a half-empty last pair).
    "two_pixels": dict(n=2, c_in=4, c_out=3, h=300, w=517, k=3, stride=2, padding=1),
    "two_pixels_cout8": dict(n=1, c_in=5, c_out=8, h=520, w=1031, k=(2, 3), stride=(2, 1), padding=(0, 1)),
}
NARROW_PROBLEMS = {
    **NARROW_FAMILIES,
    **{f"forced_{name}": cfg for name, cfg in FORCED.items() if cfg["c_out"] // cfg.get("groups", 1) <= 8},
}


# Tiled narrow kernel problems: tiles with interior threads (no masks) and edge threads, 1-32 output channels, 2 or
# 3 taps a phase (k4 s2; k9 s3 as in FSRCNN; k3 s1; k3 s2 with 2- and 1-tap phases), zero-tap phases
# (stride and dilation 2), depthwise groups, phase rows of 8-, 16- and 32-thread blocks, a grid of one tile.
NARROW_TILED_FAMILIES = {
    "rgb_k4s2": dict(n=2, c_in=40, c_out=3, h=37, w=70, k=4, stride=2, padding=1),
    "fsrcnn_k9s3": dict(n=1, c_in=12, c_out=1, h=33, w=40, k=9, stride=3, padding=4, output_padding=2),
    "cout2_k3s2_mixed_taps": dict(n=2, c_in=9, c_out=2, h=19, w=50, k=3, stride=2, padding=1, output_padding=1),
    "cout4_k3s1": dict(n=1, c_in=6, c_out=4, h=21, w=35, k=3, padding=1, bias=False),
    "cout7_k3s1": dict(n=2, c_in=5, c_out=7, h=20, w=45, k=3, padding=1),
    "cout8_k4s2": dict(n=1, c_in=7, c_out=8, h=13, w=9, k=4, stride=2, padding=1),
    "dilation_divides_stride": dict(n=2, c_in=5, c_out=3, h=15, w=23, k=3, stride=2, dilation=2, padding=1),
    "depthwise_k4s2": dict(n=2, c_in=6, c_out=6, h=17, w=30, k=4, stride=2, padding=1, groups=6),
    "asym_k2x3": dict(n=1, c_in=8, c_out=3, h=11, w=90, k=(2, 3), stride=(1, 2), padding=(0, 1)),
    "narrow_rows": dict(n=3, c_in=4, c_out=1, h=70, w=5, k=4, stride=2, padding=1),
    # 9-32 output channels a group: one tap's weights at a time, 16, 24 and 32 lanes.
    "cout21_k16s8": dict(n=1, c_in=5, c_out=21, h=9, w=10, k=16, stride=8),
    "cout16_k4s2": dict(n=2, c_in=6, c_out=16, h=11, w=37, k=4, stride=2, padding=1),
    "cout32_k3s1": dict(n=1, c_in=4, c_out=32, h=9, w=40, k=3, padding=1, bias=False),
    "cout12_groups2_k3s2": dict(n=2, c_in=8, c_out=24, h=10, w=20, k=3, stride=2, padding=1, output_padding=1,
                                groups=2),
    "cout24_k9s3": dict(n=1, c_in=3, c_out=24, h=12, w=14, k=9, stride=3, padding=4, output_padding=2),
    # The staged form (configuration 2, 4-9 phases): W_in % 4 == 0 stages whole vectors; regions of 16 x 32
    # positions, several along each axis; channel counts that leave a partial stage (19, 6) or one (2); 6 phases;
    # 16 phases, which it does not take.
    "staged_vec_rgb": dict(n=2, c_in=19, c_out=3, h=45, w=68, k=4, stride=2, padding=1),
    "staged_vec_k9s3": dict(n=1, c_in=6, c_out=1, h=40, w=72, k=9, stride=3, padding=4, output_padding=2),
    "staged_vec_k9s4": dict(n=1, c_in=5, c_out=1, h=20, w=36, k=9, stride=4, padding=4, output_padding=3),
    "staged_s2x3": dict(n=2, c_in=9, c_out=3, h=21, w=44, k=(4, 6), stride=(2, 3), padding=(1, 2)),
    "staged_vec_mixed_taps": dict(n=2, c_in=2, c_out=2, h=70, w=36, k=3, stride=2, padding=1, output_padding=1),
    "staged_vec_zero_taps": dict(n=1, c_in=7, c_out=4, h=33, w=40, k=3, stride=2, dilation=2, padding=2),
}


def _pair(v: int | tuple[int, int]) -> tuple[int, int]:
    return v if isinstance(v, tuple) else (v, v)


def tiled_eligible(cfg: dict, mode: str) -> bool:
    """Whether the tiled narrow kernel takes a problem (narrow_tiled_eligible in conv_transpose2d_narrow.cu): not
    float64, at most 32 output channels a group, per-tap input step 1 and at most 3 taps a phase on both axes,
    weights within 48 KiB."""
    if mode == "fp64":
        return False
    taps = 2
    for k, s, d in zip(_pair(cfg["k"]), _pair(cfg.get("stride", 1)), _pair(cfg.get("dilation", 1)), strict=True):
        g = math.gcd(s, d)
        if d != g:
            return False
        taps = max(taps, (k - 1) // (s // g) + 1)
    groups = cfg.get("groups", 1)
    cout = cfg["c_out"] // groups
    lanes = cout if cout <= 4 else 8 if cout <= 8 else -(-cout // 8) * 8
    per_channel = -(-taps * taps * lanes // 4) * 16
    return cout <= 32 and taps <= 3 and cfg["c_in"] // groups * per_channel <= 48 * 1024


@pytest.mark.parametrize("config", [0, 1, 2])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("problem", [*NARROW_TILED_FAMILIES, *NARROW_PROBLEMS])
def test_narrow_tiled_forced(problem: str, mode: str, config: int) -> None:
    """The tiled narrow kernel, forced with one and two columns a thread and in its staged form, on its own families
    and on every narrow problem: it runs where eligible (the staged form where a group has at most 4 output
    channels and the layer 4-9 phases, its default configuration elsewhere) and the default choice runs
    elsewhere, with the right answer either way."""
    cfg = NARROW_TILED_FAMILIES.get(problem) or NARROW_PROBLEMS[problem]
    err, tol, path = run_case(**cfg, mode=mode, force_path="narrow_tiled", force_config=config,
                              seed=zlib.crc32(problem.encode()) % 9_999)
    if tiled_eligible(cfg, mode):
        assert path == "narrow_tiled"
    else:
        assert path != "narrow_tiled"
    assert err <= tol, f"{problem}/narrow_tiled/{mode}: rel err {err:.3e} > {tol:.0e}"


@pytest.mark.parametrize("width", [34, 36])
@pytest.mark.parametrize("config", [0, 1, 2])
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_narrow_tiled_infinite_inputs_reach_only_their_taps(mode: str, config: int, width: int) -> None:
    """Phases with fewer taps than the kernel's tile skip the missing taps instead of multiplying by a zero weight:
    an infinite input reaches exactly the outputs PyTorch's reaches (36 columns: the staged form's whole vectors)."""
    dtype = MODES[mode][0]
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(2, 6, 21, width, device="cuda", generator=g).to(dtype)
    x[0, 2, 7, 11] = float("inf")
    x[1, 5, 0, 0] = float("-inf")
    x[1, 0, 20, 33] = float("inf")
    w = torch.randn(6, 3, 3, 3, device="cuda", generator=g).to(dtype)
    args = normalize_args(stride=2, padding=1, output_padding=1)
    y, path = forward_cuda(x, w, None, args, "fp32", force_path="narrow_tiled", force_config=config)
    assert path == "narrow_tiled"
    ref = reference(x, w, None, stride=args.stride, padding=args.padding, output_padding=args.output_padding,
                    groups=1, dilation=args.dilation).to(y.device)
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.equal(torch.isinf(y), torch.isinf(ref))
    finite = torch.isfinite(ref)
    assert rel_err(y[finite], ref[finite]) <= MODES[mode][2]


@pytest.mark.parametrize(("c_out", "stride"), [(1, 3), (4, 2), (8, 3), (2, 1), (1, 4)])
def test_narrow_tiled_staged_form_runs_where_it_fits(c_out: int, stride: int) -> None:
    """Configuration 2 launches the staged kernel for at most 4 output channels a group and 4-9 phases; elsewhere,
    forcing it runs the default configuration's kernel."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1, 8, 20, 24, device="cuda", generator=g)
    w = torch.randn(8, c_out, 3, 3, device="cuda", generator=g)
    args = normalize_args(stride=stride)
    names = kernels_launched(lambda: forward_cuda(x, w, None, args, "fp32", force_path="narrow_tiled", force_config=2))
    staged = [n for n in names if "narrow_staged_kernel" in n]
    tiled = [n for n in names if "narrow_tiled_kernel" in n]
    fits = c_out <= 4 and 1 < stride < 4
    assert (len(staged), len(tiled)) == ((1, 0) if fits else (0, 1)), names


def test_narrow_tiled_is_the_default_for_large_narrow_layers() -> None:
    """From 2^17 output pixels a narrow layer the tiled kernel takes runs it by default with NCHW tensors (a
    channels-last fp32 x of 32 channels or more: the taps path, test_cuda_taps.py); below, or in float64, or with 4
    taps a phase, the per-pixel kernel (below 2^17 pixels with 32 input channels or more: the fused taps kernel,
    test_cuda_taps_fused.py)."""
    rgb = dict(n=2, c_in=32, c_out=3, h=128, w=128, k=4, stride=2, padding=1)  # 2 x 256 x 256 pixels
    for mode in ("fp32", "tf32", "bf16", "fp16"):
        assert _path(mode, **rgb) == "narrow_tiled", mode
    assert _path("fp64", **rgb) == "narrow"
    assert _path("bf16", **{**rgb, "c_in": 16, "h": 16, "w": 16}) == "narrow"  # 2 x 32 x 32 pixels
    assert _path("bf16", **{**rgb, "k": 8, "stride": 2, "padding": 3}) == "narrow"  # 4 taps a phase


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("problem", list(NARROW_PROBLEMS))
def test_narrow_forced(problem: str, mode: str) -> None:
    """The narrow kernel, forced, on every narrow family and every FORCED problem it applies to."""
    err, tol, path = run_case(**NARROW_PROBLEMS[problem], mode=mode, force_path="narrow",
                              seed=zlib.crc32(problem.encode()) % 10_000)
    assert path == "narrow"
    assert err <= tol, f"{problem}/narrow/{mode}: rel err {err:.3e} > {tol:.0e}"


# Sparse-kernel problems: a block writes 256 pixels of one output row (every phase) and chunks of 16 or 32 output
# channels. Rows of several 256-pixel runs with a partial last one, channel counts with partial chunks, groups,
# rows whose vertical taps fall partly or wholly outside the input, zero-tap rows and columns, up to 8 vertical
# taps, output_padding, and KernelBench 75 / 81 in miniature.
SPARSE_FAMILIES = {
    "kb81_small": dict(n=2, c_in=32, c_out=64, h=9, w=60, k=3, stride=5, padding=1, dilation=2),
    "kb75_small": dict(n=2, c_in=32, c_out=64, h=7, w=90, k=(3, 5), stride=(2, 3), padding=(1, 2), dilation=(2, 1),
                       groups=4),
    "cout37_chunks": dict(n=1, c_in=5, c_out=37, h=6, w=41, k=3, stride=4, padding=2, output_padding=(1, 3)),
    "cout9_no_bias": dict(n=3, c_in=3, c_out=9, h=5, w=7, k=(2, 3), stride=(3, 2), bias=False),
    "stride1_tiny_cin": dict(n=1, c_in=2, c_out=20, h=11, w=300, k=3, padding=1),
    "taps8_rows": dict(n=1, c_in=2, c_out=18, h=12, w=9, k=(8, 2), padding=(5, 0)),
    "padding_edge_rows": dict(n=2, c_in=4, c_out=24, h=3, w=5, k=3, stride=2, padding=(2, 1)),
    "groups3_depthwise_ish": dict(n=2, c_in=6, c_out=51, h=8, w=8, k=3, stride=3, padding=1, groups=3),
    "wide_row_many_runs": dict(n=1, c_in=4, c_out=33, h=2, w=400, k=(1, 4), stride=(1, 2), padding=(0, 1)),
    "input_1x1": dict(n=2, c_in=7, c_out=17, h=1, w=1, k=(3, 5), stride=(2, 3)),
}


@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("problem", list(SPARSE_FAMILIES))
def test_sparse_forced(problem: str, mode: str) -> None:
    err, tol, path = run_case(**SPARSE_FAMILIES[problem], mode=mode, force_path="sparse",
                              seed=zlib.crc32(problem.encode()) % 10_000)
    assert path == "sparse"
    assert err <= tol, f"{problem}/sparse/{mode}: rel err {err:.3e} > {tol:.0e}"


@pytest.mark.parametrize("problem", ["kb81_small", "kb75_small", "cout37_chunks", "groups3_depthwise_ish"])
def test_sparse_tf32_numbers(problem: str) -> None:
    """In TF32 mode the sparse kernel multiplies TF32-rounded operands on ungrouped layers (cuDNN's TF32 numbers:
    only the accumulation's error is left against a reference from rounded operands) and exact ones on grouped
    layers (cuDNN's exact kernels)."""
    grouped = SPARSE_FAMILIES[problem].get("groups", 1) > 1
    err, _, path = run_case(**SPARSE_FAMILIES[problem], mode="tf32", force_path="sparse",
                            tf32_reference=not grouped, seed=zlib.crc32(problem.encode()) % 10_000)
    assert path == "sparse"
    assert err <= 1e-6, f"{problem}: rel err {err:.3e} against the {'exact' if grouped else 'TF32'} reference"
    if not grouped:  # and it did round: the exact reference is a TF32 error away
        assert run_case(**SPARSE_FAMILIES[problem], mode="tf32", force_path="sparse",
                        seed=zlib.crc32(problem.encode()) % 10_000)[0] > 1e-5


def test_sparse_default_choice_and_fallback() -> None:
    """Layers whose output elements average at most 48 multiply-adds run sparse; float64 and rows with more than
    8 vertical taps cannot, and a forced sparse path there runs the default choice."""
    for mode in ("fp32", "tf32", "bf16", "fp16"):
        assert _path(mode, **SPARSE_FAMILIES["kb81_small"]) == "sparse", mode
        assert _path(mode, **SPARSE_FAMILIES["kb75_small"]) == "sparse", mode
    assert _path("fp64", **SPARSE_FAMILIES["kb81_small"]) == "simt"
    # 16 input channels x 1 tap x 4 taps / 2: 32 multiply-adds an element -> sparse; 64 channels: 128 -> not.
    assert _path("tf32", n=1, c_in=16, c_out=32, h=8, w=8, k=(1, 4), stride=(1, 2), padding=(0, 1)) == "sparse"
    assert _path("tf32", n=1, c_in=64, c_out=32, h=8, w=8, k=(1, 4), stride=(1, 2), padding=(0, 1)) == "tensor_core"
    assert run_case(n=1, c_in=8, c_out=16, h=5, w=6, k=3, stride=5, mode="fp64", force_path="sparse")[2] == "simt"
    nine = dict(n=1, c_in=16, c_out=16, h=12, w=6, k=(9, 1), padding=(4, 0))
    assert run_case(**nine, mode="tf32", force_path="sparse")[2] == "tensor_core"


@pytest.mark.parametrize("hw", [(1, 1), (1, 37), (31, 1), (33, 65), (127, 129)])
@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16"])
def test_odd_sizes(hw: tuple[int, int], mode: str) -> None:
    err, tol, _ = run_case(n=1, c_in=17, c_out=33, h=hw[0], w=hw[1], k=3, stride=2, padding=1, mode=mode)
    assert err <= tol


def test_results_do_not_depend_on_launch() -> None:
    """Same inputs twice give bit-identical outputs (no race, no reduction order that moves)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(4, 32, 33, 35, device="cuda", generator=g)
    w = torch.randn(32, 24, 3, 5, device="cuda", generator=g)
    for prec in ("fp32", "tf32"):
        a = kernels.conv_transpose2d(x, w, None, 2, 1, precision=prec)
        b = kernels.conv_transpose2d(x, w, None, 2, 1, precision=prec)
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["transposed", "sliced", "channels_last", "expanded_batch"])
def test_non_contiguous_inputs(layout: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(5)
    base = torch.randn(2, 8, 12, 10, device="cuda", generator=g)
    if layout == "transposed":
        x = base.transpose(2, 3)
    elif layout == "sliced":
        x = base[:, ::2, 1:, ::3]
    elif layout == "channels_last":
        x = base.contiguous(memory_format=torch.channels_last)
    else:
        x = base[:1].expand(3, -1, -1, -1)
    w = torch.randn(x.shape[1], 6, 3, 3, device="cuda", generator=g)
    w_nc = w.transpose(2, 3).contiguous().transpose(2, 3)  # same values, non-contiguous weight
    b = torch.randn(6, device="cuda", generator=g)
    y = kernels.conv_transpose2d(x, w_nc, b, stride=2, padding=1, precision="fp32")
    ref = reference(x, w, b, stride=2, padding=1)
    assert rel_err(y, ref) <= 1e-5
    if layout == "channels_last":
        assert y.is_contiguous(memory_format=torch.channels_last)
        torch_y = F.conv_transpose2d(x, w, b, stride=2, padding=1)
        assert y.stride() == torch_y.stride()


@pytest.mark.parametrize("route", ["simt", "tensor_core", "narrow", "sparse"])
@pytest.mark.parametrize("mode", list(MODES))
def test_channels_last_input_through_nchw_kernels(route: str, mode: str) -> None:
    """A channels-last input on a kernel that reads NCHW: the input changes layout on the way in (the layout kernel,
    2-, 4- and 8-byte elements, tiles cut at every edge) and the output, written NCHW into scratch, on the way out;
    the caller gets a channels-last tensor with PyTorch's strides, every element written."""
    dtype, precision, tol = MODES[mode]
    g = torch.Generator(device="cuda").manual_seed(11)
    n, c_in, c_out, h, w = 3, 37, 5 if route == "narrow" else 35, 33, 7
    x = torch.randn(n, c_in, h, w, device="cuda", generator=g).to(dtype).contiguous(memory_format=torch.channels_last)
    wt = torch.randn(c_in, c_out, 3, 3, device="cuda", generator=g).to(dtype)
    b = torch.randn(c_out, device="cuda", generator=g).to(dtype)
    stride = 3 if route == "sparse" else 2
    args = normalize_args(stride, 1, 0, 1, 1)
    ho, wo = (output_size(s, 3, stride, 1) for s in (h, w))
    torch.full((n * c_out * ho * wo,), float("nan"), device="cuda", dtype=dtype)  # poison the memory y will take
    y, _ = forward_cuda(x, wt, b, args, precision or "fp32", force_path=route)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert not y.is_contiguous()
    ref = reference(x, wt, b, stride=stride, padding=1)
    assert rel_err(y, ref) <= tol, f"{route}/{mode}"


@pytest.mark.parametrize("hw", [(1, 2), (2, 3), (3, 5), (4, 4), (1, 17)])
@pytest.mark.parametrize("mode", list(MODES))
def test_layout_change_of_small_images(mode: str, hw: tuple[int, int]) -> None:
    """Images of a few positions (the layout kernel's 8- and 16-column tiles) with more channels than one tile holds,
    both ways: a channels-last input into the SIMT kernel and its NCHW output back to channels-last."""
    dtype, precision, tol = MODES[mode]
    g = torch.Generator(device="cuda").manual_seed(sum(hw))
    h, w = hw
    x = torch.randn(5, 70, h, w, device="cuda", generator=g).to(dtype).contiguous(memory_format=torch.channels_last)
    wt = torch.randn(70, 66, 1, 2, device="cuda", generator=g).to(dtype)
    args = normalize_args(1, 0, 0, 1, 1)
    torch.full((5 * 66 * h * (w + 1),), float("nan"), device="cuda", dtype=dtype)  # poison the memory y will take
    y, _ = forward_cuda(x, wt, None, args, precision or "fp32", force_path="simt")
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert rel_err(y, reference(x, wt, None)) <= tol, f"{mode} {hw}"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("c_in", "c_out"), [(3, 1), (2, 3), (5, 8), (8, 2), (12, 1), (9, 4)])
def test_layout_change_of_few_channels(mode: str, c_in: int, c_out: int) -> None:
    """Channels-last tensors of at most 8 channels change layout one position a thread (layout.cu); a one-channel
    output is written where it is (both layouts are the same memory), more channels through the layout kernel."""
    dtype, precision, tol = MODES[mode]
    g = torch.Generator(device="cuda").manual_seed(c_in * 10 + c_out)
    x = torch.randn(3, c_in, 13, 29, device="cuda", generator=g).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    wt = torch.randn(c_in, c_out, 3, 3, device="cuda", generator=g).to(dtype)
    b = torch.randn(c_out, device="cuda", generator=g).to(dtype)
    args = normalize_args(2, 1, 1, 1, 1)
    torch.full((3 * c_out * 27 * 59 * 2,), float("nan"), device="cuda", dtype=dtype)  # poison the memory y will take
    y, _ = forward_cuda(x, wt, b, args, precision or "fp32")
    assert y.is_contiguous(memory_format=torch.channels_last)
    ref = reference(x, wt, b, stride=2, padding=1, output_padding=1)
    assert rel_err(y, ref) <= tol, f"{mode} {c_in} -> {c_out}"


def test_unbatched_and_empty_batch() -> None:
    x = torch.randn(4, 5, 6, device="cuda")
    w = torch.randn(4, 3, 3, 3, device="cuda")
    y = kernels.conv_transpose2d(x, w, precision="fp32")
    assert y.shape == (3, 7, 8)
    assert rel_err(y, reference(x, w, None)) <= 1e-5
    e = kernels.conv_transpose2d(torch.randn(0, 4, 5, 6, device="cuda"), w)
    assert e.shape == F.conv_transpose2d(torch.randn(0, 4, 5, 6, device="cuda"), w).shape


def test_precision_follows_allow_tf32() -> None:
    """With TF32 disallowed, a float32 call without precision= must be exact fp32."""
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(2, 64, 20, 20, device="cuda", generator=g)
    w = torch.randn(64, 64, 3, 3, device="cuda", generator=g)
    ref = reference(x, w, None, stride=2)
    old = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = False
        assert rel_err(kernels.conv_transpose2d(x, w, stride=2), ref) <= 1e-5
        torch.backends.cudnn.allow_tf32 = True
        assert rel_err(kernels.conv_transpose2d(x, w, stride=2), ref) <= 2e-3
        assert rel_err(kernels.conv_transpose2d(x, w, stride=2, precision="fp32"), ref) <= 1e-5
    finally:
        torch.backends.cudnn.allow_tf32 = old


def test_gradcheck_float64() -> None:
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(2, 4, 5, 4, device="cuda", dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(4, 3, 3, 2, device="cuda", dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(6, device="cuda", dtype=torch.float64, generator=g, requires_grad=True)

    def fn(x, w, b):
        return kernels.conv_transpose2d(x, w, b, stride=(2, 1), padding=(1, 0), output_padding=(1, 0), groups=2,
                                        dilation=(1, 2))

    assert torch.autograd.gradcheck(fn, (x, w, b), eps=1e-6, atol=1e-7)


def test_gradients_match_pytorch() -> None:
    g = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(3, 8, 9, 7, device="cuda", generator=g, requires_grad=True)
    m = nn.ConvTranspose2d(8, 12, 3, stride=2, padding=1, output_padding=1, groups=4).cuda()
    ours = kernels.convert(nn.Sequential(nn.ConvTranspose2d(8, 12, 3, stride=2, padding=1, output_padding=1,
                                                            groups=4).cuda()))[0]
    ours.load_state_dict(m.state_dict())
    gy = torch.randn(3, 12, 18, 14, device="cuda", generator=g)
    (gx_ref,) = torch.autograd.grad(m(x), x, gy, retain_graph=False)
    y = ours(x)
    gx, gw, gb = torch.autograd.grad(y, (x, ours.weight, ours.bias), gy)
    gx2, gw2, gb2 = torch.autograd.grad(m(x), (x, m.weight, m.bias), gy)
    for a, b in ((gx, gx2), (gw, gw2), (gb, gb2)):
        assert rel_err(a, b.double()) <= 2e-3
    assert rel_err(gx, gx_ref.double()) <= 2e-3


def test_module_and_convert_on_gpu() -> None:
    torch.manual_seed(0)
    ref = nn.ConvTranspose2d(16, 8, (3, 5), stride=(2, 1), padding=(1, 2), dilation=(1, 2)).cuda()
    model = kernels.convert(nn.Sequential(nn.ConvTranspose2d(16, 8, (3, 5), stride=(2, 1), padding=(1, 2),
                                                             dilation=(1, 2))).cuda(), precision="fp32")
    model[0].load_state_dict(ref.state_dict())
    x = torch.randn(2, 16, 10, 11, device="cuda")
    y = model(x)
    assert rel_err(y, reference(x, ref.weight, ref.bias, stride=(2, 1), padding=(1, 2), dilation=(1, 2))) <= 1e-5
    y2 = model[0](x, output_size=[20, 15])
    assert y2.shape == ref(x, output_size=[20, 15]).shape == (2, 8, 20, 15)


def test_autocast_bf16() -> None:
    m = kernels.ConvTranspose2d(8, 8, 3).cuda()
    x = torch.randn(2, 8, 6, 6, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, reference(x.bfloat16(), m.weight.bfloat16(), m.bias.bfloat16())) <= 2e-2


def test_runs_on_current_stream_and_device_errors() -> None:
    x = torch.randn(2, 8, 16, 16, device="cuda")
    w = torch.randn(8, 8, 3, 3, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = kernels.conv_transpose2d(x, w, precision="fp32")
    s.synchronize()
    assert rel_err(y, reference(x, w, None)) <= 1e-5
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="cuda"):
        kernels.conv_transpose2d(x, w.cpu())


def _host_problem(family: str, mode: str, n: int | None = None):
    """A family's problem with its input on the host and weights on the GPU: (x, weight, bias, args, ref)."""
    cfg = dict(FAMILIES[family])
    dtype = MODES[mode][0]
    n_cfg, c_in, c_out, h, w, k = (cfg.pop(key) for key in ("n", "c_in", "c_out", "h", "w", "k"))
    groups = int(cfg.get("groups", 1))
    kh, kw = (k, k) if isinstance(k, int) else k
    args = normalize_args(cfg.get("stride", 1), cfg.get("padding", 0), cfg.get("output_padding", 0), groups,
                          cfg.get("dilation", 1))
    x = torch.randn(n or n_cfg, c_in, h, w).to(dtype)
    wt = torch.randn(c_in, c_out // groups, kh, kw, device="cuda").to(dtype)
    b = torch.randn(c_out, device="cuda").to(dtype)
    ref = reference(x.cuda(), wt, b, stride=args.stride, padding=args.padding, output_padding=args.output_padding,
                    groups=groups, dilation=args.dilation)
    return x, wt, b, args, ref


@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("family", ["stride2", "groups4_strided", "output_padding_dilation", "wide_odd", "depthwise"])
def test_staged_host_to_host(family: str, mode: str, pinned: bool) -> None:
    """The serving worker's call: host input -> kernels -> poisoned host output, on a side stream, GIL released."""
    dtype, precision, tol = MODES[mode]
    x, wt, b, args, ref = _host_problem(family, mode)
    out = torch.full(ref.shape, float("nan"), dtype=dtype, pin_memory=pinned)
    x_host = x.pin_memory() if pinned else x
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        path = conv_transpose2d_staged(x_host, wt, b, args, precision, out)
    assert path in ("simt", "tensor_core", "narrow")
    assert rel_err(out.cuda(), ref) <= tol  # written before the call returned: no synchronisation here


def test_staged_rejects_wrong_devices_and_shapes() -> None:
    args = normalize_args(2, 1, 0, 1, 1)
    x = torch.randn(2, 8, 5, 5)
    w = torch.randn(8, 4, 4, 4, device="cuda")
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="CPU input"):
        conv_transpose2d_staged(x.cuda(), w, None, args, "fp32", torch.empty(2, 4, 10, 10))
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="CUDA weights"):
        conv_transpose2d_staged(x, w.cpu(), None, args, "fp32", torch.empty(2, 4, 10, 10))
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="out must be"):
        conv_transpose2d_staged(x, w, None, args, "fp32", torch.empty(2, 4, 9, 10))
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="dtype"):
        conv_transpose2d_staged(x, w, None, args, "fp32", torch.empty(2, 4, 10, 10, dtype=torch.float16))
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="bias"):
        conv_transpose2d_staged(x, w, torch.zeros(5, device="cuda"), args, "fp32", torch.empty(2, 4, 10, 10))
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="channels"):
        conv_transpose2d_staged(torch.randn(2, 7, 5, 5), w, None, args, "fp32", torch.empty(2, 4, 10, 10))


def test_staged_out_of_memory_raises_and_the_next_call_works() -> None:
    """Out of memory while the GIL is released: torch's OutOfMemoryError (the worker halves the batch on it)."""
    args = normalize_args(2, 1, 0, 1, 1)
    x = torch.randn(64, 64, 64, 64)  # 64 MiB
    w = torch.randn(64, 64, 4, 4, device="cuda")
    out = torch.full((64, 64, 128, 128), float("nan"))  # 256 MiB: more than the device may hold below
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (128 << 20)) / total)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            conv_transpose2d_staged(x, w, None, args, "fp32", out)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    conv_transpose2d_staged(x[:2], w, None, args, "fp32", out[:2])
    ref = reference(x[:2].cuda(), w, None, stride=2, padding=1)
    assert rel_err(out[:2].cuda(), ref) <= 1e-5


def _host_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy())


@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("family", ["stride2", "groups4_strided", "wide_odd", "depthwise", "odd_channels"])
def test_gathered_parts_host_to_host(family: str, mode: str) -> None:
    """The serving worker's call: requests' inputs (tensors, memoryviews, bytes) -> one pinned host output."""
    dtype, precision, tol = MODES[mode]
    x, wt, b, args, ref = _host_problem(family, mode, n=6)
    parts = [x[0:2].clone(), _host_bytes(x[2:3]), bytes(_host_bytes(x[3:6]))]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        y = conv_transpose2d_gathered(parts, x.shape, wt, b, args, precision)
    assert y.device.type == "cpu"
    assert y.is_pinned()
    assert y.dtype == dtype
    assert y.is_contiguous()
    assert y.shape == ref.shape
    assert rel_err(y.cuda(), ref) <= tol  # complete when the call returned: no synchronisation here


def _places(arena: memoryview, sizes: list[int], at: int = 0) -> list[memoryview]:
    out = []
    for n in sizes:
        out.append(arena[at:at + n])
        at += n + 64  # gaps between the places, as slots have
    return out


@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("family", ["stride2", "groups4_strided", "wide_odd", "depthwise", "odd_channels"])
@pytest.mark.parametrize("pinned", [True, False])
def test_direct_parts_into_places(family: str, mode: str, pinned: bool) -> None:
    """The serving worker's call for megabyte requests: each request's input uploaded from its place in shared
    memory (page-locked or not) and its output rows downloaded into its own place; the places around stay as
    they were."""
    dtype, precision, tol = MODES[mode]
    x, wt, b, args, ref = _host_problem(family, mode, n=5)
    counts = [2, 1, 2]
    in_sizes = [c * x[0].numel() * x.element_size() for c in counts]
    out_sizes = [c * ref[0].numel() * x.element_size() for c in counts]  # ref is float64
    size = (sum(in_sizes) + sum(out_sizes) + 64 * 8 + 4095) // 4096 * 4096
    memory = mmap.mmap(-1, size)
    pin = HostPin(memoryview(memory)) if pinned else None
    arena = pin.view if pin is not None else memoryview(memory)
    arena[:] = b"\xab" * size  # NaN-free poison: every byte of the outputs must be written
    parts = _places(arena, in_sizes)
    at = sum(in_sizes) + 64 * len(in_sizes)
    outs = _places(arena, out_sizes, at)
    rows = 0
    for part, c in zip(parts, counts, strict=True):
        part[:] = _host_bytes(x[rows:rows + c]).cast("B")
        rows += c
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        path = conv_transpose2d_direct(parts, outs, x.shape, wt, b, args, precision)
    assert path in ("simt", "tensor_core", "narrow", "sparse", "gemm", "narrow_tiled", "shuffle", "fold",
                    "taps", "taps_fused")
    y = torch.cat([torch.frombuffer(o, dtype=torch.uint8).clone().view(dtype) for o in outs]).view(ref.shape)
    assert rel_err(y.cuda(), ref) <= tol  # complete when the call returned: no synchronisation here
    for i in range(len(outs) - 1):  # the gaps between places untouched
        gap_start = at + sum(out_sizes[:i + 1]) + 64 * i
        assert bytes(arena[gap_start:gap_start + 64]) == b"\xab" * 64
    del parts, part, outs, arena, pin, y
    gc.collect()
    memory.close()  # possible only once every view is gone (and with them the page lock)


@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("family", ["stride2", "groups4_strided", "wide_odd", "depthwise", "odd_channels"])
@pytest.mark.parametrize("where", ["device", "one_in_place", "one_unaligned", "device_to_host"])
def test_placed_parts_into_places(family: str, mode: str, where: str) -> None:
    """The serving worker's call for requests in CUDA shared memory (``conv_transpose2d_placed``): each request's
    input read from its place in GPU memory and its output rows written into its own place there (or, with
    ``device_to_host``, into page-locked host memory); a lone request in GPU memory is read and written in place
    when aligned (``one_in_place``), copied when not (``one_unaligned``: 4 bytes off). The poisoned memory around
    the places stays as it was, and every byte of the outputs is written."""
    dtype, precision, tol = MODES[mode]
    counts = [1] if where.startswith("one") else [2, 1, 2]
    x, wt, b, args, ref = _host_problem(family, mode, n=sum(counts))
    size = x.element_size()
    in_sizes = [c * x[0].numel() * size for c in counts]
    out_sizes = [c * ref[0].numel() * size for c in counts]  # ref is float64
    shift = 4 if where == "one_unaligned" else 0
    poison = 0xAB
    device_in = torch.full((sum(in_sizes) + 64 * len(counts) + 64,), poison, dtype=torch.uint8, device="cuda")
    out_device = where != "device_to_host"
    out_memory = torch.full((sum(out_sizes) + 64 * len(counts) + 64,), poison, dtype=torch.uint8,
                            device="cuda" if out_device else "cpu", pin_memory=not out_device)
    parts, outs, at_in, at_out, rows = [], [], shift, shift, 0
    for c, n_in, n_out in zip(counts, in_sizes, out_sizes, strict=True):
        device_in[at_in:at_in + n_in] = x[rows:rows + c].contiguous().view(-1).view(torch.uint8).cuda()
        parts.append((device_in.data_ptr() + at_in, n_in))
        outs.append((out_memory.data_ptr() + at_out, n_out))
        at_in += n_in + 64  # gaps between the places, as between clients' tensors
        at_out += n_out + 64
        rows += c
    before = device_in.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        path = conv_transpose2d_placed(parts, outs, x.shape, wt, b, args, precision)
    assert path in ("simt", "tensor_core", "narrow", "sparse", "gemm", "narrow_tiled", "shuffle", "fold",
                    "taps", "taps_fused")
    memory = out_memory.cpu()  # complete when the call returned: no synchronisation before this copy's own
    y = torch.cat([memory[a - out_memory.data_ptr():a - out_memory.data_ptr() + n].view(dtype) for a, n in outs])
    assert rel_err(y.view(ref.shape).cuda(), ref) <= tol
    placed = torch.zeros(memory.numel(), dtype=torch.bool)
    for a, n in outs:
        placed[a - out_memory.data_ptr():a - out_memory.data_ptr() + n] = True
    assert bool((memory[~placed] == poison).all())  # nothing written outside the places
    assert torch.equal(device_in, before)  # the inputs only read


def test_direct_stages_small_host_places_and_copies_the_rest_straight() -> None:
    """One batch whose input and output are split, at byte offsets that are not sample bounds, over host places of
    every kind: page-locked and pageable below the staging size (staged: consecutive ones moved by one copy), and at
    and above it (copied straight). Every byte lands in its place, the poison around each place stays, and the input
    places are only read."""
    stage = load_extension().stage_below_bytes
    assert stage == 256 << 10
    args = normalize_args(2, 1, 0, 1, 1)
    x = torch.randn(3, 64, 32, 32)  # 768 KiB
    wt = torch.randn(64, 16, 4, 4, device="cuda")
    b = torch.randn(16, device="cuda")
    ref = reference(x.cuda(), wt, b, stride=2, padding=1)  # [3, 16, 64, 64]: 768 KiB in fp32
    kib = 1 << 10
    # (bytes, page-locked); the last one takes what is left
    in_layout = [(16 * kib, True), (4 * kib, False), (stage, True), (20 * kib, False), (stage - 4, True),
                 (None, False)]
    out_layout = [(stage, True), (8 * kib, True), (8 * kib, False), (100 * kib, False), (200 * kib, True),
                  (None, False)]
    poison, margin = 0xAB, 64

    def places(layout: list[tuple[int | None, bool]], total: int) -> list[tuple[torch.Tensor, memoryview]]:
        made, left = [], total
        for size, pinned in layout:
            n = left if size is None else size
            left -= n
            memory = torch.full((n + 2 * margin,), poison, dtype=torch.uint8, pin_memory=pinned)
            made.append((memory, memoryview(memory.numpy())[margin:margin + n]))
        assert left == 0
        return made

    x_bytes = memoryview(x.view(-1).view(torch.uint8).numpy())
    ins, at = places(in_layout, x_bytes.nbytes), 0
    for _, place in ins:
        place[:] = x_bytes[at:at + place.nbytes]
        at += place.nbytes
    outs = places(out_layout, ref.numel() * 4)
    before = [memory.clone() for memory, _ in ins]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        conv_transpose2d_direct([p for _, p in ins], [p for _, p in outs], x.shape, wt, b, args, "fp32")
    y = torch.cat([torch.frombuffer(p, dtype=torch.uint8) for _, p in outs]).view(torch.float32).view(ref.shape)
    assert rel_err(y.cuda(), ref) <= 1e-5  # complete when the call returned: no synchronisation here
    for memory, place in outs:  # nothing written outside the places
        assert bool((memory[:margin] == poison).all())
        assert bool((memory[margin + place.nbytes:] == poison).all())
    for (memory, _), was in zip(ins, before, strict=True):
        assert torch.equal(memory, was)  # the inputs only read


def test_placed_rejects_places_that_do_not_make_the_input_or_output() -> None:
    args = normalize_args(2, 1, 0, 1, 1)
    x = torch.randn(3, 8, 5, 5, device="cuda")
    w = torch.randn(8, 4, 4, 4, device="cuda")
    y = torch.empty(3, 4, 10, 10, device="cuda")
    x_place, y_place = (x.data_ptr(), x.nbytes), (y.data_ptr(), y.nbytes)
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="CUDA weights"):
        conv_transpose2d_placed([x_place], [y_place], x.shape, w.cpu(), None, args, "fp32")
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="input places hold"):
        conv_transpose2d_placed([(x.data_ptr(), x.nbytes - 4)], [y_place], x.shape, w, None, args, "fp32")
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="output places hold"):
        conv_transpose2d_placed([x_place], [y_place, (y.data_ptr(), 4)], x.shape, w, None, args, "fp32")
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="not an address and bytes"):
        conv_transpose2d_placed([x_place, (0, 0)], [y_place], x.shape, w, None, args, "fp32")
    conv_transpose2d_placed([x_place], [y_place], x.shape, w, None, args, "fp32")
    assert rel_err(y, reference(x, w, None, stride=2, padding=1)) <= 1e-5


def test_host_pin_locks_pages_while_a_view_lives() -> None:
    memory = mmap.mmap(-1, 1 << 20)
    pin = HostPin(memoryview(memory))
    part = pin.view[4096:8192]
    del pin
    gc.collect()
    assert torch.frombuffer(part, dtype=torch.uint8).is_pinned()  # a slice keeps the lock
    t = torch.frombuffer(part, dtype=torch.uint8)
    del part
    gc.collect()
    assert t.is_pinned()  # as does a tensor made from one
    del t
    gc.collect()
    assert not torch.frombuffer(memory, dtype=torch.uint8).is_pinned()  # unlocked with the last view
    memory.close()


def test_direct_rejects_places_that_do_not_make_the_output() -> None:
    args = normalize_args(2, 1, 0, 1, 1)
    x = torch.randn(3, 8, 5, 5)
    w = torch.randn(8, 4, 4, 4, device="cuda")
    y_bytes = 3 * 4 * 10 * 10 * 4
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="CUDA weights"):
        conv_transpose2d_direct([x], [memoryview(bytearray(y_bytes))], x.shape, w.cpu(), None, args, "fp32")
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="output places hold"):
        conv_transpose2d_direct([x], [memoryview(bytearray(y_bytes - 4))], x.shape, w, None, args, "fp32")
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="writable"):
        conv_transpose2d_direct([x], [memoryview(bytes(y_bytes))], x.shape, w, None, args, "fp32")
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="hold"):
        conv_transpose2d_direct([x[:2]], [memoryview(bytearray(y_bytes))], x.shape, w, None, args, "fp32")


def test_gathered_rejects_parts_that_do_not_make_the_input() -> None:
    args = normalize_args(2, 1, 0, 1, 1)
    x = torch.randn(3, 8, 5, 5)
    w = torch.randn(8, 4, 4, 4, device="cuda")
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="CUDA weights"):
        conv_transpose2d_gathered([x], x.shape, w.cpu(), None, args, "fp32")
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="hold"):
        conv_transpose2d_gathered([x[:2]], x.shape, w, None, args, "fp32")
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="hold"):
        conv_transpose2d_gathered([x, b"\0" * 4], x.shape, w, None, args, "fp32")
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="contiguous CPU tensor"):
        conv_transpose2d_gathered([x.transpose(2, 3)], x.shape, w, None, args, "fp32")
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="contiguous CPU tensor"):
        conv_transpose2d_gathered([x.cuda()], x.shape, w, None, args, "fp32")
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="contiguous CPU tensor"):
        conv_transpose2d_gathered([x.double()[:, :4]], x.shape, w, None, args, "fp32")
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="C-contiguous"):
        conv_transpose2d_gathered([memoryview(x.numpy()[:, :, :, ::2])], x.shape, w, None, args, "fp32")
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="N >= 1"):
        conv_transpose2d_gathered([], (0, 8, 5, 5), w, None, args, "fp32")
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="channels"):
        conv_transpose2d_gathered([torch.randn(3, 7, 5, 5)], (3, 7, 5, 5), w, None, args, "fp32")
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="bias"):
        conv_transpose2d_gathered([x], x.shape, w, torch.zeros(5, device="cuda"), args, "fp32")


def test_gathered_out_of_memory_raises_and_the_next_call_works() -> None:
    """Out of memory while the GIL is released: torch's OutOfMemoryError, as for the staged call."""
    args = normalize_args(2, 1, 0, 1, 1)
    x = torch.randn(64, 64, 64, 64)  # 64 MiB; the output is 256 MiB
    w = torch.randn(64, 64, 4, 4, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (128 << 20)) / total)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            conv_transpose2d_gathered([x], x.shape, w, None, args, "fp32")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    y = conv_transpose2d_gathered([x[:1], x[1:2]], (2, 64, 64, 64), w, None, args, "fp32")
    assert rel_err(y.cuda(), reference(x[:2].cuda(), w, None, stride=2, padding=1)) <= 1e-5


@pytest.mark.parametrize("route", ["narrow_tiled", "narrow", "simt"])
def test_64bit_indexing(route: str) -> None:
    """An output of more than 2**31 elements: check rows at the very end against the reference.

    C_out = 4 runs the tiled narrow kernel by default; the per-pixel narrow and the SIMT kernels are forced to keep
    their 64-bit offsets covered.
    """
    free, _ = torch.cuda.mem_get_info()
    if free < 24 * 2**30:
        pytest.skip("needs about 24 GiB of free GPU memory")
    g = torch.Generator(device="cuda").manual_seed(9)
    # y: [2, 4, 16402, 16402] bf16 = 2.15e9 elements (> 2**31)
    x = torch.randn(2, 2, 16400, 16400, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(2, 4, 3, 3, device="cuda", dtype=torch.bfloat16, generator=g)
    y, path = forward_cuda(x, w, None, normalize_args(), "fp32", force_path=None if route == "narrow_tiled" else route)
    assert path == route
    assert y.numel() > 2**31
    # With k = 3 and stride 1, the last 14 output rows depend on the last 14 input rows only.
    ref_tail = reference(x[:, :, -14:], w, None)[:, :, -14:]
    assert rel_err(y[:, :, -14:], ref_tail) <= 2e-2
    ref_head = reference(x[:, :, :14], w, None)[:, :, :12]
    assert rel_err(y[:, :, :12], ref_head) <= 2e-2


def _kernelbench_problems() -> list[dict]:
    return json.loads(BENCH.read_text())["problems"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tf32", "fp32", "bf16"])
@pytest.mark.parametrize("prob", _kernelbench_problems(), ids=lambda p: str(p["id"]))
def test_kernelbench_full_size(prob: dict, mode: str) -> None:
    dtype, precision, tol = MODES[mode]
    g = torch.Generator(device="cuda").manual_seed(prob["id"])
    x = torch.rand(prob["batch"], prob["in_channels"], prob["height"], prob["width"], device="cuda",
                   generator=g).to(dtype)
    torch.manual_seed(prob["id"])  # the layer's initialisation too: the result must not depend on test order
    m = nn.ConvTranspose2d(prob["in_channels"], prob["out_channels"], tuple(prob["kernel_size"]),
                           tuple(prob["stride"]), tuple(prob["padding"]), tuple(prob["output_padding"]),
                           prob["groups"], prob["bias"], tuple(prob["dilation"])).cuda().to(dtype)
    ref = reference(x, m.weight, m.bias, stride=m.stride, padding=m.padding, output_padding=m.output_padding,
                    groups=m.groups, dilation=m.dilation)
    kernels.convert(m, precision=precision)
    with torch.no_grad():
        y = m(x)
    assert rel_err(y, ref) <= tol
