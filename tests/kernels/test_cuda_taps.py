"""GPU correctness of the taps path (kernels/csrc/conv_transpose2d_taps.cu) against float64: fp32 layers with few
output channels run as the gemm kernel's 1x1 problem with every (output channel, tap) as a column, then the taps'
sum. Exact fp32 (3xTF32) and TF32.

Fresh random inputs, poisoned outputs, norm-wise relative error as in test_cuda.py. The parameters that change its
indexing: kernels that are not a multiple of the stride (phases with fewer taps), a stride larger than the kernel
(outputs no tap reaches: the bias alone), stride 1, unequal kernels and strides, padding that crops and output
padding that extends the output, groups (each group's columns), a one-channel output, columns C_out kH kW of 81,
144 and 272 (partial gemm tiles), images and positions enough for many gemm tiles; x in both layouts (an NCHW x is
changed to channels-last first), the weights in both layouts (the columns' two orders), `out` or a new output,
bias or none, the weights packed once and kept. Then the default choice and the kernels a steady call launches.
"""

from __future__ import annotations

import pytest
import torch

from kernels.internal import forward_cuda, normalize_args
from service.engine.ops import WeightPacks
from tests.kernels.launches import kernels_launched
from tests.kernels.test_cuda import MODES, reference
from tests.kernels.test_cuda_fold import check_forced, forced_cases
from tests.kernels.test_cuda_fold import run as run_problem
from tests.numerics import rel_err

pytestmark = pytest.mark.cuda

needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="exact fp32 on the gemm kernel runs its wgmma tiles: sm_90")

# k and s: kernel and stride, an int or (h, w); p: padding; op: output padding; g: groups.
PROBLEMS = {
    "rgb": dict(n=2, c_in=32, c_out=3, h=13, w=11, k=4, s=2, p=1),                    # pix2pix's RGB layer
    "one_k9_s3": dict(n=2, c_in=56, c_out=1, h=9, w=10, k=9, s=3, p=4, op=2),         # FSRCNN x3: 81 columns
    "keypoints": dict(n=3, c_in=64, c_out=17, h=7, w=7, k=4, s=2, p=1),               # 272 columns
    "k3_s2": dict(n=2, c_in=16, c_out=4, h=10, w=9, k=3, s=2, p=1, op=1),             # phases with fewer taps
    "stride_gt_kernel": dict(n=2, c_in=8, c_out=3, h=6, w=7, k=2, s=3),              # outputs with no tap
    "s1": dict(n=2, c_in=12, c_out=5, h=8, w=9, k=3, s=1, p=1),
    "unequal": dict(n=1, c_in=20, c_out=4, h=9, w=8, k=(3, 5), s=(2, 3), p=(1, 2), op=(1, 0)),
    "crop": dict(n=2, c_in=16, c_out=9, h=6, w=6, k=4, s=2, p=3, bias=False),          # 144 columns
    "groups": dict(n=2, c_in=32, c_out=6, h=7, w=9, k=3, s=2, p=1, op=1, g=2),
    "many_tiles": dict(n=2, c_in=64, c_out=3, h=40, w=36, k=4, s=2, p=1),
}


def run(problem: dict, mode: str, *, x_layout: str = "cl", force: bool = True,
        **kw: object) -> tuple[float, float, str, torch.Tensor]:
    """test_cuda_fold.py's run with the taps path forced (``force``), x channels-last unless asked otherwise."""
    return run_problem(problem, mode, x_layout=x_layout, force_path="taps" if force else None, **kw)


@needs_sm90
@forced_cases(PROBLEMS, ["fp32", "tf32"])
def test_taps_forced(problem: str, mode: str, x_layout: str, w_layout: str, new_output: bool) -> None:
    check_forced(PROBLEMS[problem], mode, "taps", x_layout=x_layout, w_layout=w_layout, new_output=new_output)


@needs_sm90
@pytest.mark.parametrize("mode", ["fp32", "tf32"])
@pytest.mark.parametrize("problem", ["rgb", "keypoints", "groups"])
def test_taps_with_weights_packed_once(problem: str, mode: str) -> None:
    err, tol, path, _ = run(PROBLEMS[problem], mode, packs=True)
    assert path == "taps"
    assert err <= tol


@needs_sm90
def test_taps_fallbacks() -> None:
    """Forced where it cannot run, another family runs: 16-bit values (a 16-bit Z would round each tap's sum),
    float64, dilation, and input channels that do not fill the gemm kernel's 16-byte rows."""
    for mode in ("bf16", "fp64"):
        err, tol, path, _ = run(PROBLEMS["rgb"], mode)
        assert path != "taps"
        assert err <= tol
    x = torch.randn(2, 16, 8, 8, device="cuda")
    w = torch.randn(16, 3, 3, 3, device="cuda")
    y, path = forward_cuda(x, w, None, normalize_args(2, 1, 0, 1, 2), "fp32", force_path="taps")
    assert path != "taps"
    assert rel_err(y, reference(x, w, None, stride=2, padding=1, dilation=2)) <= MODES["fp32"][2]
    x = torch.randn(2, 6, 8, 8, device="cuda")
    w = torch.randn(6, 3, 4, 4, device="cuda")
    assert forward_cuda(x, w, None, normalize_args(2, 1, 0, 1, 1), "fp32", force_path="taps")[1] != "taps"


def _default_path(mode: str, n: int, c_in: int, c_out: int, h: int, w: int, k: int, s: int, p: int,
                  x_layout: str = "cl") -> str:
    err, tol, path, _ = run(dict(n=n, c_in=c_in, c_out=c_out, h=h, w=w, k=k, s=s, p=p), mode, x_layout=x_layout,
                            new_output=True, force=False)
    assert err <= tol
    return path


@needs_sm90
@pytest.mark.parametrize("x_layout", ["nchw", "cl"])
@pytest.mark.parametrize("mode", ["fp32", "tf32"])
def test_taps_is_the_default_for_wide_fp32_layers_with_few_output_channels(mode: str, x_layout: str) -> None:
    """The rule (taps_preferred): at most 32 output and at least 32 input channels, C_out kH kW <= 2 C_in and at
    least 2^14 input positions; with an NCHW x, not where the tiled narrow kernel is preferred (2^17 output pixels
    of at most 8 channels) nor below it, where the fused taps kernel is (test_cuda_taps_fused.py): both read it as
    it is."""
    rgb = dict(n=1, c_in=32, c_out=3, h=128, w=128, k=4, s=2, p=1)  # 2^14 positions, 48 columns, 2^16 pixels
    assert _default_path(mode, **rgb, x_layout=x_layout) == ("taps" if x_layout == "cl" else "taps_fused")
    big = _default_path(mode, **{**rgb, "n": 2}, x_layout=x_layout)  # 2^17 output pixels
    assert big == ("taps" if x_layout == "cl" else "narrow_tiled")
    assert _default_path(mode, **{**rgb, "c_out": 32, "c_in": 256, "h": 64, "w": 256}) == "taps"  # 512 columns
    assert _default_path(mode, **{**rgb, "w": 127}) != "taps"  # fewer positions
    assert _default_path(mode, **{**rgb, "c_in": 24}) != "taps"  # fewer input channels
    assert _default_path(mode, **{**rgb, "c_out": 5}) != "taps"  # 80 columns: Z more than twice x
    assert _default_path(mode, **{**rgb, "c_out": 33, "c_in": 512, "h": 32, "w": 512}) != "taps"
    assert run(PROBLEMS["rgb"] | dict(h=128, w=128), "bf16", force=False)[2] != "taps"


@needs_sm90
def test_a_channels_last_tf32_input_asked_to_be_rounded_first_stays_on_the_taps_path() -> None:
    """force_round asks for a rounding pass over a channels-last TF32 x bound for the gemm kernel; the taps path's
    rule tells an NCHW x by the copy it is planned with, so it skips that pass and keeps its plan (a layer where,
    with an NCHW x, the tiled narrow kernel would run)."""
    x = torch.randn(2, 32, 128, 128, device="cuda").contiguous(memory_format=torch.channels_last)
    w = torch.randn(32, 3, 4, 4, device="cuda")
    args = normalize_args(2, 1, 0, 1, 1)
    y, path = forward_cuda(x, w, None, args, "tf32", force_round=True)
    assert path == "taps"
    assert rel_err(y, reference(x, w, None, stride=2, padding=1)) <= MODES["tf32"][2]


@needs_sm90
@pytest.mark.parametrize("mode", ["fp32", "tf32"])
def test_a_steady_call_launches_the_gemm_kernel_and_the_taps_sum(mode: str) -> None:
    x = torch.randn(2, 64, 24, 20, device="cuda").contiguous(memory_format=torch.channels_last)
    w = torch.randn(64, 3, 4, 4, device="cuda")
    b = torch.randn(3, device="cuda")
    args = normalize_args(2, 1, 0, 1, 1)
    packs = WeightPacks(w)
    outputs: list[torch.Tensor] = []
    with torch.no_grad():
        launched = kernels_launched(
            lambda: outputs.append(forward_cuda(x, w, b, args, mode, force_path="taps", packs=packs)[0]))
    assert len(launched) == 2, launched
    assert "gemm" in launched[0], launched
    assert "conv_transpose2d_taps_sum_kernel" in launched[1], launched
    y = outputs[-1]
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert rel_err(y, reference(x, w, b, stride=2, padding=1)) <= MODES[mode][2]
