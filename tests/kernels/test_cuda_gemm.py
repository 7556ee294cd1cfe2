"""GPU correctness of the gemm path against float64: its wgmma kernel (kernels/csrc/conv_transpose2d_gemm.cu,
configurations 0-2 and 5-12, 9-12 in pairs of blocks; exact fp32 as 3xTF32 on 0, 2, 5, 8 and 9; split-K in a
cluster on 0-2, 5 and 6) and its mma.sync kernel (conv_transpose2d_gemm_sync.cu, 3-4), both forced on sm_90.

Fresh random inputs, poisoned outputs, norm-wise relative error as in test_cuda.py; both input layouts (the kernel
reads channels-last, an NCHW input is converted first) and both output layouts, every tile configuration and
split-K factor, and the parameters that change its indexing: strides with phases that have no tap, dilation,
padding, output_padding, groups, channel counts that leave partial stages and partial tiles, inputs one position
high or wide (tiled with a stride of their own: one tap a phase), 16-bit groups of at most 32 input channels (two
taps a stage).
"""

from __future__ import annotations

import re
import zlib

import pytest
import torch

import kernels
from kernels.internal import forward_cuda, load_extension, normalize_args, output_size
from tests.kernels.launches import kernels_launched
from tests.kernels.test_cuda import MODES, reference, round_tf32
from tests.numerics import rel_err

pytestmark = pytest.mark.cuda

NUM_GEMM_CONFIGS = 13
SYNC_CONFIGS = (3, 4)


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="the gemm kernel runs on sm_90 (H100/H200) only")

# Channel counts: fp32 stages are 32 channels, 16-bit ones 64; the rows are 16-byte vectors (fp32 C_in % 4, 16-bit
# C_in % 8 per group).
PROBLEMS = {
    "k2s2": dict(n=3, c_in=64, c_out=96, h=7, w=5, k=2, stride=2),
    "k4s2p1": dict(n=2, c_in=128, c_out=64, h=4, w=6, k=4, stride=2, padding=1),
    "k3s2_op1": dict(n=2, c_in=40, c_out=72, h=9, w=7, k=3, stride=2, padding=1, output_padding=1),
    "stride1_k3": dict(n=2, c_in=72, c_out=136, h=6, w=5, k=3, padding=1),
    "stride3_k2": dict(n=2, c_in=32, c_out=40, h=5, w=4, k=2, stride=3),  # phases with no tap: bias only
    "dilation": dict(n=1, c_in=48, c_out=33, h=7, w=9, k=3, stride=2, dilation=2, padding=2),
    "asym": dict(n=2, c_in=64, c_out=80, h=5, w=11, k=(2, 5), stride=(2, 3), padding=(0, 2)),
    "groups": dict(n=2, c_in=96, c_out=48, h=6, w=6, k=4, stride=2, padding=1, groups=3),
    "groups_wide": dict(n=2, c_in=128, c_out=48, h=5, w=6, k=3, stride=2, padding=1, groups=2),  # 64 in a group
    # 18 output channels a group: 16-bit channels-last outputs stored as pairs, not as quads of four channels.
    "groups_pairs": dict(n=2, c_in=64, c_out=36, h=5, w=7, k=3, stride=2, padding=1, groups=2),
    "one_pixel": dict(n=5, c_in=64, c_out=128, h=1, w=1, k=4),
    # One position high and wide with stride, padding, dilation and output_padding (tiled with stride 5, rows
    # that only the bias reaches), and one position high only.
    "one_pixel_s2": dict(n=3, c_in=64, c_out=72, h=1, w=1, k=3, stride=2, padding=1, output_padding=1, dilation=2),
    "one_row": dict(n=2, c_in=64, c_out=48, h=1, w=5, k=4, stride=2, padding=1),
    # Rows of input channels that are not whole 16-byte vectors, padded by the binding: 37 channels in every dtype,
    # and a DCGAN latent layer's 100 in 16 bits.
    "padded_rows": dict(n=2, c_in=37, c_out=40, h=5, w=6, k=3, stride=2, padding=1),
    "padded_1x1": dict(n=6, c_in=100, c_out=128, h=1, w=1, k=4),
    "many_rows": dict(n=3, c_in=16, c_out=257, h=23, w=19, k=2, stride=2, bias=False),
    # At most 32 16-bit input channels a group: two taps a stage (and one in a phase's last stage when its taps are
    # odd: 9 and 21 here), also with x's rows padded (20 channels, a pitch of 24).
    "two_taps_k3": dict(n=2, c_in=32, c_out=40, h=9, w=11, k=3, padding=1),
    "two_taps_3x7": dict(n=2, c_in=16, c_out=24, h=6, w=13, k=(3, 7), padding=(1, 3)),
    "two_taps_padded": dict(n=2, c_in=20, c_out=32, h=5, w=6, k=4, stride=2, padding=1),
}


def run(problem: dict, mode: str, *, layout: str, config: int | None = None, split: int | None = None,
        seed: int = 0, tf32_reference: bool = False, force: bool = True, staged: bool | None = None,
        weight_layout: str = "nchw", weight_offset: int = 0,
        rounded: bool | None = None) -> tuple[float, float, str, torch.Tensor]:
    """Run one problem into a poisoned output; returns (rel_err, tol, path, y). ``layout``: "nchw" (into an NCHW
    ``out``), "nchw_new" (NCHW input, a new output) or "cl" (channels-last input, a new output); ``weight_layout``:
    "nchw" or "cl" (channels-last weights, as ``model.to(memory_format=torch.channels_last)`` makes them);
    ``weight_offset``: the weights start this many elements into their storage (an odd one: an odd address);
    ``rounded``: force_round (TF32: x rounded before the kernel, or by it)."""
    p = dict(problem)
    n, c_in, c_out, h, w = p.pop("n"), p.pop("c_in"), p.pop("c_out"), p.pop("h"), p.pop("w")
    k = p.pop("k")
    kh, kw = (k, k) if isinstance(k, int) else k
    bias = p.pop("bias", True)
    args = normalize_args(p.get("stride", 1), p.get("padding", 0), p.get("output_padding", 0), p.get("groups", 1),
                          p.get("dilation", 1))
    dtype, precision, tol = MODES[mode]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, c_in, h, w, device="cuda", generator=g).to(dtype)
    wt = torch.randn(c_in, c_out // args.groups, kh, kw, device="cuda", generator=g).to(dtype)
    b = torch.randn(c_out, device="cuda", generator=g).to(dtype) if bias else None
    if weight_layout == "cl":
        wt = wt.contiguous(memory_format=torch.channels_last)
    if weight_offset:
        wt = torch.empty(wt.numel() + weight_offset, device="cuda", dtype=dtype)[weight_offset:].view_as(wt).copy_(wt)
    ho = output_size(h, kh, args.stride[0], args.padding[0], args.output_padding[0], args.dilation[0])
    wo = output_size(w, kw, args.stride[1], args.padding[1], args.output_padding[1], args.dilation[1])
    out = None
    if layout == "nchw":
        out = torch.full((n, c_out, ho, wo), float("nan"), device="cuda", dtype=dtype)
    else:
        if layout == "cl":
            x = x.contiguous(memory_format=torch.channels_last)
        # Poison the memory the new output will take: the caching allocator hands the freed block out again.
        torch.full((n * c_out * ho * wo,), float("nan"), device="cuda", dtype=dtype)
    kw_force = dict(force_path="gemm", force_config=config, force_split=split, force_staged=staged,
                    force_round=rounded) if force else {}
    y, path = forward_cuda(x, wt, b, args, precision or "fp32", out=out, **kw_force)
    if tf32_reference:
        x, wt = round_tf32(x), round_tf32(wt)
    ref = reference(x, wt, b, stride=args.stride, padding=args.padding, output_padding=args.output_padding,
                    groups=args.groups, dilation=args.dilation)
    assert y.shape == ref.shape
    return rel_err(y, ref), tol, path, y


@needs_sm90
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("mode", ["tf32", "bf16", "fp16", "fp32"])
@pytest.mark.parametrize("config", range(NUM_GEMM_CONFIGS))
@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_gemm_forced(problem: str, config: int, mode: str, layout: str) -> None:
    err, tol, path, y = run(PROBLEMS[problem], mode, layout=layout, config=config, split=1,
                            seed=zlib.crc32(problem.encode()) + config)
    assert path == "gemm"
    one_pixel = PROBLEMS[problem]["h"] == PROBLEMS[problem]["w"] == 1
    if layout == "cl" and not one_pixel:  # a one-pixel input is NCHW-contiguous too: PyTorch keeps NCHW
        assert y.is_contiguous(memory_format=torch.channels_last)
        assert not y.is_contiguous()
    assert err <= tol, f"{problem}/gemm{config}/{mode}/{layout}: rel err {err:.3e} > {tol:.0e}"


@needs_sm90
@pytest.mark.parametrize("mode", ["tf32", "bf16", "fp16", "fp32"])
@pytest.mark.parametrize("problem", ["k4s2p1", "dilation", "groups"])
def test_gemm_packs_weights_at_an_odd_address(problem: str, mode: str) -> None:
    # The packing kernel reads two neighbouring weights a load only from an even address and rows of even length
    # (dilation: 33 x 9 a row); one element into the storage it must read them one by one.
    err, tol, path, _ = run(PROBLEMS[problem], mode, layout="cl", config=0, split=1, weight_offset=1)
    assert path == "gemm"
    assert err < tol, f"{problem} {mode}: rel err {err:.3e} >= {tol:.1e}"


@needs_sm90
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("mode", ["tf32", "bf16", "fp16", "fp32"])
@pytest.mark.parametrize("config", range(NUM_GEMM_CONFIGS))
@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_gemm_channels_last_weights(problem: str, config: int, mode: str, layout: str) -> None:
    """Channels-last weights: 16-bit ones read as they are (B N-major, boxes of 64 output channels, those wholly
    past C_out / groups not brought) where their rows allow it (C_out / groups % 8 == 0, a group's C_in in whole
    stages of 64: k2s2, k4s2p1, asym, one_pixel, groups_wide), the others (TF32; 33 or 257 output channels; 16, 32,
    40 or 72 input channels a group) packed from that layout; split-K too."""
    for split in (1, 3):
        err, tol, path, _ = run(PROBLEMS[problem], mode, layout=layout, config=config, split=split,
                                seed=zlib.crc32(problem.encode()) + 7 * config + split, weight_layout="cl")
        assert path == "gemm"
        assert err <= tol, f"{problem}/gemm{config}/{mode}/{layout}/split {split}: rel err {err:.3e} > {tol:.0e}"


@needs_sm90
@pytest.mark.parametrize("mode", ["bf16", "fp16", "tf32"])
def test_gemm_reads_channels_last_16bit_weights_without_packing(mode: str) -> None:
    """A channels-last 16-bit call allocates only its output: no scratch for packed weights (an NCHW weight, or
    TF32, takes one more allocation: the packed copy; so does the mma.sync kernel, which reads K-major weights)."""
    dtype, precision, tol = MODES[mode]
    x = torch.randn(4, 128, 6, 6, device="cuda").to(dtype).contiguous(memory_format=torch.channels_last)
    w = torch.randn(128, 64, 4, 4, device="cuda").to(dtype)
    args = normalize_args(2, 1, 0, 1, 1)

    def allocations(weight: torch.Tensor, config: int | None = None) -> int:
        kw = dict(force_path="gemm", force_config=config, force_split=1)
        forward_cuda(x, weight, None, args, precision or "fp32", **kw)  # first-call work
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        y, path = forward_cuda(x, weight, None, args, precision or "fp32", **kw)
        allocated = torch.cuda.memory_stats()["allocation.all.allocated"] - before
        assert path == "gemm"
        assert rel_err(y, reference(x, weight, None, stride=2, padding=1)) <= tol
        return allocated

    assert allocations(w) == 2  # the output and the packed weights
    assert allocations(w.contiguous(memory_format=torch.channels_last)) == (2 if mode == "tf32" else 1)
    for config in SYNC_CONFIGS:
        assert allocations(w.contiguous(memory_format=torch.channels_last), config) == 2


@needs_sm90
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("split", [2, 3, 16])
@pytest.mark.parametrize("mode", ["tf32", "bf16", "fp32"])
@pytest.mark.parametrize("config", [0, 3])
@pytest.mark.parametrize("problem", ["k4s2p1", "stride3_k2", "groups", "one_pixel"])
def test_gemm_split(problem: str, config: int, mode: str, split: int, layout: str) -> None:
    """Split-K: blocks over parts of K (some with none, at 16) into fp32 partials, summed with the bias."""
    err, tol, path, _ = run(PROBLEMS[problem], mode, layout=layout, config=config, split=split,
                            seed=zlib.crc32(problem.encode()) + split)
    assert path == "gemm"
    assert err <= tol, f"{problem}/split {split}/{mode}/{layout}: rel err {err:.3e} > {tol:.0e}"


# Split-K in a cluster (gemm_cluster_k): the configurations whose blocks run alone and share each tile between their
# two multiplier warpgroups, a tile's splits one cluster of blocks (at most 8); the rest, and more splits, go
# through fp32 partials.
CLUSTER_K_CONFIGS = (0, 1, 2, 5, 6)
CLUSTER_K_PROBLEMS = {
    # 32-96 tiles: with 2 splits a cluster may run two tiles (the hand-over's barriers through several phases), with
    # 8 splits (16 clusters at once on an H100 or H200) the configurations of 32 tiles (1, 6) do and the others sum
    # fp32 partials.
    "tiles": dict(n=4, c_in=128, c_out=136, h=16, w=16, k=4, stride=2, padding=1),
    # One M box a phase, one channel tile: 4 tiles of 16 (bf16) or 32 (TF32) stages.
    "few_tiles": dict(n=1, c_in=256, c_out=64, h=4, w=4, k=4, stride=2, padding=1),
    # Phases of 1, 2, 2 and 4 taps: with 5 splits some blocks have no stage of K at all.
    "k3s2_op1": PROBLEMS["k3s2_op1"],
    "stride3_k2": PROBLEMS["stride3_k2"],  # phases with no tap: bias only
    "groups": PROBLEMS["groups"],
}


@needs_sm90
@pytest.mark.parametrize("weights", ["nchw", "cl"])
@pytest.mark.parametrize("split", [2, 5, 8])
@pytest.mark.parametrize("mode", ["tf32", "bf16", "fp16"])
@pytest.mark.parametrize("config", CLUSTER_K_CONFIGS)
@pytest.mark.parametrize("problem", list(CLUSTER_K_PROBLEMS))
def test_gemm_split_in_a_cluster(problem: str, config: int, mode: str, split: int, weights: str) -> None:
    """A tile's splits as one cluster, the first block adding the others' sums from their shared memory: right
    against float64, with channels-last weights read as they are too."""
    err, tol, path, _ = run(CLUSTER_K_PROBLEMS[problem], mode, layout="cl", config=config, split=split,
                            seed=zlib.crc32(problem.encode()) + 13 * split + config, weight_layout=weights)
    assert path == "gemm"
    assert err <= tol, f"{problem}/gemm{config}/{mode}/{weights}/s{split}: rel err {err:.3e} > {tol:.0e}"


@needs_sm90
@pytest.mark.parametrize("mode", ["tf32", "bf16", "fp32"])
def test_gemm_split_in_a_cluster_needs_no_second_kernel(mode: str) -> None:
    """Splits of 2 to 8 of a few tiles on a cluster configuration run one gemm kernel; 16 splits, exact fp32
    (3xTF32) and the configurations by turns (7) or in pairs (9) sum fp32 partials in a second kernel."""
    q = CLUSTER_K_PROBLEMS["few_tiles"]
    dtype, precision, _ = MODES[mode]
    x = torch.randn(q["n"], q["c_in"], q["h"], q["w"], device="cuda").to(dtype).contiguous(
        memory_format=torch.channels_last)
    w = torch.randn(q["c_in"], q["c_out"], q["k"], q["k"], device="cuda").to(dtype)
    args = normalize_args(2, 1, 0, 1, 1)

    def kernels_of(config: int, split: int) -> list[str]:
        """The gemm kernels and split-K sums (not the weight packing) a call launches."""
        launched = kernels_launched(lambda: forward_cuda(x, w, None, args, precision or "fp32", force_path="gemm",
                                                         force_config=config, force_split=split))
        return [n for n in launched if "gemm_kernel" in n or "gemm_reduce" in n]

    def reduced(names: list[str]) -> bool:
        return any("gemm_reduce" in n for n in names)

    for config in CLUSTER_K_CONFIGS if mode != "fp32" else ():
        for split in (2, 8):
            names = kernels_of(config, split)
            assert len(names) == 1, (config, split, names)
            assert not reduced(names), (config, split, names)
        assert reduced(kernels_of(config, 16)), config
    for config in ((7, 9) if mode != "fp32" else (0, 2, 5)):
        assert reduced(kernels_of(config, 2)), config
    assert len(kernels_of(0 if mode != "fp32" else 2, 1)) == 1


@needs_sm90
@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("layout", ["nchw", "nchw_new"])
@pytest.mark.parametrize("mode", ["tf32", "bf16", "fp16", "fp32"])
@pytest.mark.parametrize("problem", ["k2s2", "stride1_k3", "asym", "groups", "one_pixel", "many_rows"])
def test_gemm_nchw_output_staged_or_straight(problem: str, mode: str, layout: str, staged: bool) -> None:
    """An NCHW output written channels-last into scratch and converted, or stored straight: the same numbers, into
    a given ``out`` or a new NCHW tensor, with split-K too."""
    for split in (1, 3):
        err, tol, path, y = run(PROBLEMS[problem], mode, layout=layout, config=1, split=split, staged=staged,
                                seed=zlib.crc32(problem.encode()) + split)
        assert path == "gemm"
        assert y.is_contiguous()
        assert err <= tol, f"{problem}/{mode}/{layout}/staged={staged}/split {split}: rel err {err:.3e} > {tol:.0e}"


# Exact fp32 at stride 1 with an NCHW output stored straight: the exact kernel stores it by bulk tensor copies of
# 64-row chunks (kTmaY) where the M box allows (W_out % 4 == 0, one group, no split). 11 x 44 outputs take boxes of
# 16 x 4 x 2 (or x 4) positions, partial on both axes; 33 images of 2 x 4 boxes of 4 x 2 x 16 (or 32), KernelBench
# 69's kind, partial in images; 72 and 40 output channels leave partial chunks of channels.
TMA_Y_PROBLEMS = {
    "s1_edges": dict(n=4, c_in=40, c_out=72, h=9, w=42, k=3),
    "s1_images": dict(n=33, c_in=24, c_out=40, h=2, w=3, k=(1, 2)),
}


def _bulk_stored(name: str) -> bool:
    """Whether a gemm kernel's profiled name is an instance whose last template argument (kTmaY) is true."""
    m = re.search(r"conv_transpose2d_gemm_kernel<(.*?)>\(", name)
    return m is not None and m.group(1).split(",")[-1].strip() == "true"


@needs_sm90
@pytest.mark.parametrize("layout", ["nchw", "nchw_new"])
@pytest.mark.parametrize("config", [0, 2, 5, 8])
@pytest.mark.parametrize("problem", list(TMA_Y_PROBLEMS))
def test_gemm_exact_nchw_output_by_bulk_stores(problem: str, config: int, layout: str) -> None:
    err, tol, path, y = run(TMA_Y_PROBLEMS[problem], "fp32", layout=layout, config=config, split=1, staged=False,
                            seed=zlib.crc32(problem.encode()) + config)
    assert path == "gemm"
    assert y.is_contiguous()
    assert err <= tol, f"{problem}/gemm{config}/{layout}: rel err {err:.3e} > {tol:.0e}"


@needs_sm90
@pytest.mark.parametrize("problem", list(TMA_Y_PROBLEMS))
def test_gemm_exact_nchw_output_takes_bulk_stores(problem: str) -> None:
    """The bulk-stored epilogue runs where gemm_tma_y allows it, and not for a channels-last output, a staged one or
    a split."""
    p = dict(TMA_Y_PROBLEMS[problem])
    n, c_in, c_out, h, w, k = p["n"], p["c_in"], p["c_out"], p["h"], p["w"], p["k"]
    kh, kw = (k, k) if isinstance(k, int) else k
    x = torch.randn(n, c_in, h, w, device="cuda")
    wt = torch.randn(c_in, c_out, kh, kw, device="cuda")
    args = normalize_args(1, 0, 0, 1, 1)

    def gemm_names(xx: torch.Tensor, **force: object) -> list[str]:
        names = kernels_launched(lambda: forward_cuda(xx, wt, None, args, "fp32", force_path="gemm", force_config=0,
                                                      **force))
        return [name for name in names if "conv_transpose2d_gemm_kernel" in name]

    assert any(_bulk_stored(name) for name in gemm_names(x, force_split=1, force_staged=False))
    assert not any(_bulk_stored(name) for name in gemm_names(x, force_split=1, force_staged=True))
    assert not any(_bulk_stored(name) for name in gemm_names(x, force_split=2, force_staged=False))
    xcl = x.contiguous(memory_format=torch.channels_last)
    assert not any(_bulk_stored(name) for name in gemm_names(xcl, force_split=1))


# Layout changes by vectors (kernels/csrc/layout.cu's transpose_batched_vec): x's channels and positions, and y's,
# multiples of 8, of 4 and of 2 elements (8- and 4-byte vectors of 16-bit values, which never move in 16-byte ones;
# 16 and 8 bytes of fp32), with partial 64 x 64 tiles on both sides.
VECTOR_LAYOUT_PROBLEMS = {
    "vec8": dict(n=3, c_in=72, c_out=80, h=8, w=12, k=2, stride=2),  # x 72 x 96, y 384 x 80
    "vec4": dict(n=2, c_in=68, c_out=76, h=9, w=4, k=2, stride=2),  # x 68 x 36, y 144 x 76
    "vec2": dict(n=2, c_in=66, c_out=70, h=9, w=6, k=3, stride=2, padding=1, output_padding=1),  # x 66 x 54, y 216 x 70
    # Channel planes of 33 KB in 16 bits: y goes back to NCHW in tiles of 128 positions, the last one 4 positions.
    "vec4_wide": dict(n=1, c_in=64, c_out=80, h=65, w=65, k=2, stride=2),  # y 16900 x 80
    "vec2_wide": dict(n=1, c_in=32, c_out=70, h=65, w=65, k=2, stride=2),  # y 16900 x 70
}


@needs_sm90
@pytest.mark.parametrize("rounded", [None, True])
@pytest.mark.parametrize("layout", ["nchw", "nchw_new"])
@pytest.mark.parametrize("mode", ["tf32", "bf16", "fp16"])
@pytest.mark.parametrize("problem", list(VECTOR_LAYOUT_PROBLEMS))
def test_gemm_nchw_layout_changes_by_vectors(problem: str, mode: str, layout: str, rounded: bool | None) -> None:
    """x changed to channels-last (TF32: rounded on the way too) and y staged and changed back, by the vector
    kernel: every element in its place."""
    if rounded and mode != "tf32":
        pytest.skip("rounding before the kernel is TF32's")
    err, tol, path, y = run(VECTOR_LAYOUT_PROBLEMS[problem], mode, layout=layout, config=1, staged=True,
                            rounded=rounded, seed=zlib.crc32(problem.encode()))
    assert path == "gemm"
    assert y.is_contiguous()
    assert err <= tol, f"{problem}/{mode}/{layout}/rounded={rounded}: rel err {err:.3e} > {tol:.0e}"


# Few input channels: the layout change of an NCHW x moves them a position a thread (4 and 8 channels) instead of in
# tiles, and rounds them on the way too.
ROUNDING_PROBLEMS = {**{k: PROBLEMS[k] for k in ("k4s2p1", "k3s2_op1", "groups")},
                     "few_in4": dict(n=2, c_in=4, c_out=40, h=5, w=6, k=3, stride=2, padding=1),
                     "few_in8": dict(n=3, c_in=8, c_out=24, h=4, w=7, k=4, stride=2, padding=1)}


@needs_sm90
@pytest.mark.parametrize("rounded", [None, False, True])
@pytest.mark.parametrize("layout", ["nchw", "nchw_new", "cl"])
@pytest.mark.parametrize("config", range(NUM_GEMM_CONFIGS))
@pytest.mark.parametrize("problem", list(ROUNDING_PROBLEMS))
def test_gemm_tf32_rounds_operands_to_nearest(problem: str, config: int, layout: str, rounded: bool | None) -> None:
    """Against a reference from TF32-rounded operands only the accumulation's error is left (the tensor cores would
    truncate unrounded fp32 operands: ~3e-4), wherever x is rounded: by the kernel as each stage lands, by the layout
    change of an NCHW x (its default), by a pass of its own over a channels-last x; split-K too."""
    for split in (1, 2):
        err, _, path, _ = run(ROUNDING_PROBLEMS[problem], "tf32", layout=layout, config=config, split=split,
                              seed=zlib.crc32(problem.encode()), tf32_reference=True, rounded=rounded)
        assert path == "gemm"
        assert err <= 3e-5, (f"{problem}/gemm{config}/{layout}/s{split}/rounded={rounded}: rel err {err:.3e} "
                             "against TF32-rounded operands")


@needs_sm90
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("config", range(NUM_GEMM_CONFIGS))
@pytest.mark.parametrize("problem", list(ROUNDING_PROBLEMS))
def test_gemm_tf32_rounding_before_or_in_the_kernel_gives_the_same_bits(problem: str, config: int,
                                                                        layout: str) -> None:
    """Rounding is idempotent and the products run in the same order: x rounded before the kernel and x rounded
    by it give bit-identical outputs."""
    for split in (1, 3):
        ys = [run(ROUNDING_PROBLEMS[problem], "tf32", layout=layout, config=config, split=split,
                  seed=zlib.crc32(problem.encode()), rounded=r)[3] for r in (False, True, None)]
        assert torch.equal(ys[0], ys[1]), f"{problem}/gemm{config}/{layout}/s{split}: rounded before the kernel"
        assert torch.equal(ys[0], ys[2]), f"{problem}/gemm{config}/{layout}/s{split}: the default"


@needs_sm90
def test_gemm_default_choice_and_fallbacks() -> None:
    """Channel-heavy layers run the gemm kernel by default in both layouts, exact fp32 too (3xTF32); float64 and
    16-bit rows that are not 16-byte vectors (C_in 100 in bf16) run another kernel even when it is asked for,
    correctly."""
    heavy = dict(n=4, c_in=256, c_out=128, h=8, w=8, k=4, stride=2, padding=1)
    for mode in ("tf32", "bf16", "fp16", "fp32"):
        for layout in ("nchw", "cl"):
            err, tol, path, _ = run(heavy, mode, layout=layout, force=False)
            assert path == "gemm", (mode, layout)
            assert err <= tol
    err, tol, path, _ = run(heavy, "fp64", layout="cl")
    assert path != "gemm"
    assert err <= tol
    odd = dict(n=2, c_in=100, c_out=64, h=4, w=4, k=4, stride=2, padding=1)
    err, tol, path, _ = run(odd, "bf16", layout="cl", force=False)  # not channel-heavy: another kernel
    assert path != "gemm"
    assert err <= tol
    err, tol, path, _ = run(odd, "bf16", layout="cl")  # asked for: x's rows padded to 104 channels
    assert path == "gemm"
    assert err <= tol
    err, tol, path, _ = run(dict(odd, groups=2), "bf16", layout="cl")  # 50 a group: no padding with groups
    assert path != "gemm"
    assert err <= tol
    # A 1 x 1 input runs the gemm path by default, its 100 16-bit channels padded.
    for mode in ("bf16", "tf32"):
        err, tol, path, _ = run(PROBLEMS["padded_1x1"], mode, layout="nchw_new", force=False)
        assert path == "gemm", mode
        assert err <= tol, mode
    # The library call returns the input's layout whichever kernel ran.
    x = torch.randn(2, 100, 4, 4, device="cuda").to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(100, 64, 4, 4, device="cuda").to(torch.bfloat16)
    assert kernels.conv_transpose2d(x, w, None, 2, 1).is_contiguous(memory_format=torch.channels_last)


@needs_sm90
def test_gemm_is_deterministic_and_split_agrees() -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2, 512, 4, 4, device="cuda", generator=g).to(torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    w = torch.randn(512, 256, 4, 4, device="cuda", generator=g).to(torch.bfloat16)
    args = normalize_args(2, 1, 0, 1, 1)
    runs = [forward_cuda(x, w, None, args, "fp32", force_path="gemm", force_split=4)[0] for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    whole = forward_cuda(x, w, None, args, "fp32", force_path="gemm", force_split=1)[0]
    ref = reference(x, w, None, stride=2, padding=1)
    assert rel_err(runs[0], ref) <= 2e-2
    assert rel_err(whole, ref) <= 2e-2


# Exact fp32's configurations (gemm_exact_fits): the others run the default one of these when forced.
EXACT_CONFIGS = (0, 2, 5, 8, 9)
DEEP = dict(n=1, c_in=1024, c_out=72, h=8, w=40, k=3, padding=1)  # K = 9216: 288 stages


@needs_sm90
@pytest.mark.parametrize("split", [1, 8])
@pytest.mark.parametrize("config", EXACT_CONFIGS)
def test_gemm_exact_fp32_error_does_not_grow_with_k(config: int, split: int) -> None:
    """3xTF32 sums each stage apart before adding it in fp32: on a 9216-deep reduction the error stays at cuDNN's
    exact fp32 order (one accumulator for all of K, truncating, measured 6e-5 on the tensor-core kernels), within
    three times what PyTorch's own fp32 (TF32 off) gives on the same inputs (0.5-2.4x on the zoo and KernelBench,
    bench/NOTES.md v30)."""
    err, tol, path, y = run(DEEP, "fp32", layout="cl", config=config, split=split, seed=11)
    assert path == "gemm"
    assert err <= tol, f"deep/gemm{config}/s{split}: rel err {err:.3e} > {tol:.0e}"
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(1, 1024, 8, 40, device="cuda", generator=g).contiguous(memory_format=torch.channels_last)
    w = torch.randn(1024, 72, 3, 3, device="cuda", generator=g)
    b = torch.randn(72, device="cuda", generator=g)
    was = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        theirs = torch.nn.functional.conv_transpose2d(x, w, b, padding=1)
    finally:
        torch.backends.cudnn.allow_tf32 = was
    ref = reference(x, w, b, padding=1)  # run()'s inputs: the same seed draws them in the same order
    ratio = rel_err(y, ref) / rel_err(theirs, ref)
    assert ratio <= 3, f"gemm{config}/s{split}: rel err {err:.3e}, {ratio:.1f}x PyTorch's exact fp32"


# The configurations that run in pairs of blocks (thread-block clusters sharing each B stage) and the configuration
# each pairs: the same tiles, products in the same order.
PAIRS = {9: 5, 10: 6, 11: 7, 12: 1}
# Many M boxes, odd and even counts of them a phase (a pair's second block may have no box), every stride phase
# with taps; and one image whose M boxes are fewer than the pairs' blocks.
PAIR_PROBLEMS = {
    "boxes_odd": dict(n=3, c_in=64, c_out=136, h=21, w=19, k=4, stride=2, padding=1),
    "boxes_even": dict(n=4, c_in=128, c_out=64, h=16, w=16, k=3, stride=1, padding=1),
    "groups": PROBLEMS["groups"],
    "one_image": dict(n=1, c_in=64, c_out=48, h=9, w=7, k=3, stride=2, padding=1, output_padding=1),
    "two_taps": dict(n=3, c_in=32, c_out=64, h=20, w=18, k=3, padding=1),
}


@needs_sm90
@pytest.mark.parametrize("weights", ["nchw", "cl"])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("mode", ["tf32", "bf16", "fp16", "fp32"])
@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("problem", list(PAIR_PROBLEMS))
def test_gemm_pairs_give_the_bits_of_blocks_alone(problem: str, pair: int, mode: str, layout: str,
                                                    weights: str) -> None:
    """A pair of blocks (each bringing half of every B stage into both, multicast) computes what its configuration
    alone computes, bit for bit, split-K too; and it is right against float64. Exact fp32 pairs only where it runs
    (9); 16-bit channels-last weights are read N-major as they are, each block bringing half of a chunk's input
    channels. Pairs stage one tap at a time: against blocks alone that stage two (16-bit groups of at most 32
    input channels) split-K parts cover other taps, so only float64 judges those."""
    if mode == "fp32" and pair not in EXACT_CONFIGS:
        pytest.skip("exact fp32 runs on configurations 0, 2, 5, 8 and 9 only")
    q = PAIR_PROBLEMS[problem]
    two_taps_alone = mode in ("bf16", "fp16") and q["c_in"] // q.get("groups", 1) <= 32
    for split in (1, 3):
        seed = zlib.crc32(problem.encode()) + split
        err, tol, path, y = run(q, mode, layout=layout, config=pair, split=split, seed=seed, weight_layout=weights)
        assert path == "gemm"
        assert err <= tol, f"{problem}/gemm{pair}/{mode}/{layout}/{weights}/s{split}: rel err {err:.3e} > {tol:.0e}"
        if two_taps_alone:
            continue
        alone = run(q, mode, layout=layout, config=PAIRS[pair], split=split, seed=seed, weight_layout=weights)[3]
        assert torch.equal(y, alone), f"{problem}/gemm{pair}/{mode}/{layout}/{weights}/s{split}: differs from alone"


def test_every_gemm_configuration_is_forced_above() -> None:
    assert int(load_extension().num_gemm_configs) == NUM_GEMM_CONFIGS


@needs_sm90
def test_measured_choice_of_a_channels_last_call_is_kept() -> None:
    """A channels-last problem is tuned once and its choice kept under its own key (its calls find it)."""
    from kernels.op import _channels_last, _rows_aligned
    from kernels.tuning import TUNER

    x = torch.randn(4, 128, 6, 6, device="cuda").to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(128, 64, 4, 4, device="cuda").to(torch.bfloat16)
    args = normalize_args(2, 1, 0, 1, 1)
    was = TUNER.enabled
    TUNER.clear()
    kernels.tuning.enable()
    try:
        y1 = kernels.conv_transpose2d(x, w, None, 2, 1)
        assert len(TUNER) == 1
        key = TUNER.key(x.shape, w, False, args, "fp32", _rows_aligned(x, True), False, _channels_last(x))
        assert TUNER.lookup(key) is not None
        y2 = kernels.conv_transpose2d(x, w, None, 2, 1)
        assert len(TUNER) == 1
        assert torch.equal(y1, y2)
    finally:
        kernels.tuning.enable(was)
        TUNER.clear()
