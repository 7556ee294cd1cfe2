"""GPU tests of the tiled narrow kernel's staged form (configuration 2, conv_transpose2d_narrow.cu) through every
layout a caller may hand it: the kernel reads an NCHW x and NCHW weights and writes an NCHW y, and the binding changes
the layouts of the others (as for every narrow kernel), so its forced cases take both layouts of x and of the weights
and `out` or a new output, and y must come back in x's layout. test_cuda.py forces every configuration on NCHW
tensors (test_narrow_tiled_forced)."""

from __future__ import annotations

import pytest

from tests.kernels.test_cuda_fold import check_forced, forced_cases

pytestmark = pytest.mark.cuda

# fold-style problems (s: stride, p: padding, op: output padding, g: groups).
PROBLEMS = {
    # fsrcnn-x3's shape, smaller: 9 phases, 3 x 3 taps; 8 channels fill whole stages of 4.
    "k9s3": dict(n=2, c_in=8, c_out=1, h=21, w=40, k=9, s=3, p=4, op=2),
    # RGB, 4 phases of 2 x 2 taps, 19 channels: stages of 2 channels (4 phases fetch less), the last one partial.
    "rgb_k4s2": dict(n=2, c_in=19, c_out=3, h=18, w=36, k=4, s=2, p=1),
    # 2 output channels (computed as 3), phases of 2 and 1 taps, odd width, 12 channels.
    "cout2_mixed": dict(n=1, c_in=12, c_out=2, h=17, w=35, k=3, s=2, p=1, op=1),
    # groups of 8 -> 4 channels, 6 phases (strides 2 x 3).
    "groups2_s2x3": dict(n=2, c_in=16, c_out=8, h=13, w=24, k=(4, 6), s=(2, 3), p=(1, 2), g=2),
}


@forced_cases(PROBLEMS, ["fp32", "tf32", "bf16", "fp16"])
def test_staged_forced_in_every_layout(problem: str, mode: str, x_layout: str, w_layout: str,
                                       new_output: bool) -> None:
    check_forced(PROBLEMS[problem], mode, "narrow_tiled", x_layout=x_layout, w_layout=w_layout,
                 new_output=new_output, config=2)
