"""The design probes' CPU-checkable parts: the column-folded view of a layer (``probes nchw``) is the layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.kernels.probes import fold_columns, kernel_name, layout_rates, unfold_columns
from kernels.internal import output_size


@pytest.mark.parametrize(("k", "s", "p", "op", "groups"), [
    (4, 2, 1, 0, 1),    # pix2pix / DCGAN: k4 s2 p1
    (3, 2, 1, 1, 1),    # CycleGAN: k3 s2 p1 op1 (a kernel no multiple of the stride: zero taps)
    (2, 2, 0, 0, 1),    # U-Net: kernel = stride
    (5, 3, 2, 2, 2),    # an odd stride, groups
    (16, 8, 4, 0, 1),   # FCN's x8, cropped by padding
])
def test_the_column_folded_view_computes_the_layer(k: int, s: int, p: int, op: int, groups: int) -> None:
    gen = torch.Generator().manual_seed(k * 100 + s * 10 + p)
    n, c_in, c_out, h, w = 2, 4 * groups, 3 * groups, 5, 7
    x = torch.randn(n, c_in, h, w, generator=gen, dtype=torch.float64)
    wt = torch.randn(c_in, c_out // groups, k, k, generator=gen, dtype=torch.float64)
    b = torch.randn(c_out, generator=gen, dtype=torch.float64)
    ref = F.conv_transpose2d(x, wt, b, stride=s, padding=p, output_padding=op, groups=groups)
    # Rows keep the layer's stride, padding and output padding; columns run at stride 1 with no padding.
    yf = F.conv_transpose2d(x, fold_columns(wt, s), b.repeat_interleave(s), stride=(s, 1), padding=(p, 0),
                            output_padding=(op, 0), groups=groups)
    w_out = output_size(w, k, s, p, op, 1)
    y = unfold_columns(yf, s, p, w_out)
    assert y.shape == ref.shape
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)


def test_unfolding_refuses_a_view_short_of_the_output() -> None:
    # k2 s2 with output padding 1: the last column holds only the bias, and the view has no column for it.
    yf = torch.zeros(1, 2 * 3, 4, 5)
    with pytest.raises(ValueError, match="columns end before"):
        unfold_columns(yf, 2, 0, output_size(5, 2, 2, 0, 1, 1))


GEMM_STAGED = [  # a staged gemm call's kernels as the profiler names them, in launch order
    ("void deconv::(anonymous namespace)::transpose_batched_vec<unsigned short, 4, false>(unsigned short const*, "
     "unsigned short*, long, long)", 543.1),
    ("void deconv::(anonymous namespace)::conv_transpose2d_gemm_pack<__nv_bfloat16, 0, (deconv::PackRows)1>("
     "__nv_bfloat16 const*, __nv_bfloat16*, int, int, int, int, bool, long)", 3.5),
    ("void deconv::(anonymous namespace)::conv_transpose2d_gemm_kernel<__nv_bfloat16, (deconv::tc::MmaKind)2, 128, "
     "128, 6, false, false, false, false, false>(deconv::GemmArgs, deconv::GemmTiles, CUtensorMap_st, CUtensorMap_st)",
     2328.6),
    ("void deconv::(anonymous namespace)::transpose_batched_vec<unsigned short, 4, false>(unsigned short const*, "
     "unsigned short*, long, long)", 877.6),
]


def test_kernel_names_come_out_of_the_profilers_signatures() -> None:
    assert [kernel_name(n) for n, _ in GEMM_STAGED] == [
        "transpose_batched_vec", "conv_transpose2d_gemm_pack", "conv_transpose2d_gemm_kernel", "transpose_batched_vec"]
    assert kernel_name("void cudnn::engines_precompiled::scalePackedTensor_kernel<float, float>(long, float)") == \
        "scalePackedTensor_kernel"
    assert kernel_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD"


def test_layout_rates_take_x_then_y_and_not_the_gemm_kernels() -> None:
    gib = 2**30
    got = layout_rates(GEMM_STAGED, gib, gib + 4 * 2**20)
    assert got == {"x_us": 543.1, "x_TBps": round(2 * gib / 543.1 / 1e6, 2), "y_us": 877.6,
                   "y_TBps": round(2 * (gib + 4 * 2**20) / 877.6 / 1e6, 2)}
    with pytest.raises(ValueError, match="layout changes"):
        layout_rates(GEMM_STAGED[1:], gib, gib)  # the pack and gemm kernels are not layout changes
