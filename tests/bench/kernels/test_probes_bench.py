"""The design probes' CPU-checkable parts: the column-folded view of a layer (``probes nchw``) is the layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.kernels.probes import fold_columns, unfold_columns
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
