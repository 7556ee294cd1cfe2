"""GPU correctness of the fused taps kernel (kernels/csrc/conv_transpose2d_taps_fused.cu) against float64: layers with
few output channels, every (output channel, tap) a column of a tile's GEMM and the taps summed in shared memory.
Exact fp32 (3xTF32), TF32, bfloat16 and float16; x, w and y in either layout as they are.

Fresh random inputs, poisoned outputs, norm-wise relative error as in test_cuda.py. The parameters that change its
indexing: the tile's width (8, 16 or 32 positions, chosen from the image's shape and the halo), halos of 0 to 4
positions (a stride above the kernel, stride 1, k9 s2), outputs cropped by padding and extended by output
padding, unequal kernels and strides, input channels that leave a partial stage (1, 20, 56) or take several (64,
128), column chunks of whole output channels (one chunk of 96 or 81 columns, 17 channels in 3 chunks, 7 in 2 of
unequal size), one output channel, images and tiles enough for the grid to loop; x and the weights in both
layouts, `out` (also one element into its storage) or a new output, bias or none. Then the fallbacks, the default
choice for small layers and the kernels a steady call launches.
"""

from __future__ import annotations

import pytest
import torch

from kernels.internal import forward_cuda, normalize_args
from tests.kernels.launches import kernels_launched
from tests.kernels.test_cuda import MODES, reference
from tests.kernels.test_cuda_fold import check_forced, forced_cases
from tests.kernels.test_cuda_fold import run as run_problem
from tests.numerics import rel_err

pytestmark = pytest.mark.cuda

needs_sm80 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                                reason="the fused taps kernel runs on sm_80 and newer")

# k and s: kernel and stride, an int or (h, w); p: padding; op: output padding.
PROBLEMS = {
    "rgb": dict(n=2, c_in=32, c_out=3, h=13, w=11, k=4, s=2, p=1),                    # pix2pix's RGB layer: 48 columns
    "rgb_deep": dict(n=1, c_in=128, c_out=3, h=20, w=18, k=4, s=2, p=1),              # 4 stages
    "one_k9_s3": dict(n=2, c_in=56, c_out=1, h=19, w=20, k=9, s=3, p=4, op=2),        # FSRCNN x3: 81 columns, halo 2
    "one_k9_s2": dict(n=1, c_in=56, c_out=1, h=21, w=17, k=9, s=2, p=4, op=1),        # FSRCNN x2: halo 4
    "keypoints": dict(n=3, c_in=64, c_out=17, h=7, w=7, k=4, s=2, p=1),               # 3 chunks: 6, 6, 5 channels
    "two_chunks": dict(n=2, c_in=20, c_out=7, h=9, w=12, k=(3, 5), s=(2, 3), p=(1, 2), op=(1, 0)),  # 4 + 3 channels
    "k96": dict(n=1, c_in=24, c_out=1, h=10, w=9, k=(8, 12), s=4, p=(2, 5)),          # 96 columns
    "s1": dict(n=2, c_in=12, c_out=5, h=18, w=11, k=3, s=1, p=1),                     # halo 2 on a dense stride
    "stride_gt_kernel": dict(n=2, c_in=8, c_out=3, h=6, w=7, k=2, s=3),              # halo 0, outputs with no tap
    "crop": dict(n=2, c_in=16, c_out=4, h=6, w=6, k=4, s=2, p=3, bias=False),
    "one_channel_in": dict(n=2, c_in=1, c_out=2, h=9, w=9, k=4, s=2, p=1),
    "tall": dict(n=1, c_in=16, c_out=3, h=70, w=4, k=4, s=2, p=1),                    # 8-position tiles
    "wide": dict(n=1, c_in=16, c_out=3, h=2, w=100, k=4, s=2, p=1),                   # 32-position tiles
    "wide_56": dict(n=1, c_in=16, c_out=1, h=3, w=60, k=(2, 28), s=(2, 14)),          # 32 wide, 56 columns
    "many_tiles": dict(n=4, c_in=40, c_out=3, h=45, w=39, k=4, s=2, p=1, op=1),
}


def run(problem: dict, mode: str, **kw: object) -> tuple[float, float, str, torch.Tensor]:
    """test_cuda_fold.py's run with the fused taps kernel forced."""
    return run_problem(problem, mode, force_path="taps_fused", **kw)


@needs_sm80
@forced_cases(PROBLEMS, ["fp32", "tf32", "bf16", "fp16"])
def test_taps_fused_forced(problem: str, mode: str, x_layout: str, w_layout: str, new_output: bool) -> None:
    check_forced(PROBLEMS[problem], mode, "taps_fused", x_layout=x_layout, w_layout=w_layout, new_output=new_output)


@needs_sm80
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("problem", ["rgb", "one_k9_s3", "keypoints"])
def test_taps_fused_writes_an_output_one_element_into_its_storage(problem: str, mode: str) -> None:
    err, tol, path, y = run(PROBLEMS[problem], mode, out_offset=1)
    assert path == "taps_fused"
    assert not torch.isnan(y).any()
    assert err <= tol, f"{problem}/{mode}: rel err {err:.3e} > {tol:.0e}"


@needs_sm80
def test_taps_fused_fallbacks() -> None:
    """Forced where it cannot run, another family runs: float64, groups, dilation, more than 96 taps."""
    err, tol, path, _ = run(PROBLEMS["rgb"], "fp64")
    assert path != "taps_fused"
    assert err <= tol
    err, tol, path, _ = run(dict(n=2, c_in=32, c_out=6, h=7, w=9, k=3, s=2, p=1, g=2), "fp32")
    assert path != "taps_fused"
    assert err <= tol
    x = torch.randn(2, 16, 8, 8, device="cuda")
    w = torch.randn(16, 3, 3, 3, device="cuda")
    y, path = forward_cuda(x, w, None, normalize_args(2, 1, 0, 1, 2), "fp32", force_path="taps_fused")
    assert path != "taps_fused"
    assert rel_err(y, reference(x, w, None, stride=2, padding=1, dilation=2)) <= MODES["fp32"][2]
    w = torch.randn(16, 1, 10, 10, device="cuda")
    y, path = forward_cuda(x, w, None, normalize_args(5, 0, 0, 1, 1), "fp32", force_path="taps_fused")
    assert path != "taps_fused"
    assert rel_err(y, reference(x, w, None, stride=5)) <= MODES["fp32"][2]


@needs_sm80
@pytest.mark.parametrize("x_layout", ["nchw", "cl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_steady_call_launches_only_the_fused_taps_kernel(dtype: torch.dtype, x_layout: str) -> None:
    x = torch.randn(2, 64, 24, 20, device="cuda").to(dtype)
    if x_layout == "cl":
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(64, 3, 4, 4, device="cuda").to(dtype)
    b = torch.randn(3, device="cuda").to(dtype)
    args = normalize_args(2, 1, 0, 1, 1)
    mode = "tf32" if dtype == torch.float32 else "fp32"
    outputs: list[torch.Tensor] = []
    with torch.no_grad():
        launched = kernels_launched(
            lambda: outputs.append(forward_cuda(x, w, b, args, mode, force_path="taps_fused")[0]))
    assert len(launched) == 1, launched
    assert "conv_transpose2d_taps_fused_kernel" in launched[0], launched
    y = outputs[-1]
    assert y.is_contiguous(memory_format=torch.channels_last if x_layout == "cl" else torch.contiguous_format)
    assert rel_err(y, reference(x, w, b, stride=2, padding=1)) <= MODES["tf32" if dtype == torch.float32 else "bf16"][2]


@needs_sm80
@pytest.mark.parametrize("x_layout", ["nchw", "cl"])
@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16"])
def test_taps_fused_is_the_default_for_small_layers_of_many_input_channels(mode: str, x_layout: str) -> None:
    """The rule (taps_fused_preferred): at most 8 output channels, one group, at least 32 input channels, below the
    tiled narrow kernel's 2^17 output pixels (where the per-pixel narrow kernel ran): one kernel a call, in either
    layout. With 16 input channels, with two groups, or from 2^17 output pixels, not."""
    one = dict(n=1, c_in=56, c_out=1, h=64, w=64, k=9, s=3, p=4, op=2)  # fsrcnn-x3 on one 64 x 64 frame
    err, tol, path, _ = run_problem(one, mode, x_layout=x_layout, new_output=True, force_path=None)
    assert path == "taps_fused"
    assert err <= tol
    rgb = dict(n=2, c_in=32, c_out=3, h=32, w=32, k=4, s=2, p=1)  # 2 x 64 x 64 output pixels
    assert run_problem(rgb, mode, x_layout=x_layout, force_path=None)[2] == "taps_fused"
    for other in ({**rgb, "c_in": 16}, {**rgb, "c_out": 4, "g": 2}, {**rgb, "n": 32}):
        err, tol, path, _ = run_problem(other, mode, x_layout=x_layout, force_path=None)
        assert path != "taps_fused", other
        assert err <= tol
    dtype = MODES[mode][0]
    x = torch.randn(1, 56, 64, 64, device="cuda").to(dtype)
    if x_layout == "cl":
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(56, 1, 9, 9, device="cuda").to(dtype)
    args = normalize_args(3, 4, 2, 1, 1)
    with torch.no_grad():
        launched = kernels_launched(lambda: forward_cuda(x, w, None, args, "tf32" if mode == "tf32" else "fp32"))
    assert len(launched) == 1, launched
    assert "conv_transpose2d_taps_fused_kernel" in launched[0], launched
