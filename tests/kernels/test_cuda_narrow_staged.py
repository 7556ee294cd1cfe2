"""GPU tests of the tiled narrow kernel's staged form (configuration 2, conv_transpose2d_narrow.cu) through every
layout a caller may hand it: the kernel reads x and the weights in either layout as they are and writes y in x's
layout (NCHW into `out`), so its forced cases take both layouts of x and of the weights and `out` or a new output,
and y must come back in x's layout, from one kernel. With one output channel a group two warps take each phase,
alternate channels each (odd channel counts, stages of one channel, phases without taps below). A channels-last x
is fetched 4 channels of a position a vector where its groups' channels are whole aligned vectors (here: the 8- and
16-channel problems, and 16 bits too), element by element elsewhere (19 and 12 channels, an unaligned x). Then the
default choice. test_cuda.py forces every configuration on NCHW tensors (test_narrow_tiled_forced)."""

from __future__ import annotations

import pytest
import torch

from kernels.internal import forward_cuda, normalize_args
from tests.kernels.launches import kernels_launched
from tests.kernels.test_cuda import MODES, reference
from tests.kernels.test_cuda_fold import check_forced, forced_cases
from tests.numerics import rel_err

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
    # One output channel: two warps a phase, alternate channels each, their sums added at the end. 13 channels:
    # stages of 4, the last of one (the second warps take none there); 4 phases of 3 x 3 taps.
    "one_k6s2_odd": dict(n=2, c_in=13, c_out=1, h=19, w=37, k=6, s=2, p=2),
    # Depthwise (one channel a group): stages of one channel, so the second warps of every phase take nothing.
    "depthwise_k3s2": dict(n=2, c_in=6, c_out=6, h=18, w=21, k=3, s=2, p=1, op=1, g=6),
    # 9 phases of which those past the 2-tap kernel have no taps (their warps write the bias), 5 channels.
    "one_k2s3": dict(n=1, c_in=5, c_out=1, h=23, w=30, k=2, s=3),
}


@forced_cases(PROBLEMS, ["fp32", "tf32", "bf16", "fp16"])
def test_staged_forced_in_every_layout(problem: str, mode: str, x_layout: str, w_layout: str,
                                       new_output: bool) -> None:
    check_forced(PROBLEMS[problem], mode, "narrow_tiled", x_layout=x_layout, w_layout=w_layout,
                 new_output=new_output, config=2)


@pytest.mark.parametrize("x_layout", ["nchw", "cl"])
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_a_steady_call_launches_only_the_staged_kernel(mode: str, x_layout: str) -> None:
    """x and the weights in either layout, read as they are: one kernel a call, no layout change, y in x's layout."""
    dtype = MODES[mode][0]
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(2, 16, 20, 24, device="cuda", generator=g).to(dtype)
    w = torch.randn(16, 3, 9, 9, device="cuda", generator=g).to(dtype)
    b = torch.randn(3, device="cuda", generator=g).to(dtype)
    if x_layout == "cl":
        x = x.contiguous(memory_format=torch.channels_last)
        w = w.contiguous(memory_format=torch.channels_last)
    args = normalize_args(stride=3, padding=4, output_padding=2)
    outputs: list[torch.Tensor] = []
    with torch.no_grad():
        launched = kernels_launched(lambda: outputs.append(
            forward_cuda(x, w, b, args, "fp32", force_path="narrow_tiled", force_config=2)[0]))
    assert len(launched) == 1, launched
    assert "narrow_staged_kernel" in launched[0], launched
    y = outputs[-1]
    assert y.is_contiguous(memory_format=torch.channels_last if x_layout == "cl" else torch.contiguous_format)
    ref = reference(x, w, b, stride=args.stride, padding=args.padding, output_padding=args.output_padding)
    assert rel_err(y, ref) <= MODES[mode][2]


@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_an_unaligned_channels_last_x_is_read_element_by_element(mode: str) -> None:
    """A channels-last x one element into its storage: its 4-channel vectors are not aligned, so the kernel fetches
    element by element, and still reads it as it is."""
    dtype = MODES[mode][0]
    g = torch.Generator(device="cuda").manual_seed(12)
    n, c, h, w_ = 2, 8, 21, 40
    storage = torch.randn(n * c * h * w_ + 1, device="cuda", generator=g).to(dtype)
    x = storage[1:].view(n, h, w_, c).permute(0, 3, 1, 2)  # channels-last, 1 element off
    assert x.is_contiguous(memory_format=torch.channels_last)
    assert x.data_ptr() % 8 != 0
    w = torch.randn(c, 1, 9, 9, device="cuda", generator=g).to(dtype)
    args = normalize_args(stride=3, padding=4, output_padding=2)
    y, path = forward_cuda(x, w, None, args, "fp32", force_path="narrow_tiled", force_config=2)
    assert path == "narrow_tiled"
    ref = reference(x, w, None, stride=args.stride, padding=args.padding, output_padding=args.output_padding)
    assert rel_err(y, ref) <= MODES[mode][2]


@pytest.mark.parametrize("x_layout", ["nchw", "cl"])
def test_the_staged_form_is_the_default_where_its_regions_fill_the_sms(x_layout: str) -> None:
    """An fsrcnn-x3-like layer (48 -> 1, k9 s3: 9 phases of 3 x 3 taps, 8 regions an image) with as many images as
    make one wave of regions (one block an SM) runs the staged form alone in exact fp32, in either layout of x (it
    reads a channels-last one as it is, so the taps path no longer goes first); with TF32 products a channels-last x
    stays on the taps path (tensor cores). With two more images (a second wave nearly idle) it is not the choice."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(13)
    w = torch.randn(48, 1, 9, 9, device="cuda", generator=g)
    b = torch.randn(1, device="cuda", generator=g)
    args = normalize_args(stride=3, padding=4, output_padding=2)
    for n, staged in ((sms // 8, True), (sms // 8 + 2, False)):
        x = torch.randn(n, 48, 64, 64, device="cuda", generator=g)
        if x_layout == "cl":
            x = x.contiguous(memory_format=torch.channels_last)
        ref = reference(x, w, b, stride=args.stride, padding=args.padding, output_padding=args.output_padding)
        results: list[tuple[torch.Tensor, str]] = []
        with torch.no_grad():
            launched = kernels_launched(lambda x=x, out=results: out.append(forward_cuda(x, w, b, args, "fp32")))
        y, path = results[-1]
        assert rel_err(y, ref) <= MODES["fp32"][2]
        names = [name for name in launched if "narrow_staged_kernel" in name]
        if staged:
            assert path == "narrow_tiled"
            assert names == launched, launched
            assert len(launched) == 1, launched
            y, path = forward_cuda(x, w, b, args, "tf32")
            assert path == ("taps" if x_layout == "cl" else "narrow_tiled")
            assert rel_err(y, ref) <= MODES["tf32"][2]
        else:
            assert not names, launched
