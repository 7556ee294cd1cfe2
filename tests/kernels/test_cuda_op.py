"""The call on the GPU as a model runs it: repeats through the extension's call cache, weights prepared once per
weight version, the registered operator under torch.compile, torch.export and CUDA graphs, and the kernels a
steady-state call launches. Every output is checked against a float64 reference on fresh random inputs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.internal import load_extension
from kernels.tuning import TUNER
from tests.kernels.launches import kernels_launched
from tests.numerics import rel_err

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU (run with -m cuda on the device machine)", allow_module_level=True)

SM90 = torch.cuda.get_device_capability() == (9, 0)
TOL = {torch.float32: 2e-3, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, **kw: object) -> torch.Tensor:
    return F.conv_transpose2d(x.double(), w.double(), None if b is None else b.double(), **kw)


def problem(dtype: torch.dtype, cl: bool, seed: int = 0, n: int = 4, c_in: int = 64, c_out: int = 32,
            k: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, c_in, 8, 8, device="cuda", generator=g).to(dtype)
    w = (torch.randn(c_in, c_out, k, k, device="cuda", generator=g) / (c_in * k * k) ** 0.5).to(dtype)
    b = torch.randn(c_out, device="cuda", generator=g).to(dtype)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
        w = w.contiguous(memory_format=torch.channels_last)
    return x, w, b


@pytest.fixture(autouse=True)
def ext():
    was = TUNER.enabled
    TUNER.enabled = False
    ext = load_extension()
    ext.clear_call_cache()
    yield ext
    TUNER.enabled = was
    ext.clear_call_cache()
    kernels.refresh_weights()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cl", [False, True])
def test_a_repeat_runs_from_the_call_cache_with_the_same_result(ext, dtype: torch.dtype, cl: bool) -> None:
    x, w, b = problem(dtype, cl)
    ref = reference(x, w, b, stride=2, padding=1)
    first = kernels.conv_transpose2d(x, w, b, 2, 1)
    assert ext.call_cache_size() == 1
    assert ext.fast_forward(x, w, b, 2, 1, 0, 1, 1, None) is not None  # the repeat is taken by the cache
    repeat = kernels.conv_transpose2d(x, w, b, 2, 1)
    assert ext.call_cache_size() == 1
    assert torch.equal(first, repeat)
    assert rel_err(repeat, ref) < TOL[dtype]
    want_cl = cl  # PyTorch's layout: channels-last when the input or the weight is
    assert repeat.is_contiguous(memory_format=torch.channels_last if want_cl else torch.contiguous_format)
    # Another shape is another problem; another input of the same problem is read, not remembered.
    x2, _, _ = problem(dtype, cl, seed=1)
    assert rel_err(kernels.conv_transpose2d(x2, w, b, 2, 1), reference(x2, w, b, stride=2, padding=1)) < TOL[dtype]
    kernels.conv_transpose2d(x[:2], w, b, 2, 1)
    assert ext.call_cache_size() == 2


def test_the_call_cache_declines_what_it_must_not_take(ext) -> None:
    x, w, b = problem(torch.bfloat16, True)
    kernels.conv_transpose2d(x, w, b, 2, 1)
    assert ext.fast_forward(x, w, b, 2, 1, 0, 1, 1, None) is not None
    assert ext.fast_forward(x, w, b, 2.0, 1, 0, 1, 1, None) is None  # a float stride: PyTorch's error, not ours
    assert ext.fast_forward(x, w, b, [2, 2], 1, 0, 1, 1, None) is None
    assert ext.fast_forward(x, w, b, 2, 1, 0, 1, 1, "tf33") is None
    assert ext.fast_forward(x, w, None, 2, 1, 0, 1, 1, None) is None  # not remembered without bias
    assert ext.fast_forward(x.requires_grad_(), w, b, 2, 1, 0, 1, 1, None) is None  # needs autograd
    x.requires_grad_(False)
    with torch.autocast("cuda", dtype=torch.float16):
        assert ext.fast_forward(x, w, b, 2, 1, 0, 1, 1, None) is None
    with pytest.raises(kernels.ConvTranspose2dArgumentError, match="stride"):
        kernels.conv_transpose2d(x, w, b, 2.0, 1)
    TUNER.enabled = True  # the choice changes: the remembered calls are forgotten
    assert ext.call_cache_size() == 0


def test_weights_are_prepared_once_and_follow_every_tracked_change(ext) -> None:
    torch.manual_seed(0)
    m = kernels.ConvTranspose2d(64, 32, 4, stride=2, padding=1, device="cuda").eval()  # TF32: packed weights
    x = torch.randn(4, 64, 8, 8, device="cuda")

    def check() -> None:
        with torch.no_grad():
            y = m(x)
        assert rel_err(y, reference(x, m.weight, m.bias, stride=2, padding=1)) < TOL[torch.float32]

    with torch.no_grad():
        for _ in range(3):
            check()
    prepared = ext.prepared_count()
    assert prepared >= 1
    with torch.no_grad():
        m.weight.mul_(-2.0)  # in place: the version counter
    check()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    m.train()
    m(x).square().mean().backward()
    opt.step()
    m.eval()
    check()
    other = nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1).cuda()
    m.load_state_dict(other.state_dict())
    check()
    m.weight.data = torch.randn_like(m.weight)  # new memory
    check()
    m.to(memory_format=torch.channels_last)  # new strides
    check()
    assert ext.prepared_count() <= prepared + 1  # replaced, not piled up
    # A write PyTorch does not track (.data has a version counter of its own): refresh_weights makes it seen.
    m.weight.data.mul_(3.0)
    assert kernels.refresh_weights(m) >= 1
    check()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_manual_cuda_graph_capture_replays_the_current_weights(ext, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    m = kernels.ConvTranspose2d(64, 32, 4, stride=2, padding=1, device="cuda", dtype=dtype).eval()
    static_x = torch.randn(4, 64, 8, 8, device="cuda", dtype=dtype)
    TUNER.enabled = True  # measured choice on: it must not measure inside the capture
    tuned = len(TUNER)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.stream(stream), torch.cuda.graph(graph):
        static_y = m(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    assert len(TUNER) == tuned  # nothing was measured while capturing
    assert ext.call_cache_size() == 0  # nor was the default remembered in place of a measured choice
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        static_x.copy_(torch.randn(static_x.shape, device="cuda", generator=g))
        if seed == 2:
            with torch.no_grad():
                m.weight.mul_(0.5)  # replays read the weights as they are now
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(static_y, reference(static_x, m.weight, m.bias, stride=2, padding=1)) < TOL[dtype]
    with torch.no_grad():
        m(static_x)  # the first call outside a capture measures
    assert len(TUNER) == tuned + 1


OP = torch.ops.deconv.conv_transpose2d.default


def _python_frames_of_kernels(fn) -> list[str]:
    """The functions of this project's kernels package that run while ``fn`` runs (Python's profiling hook)."""
    seen: list[str] = []

    package = str(Path(kernels.__file__).parent) + "/"

    def hook(frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(package):
            seen.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cl", [False, True])
def test_the_operator_runs_a_remembered_problem_without_entering_python(ext, dtype: torch.dtype, cl: bool) -> None:
    """The extension's CUDA kernels of the operator: the first call of a problem goes to Python's kernel (choice,
    checks) and is remembered; a repeat, as a compiled model makes it, stays in C++ and computes the same."""
    x, w, b = problem(dtype, cl)
    args = (x, w, b, [2, 2], [1, 1], [0, 0], 1, [1, 1], None, True)
    with torch.no_grad():
        first = _python_frames_of_kernels(lambda: OP(*args))
        assert any("conv_transpose2d_op" in f for f in first), first
        assert ext.call_cache_size() == 1
        ys: list[torch.Tensor] = []
        assert _python_frames_of_kernels(lambda: ys.append(OP(*args))) == []
    assert rel_err(ys[0], reference(x, w, b, stride=2, padding=1)) < TOL[dtype]
    assert ys[0].is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
    # What the cache cannot take still goes to Python's kernel, which checks it.
    with pytest.raises(Exception, match="precision"):
        OP(x, w, b, [2, 2], [1, 1], [0, 0], 1, [1, 1], "tf33", True)


@pytest.mark.parametrize("with_bias", [True, False])
def test_gradients_through_the_operator_on_cuda_are_pytorchs(ext, with_bias: bool) -> None:
    """The extension's autograd kernel of the operator: exact fp32 forward, and the gradients of PyTorch's own
    convolution_backward, checked against float64."""
    x, w, b = problem(torch.float32, False, c_in=16, c_out=8)
    b = b if with_bias else None
    leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if b is not None else ())]
    y = kernels.conv_transpose2d(*leaves[:2], leaves[2] if with_bias else None, 2, 1, precision="fp32")
    assert "ConvTranspose2dFunction" in y.grad_fn.name()  # the extension's autograd node
    g = torch.randn_like(y)
    y.backward(g)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = F.conv_transpose2d(ref_leaves[0], ref_leaves[1], ref_leaves[2] if with_bias else None, 2, 1)
    ref.backward(g.double())
    assert rel_err(y, ref) < 1e-5
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert rel_err(got.grad, want.grad) < 1e-5


@pytest.mark.skipif(not SM90, reason="the gemm kernel runs on sm_90 (H100/H200) only")
def test_a_compiled_inference_model_packs_its_weights_once(ext) -> None:
    """Under torch.compile without grad mode, a model whose parameters require gradients (as they do after
    model.eval()) uses the weights' prepared copies: a steady-state pass launches no packing kernel."""
    model = _decoder(torch.bfloat16, True).to(memory_format=torch.channels_last)
    x = torch.randn(8, 256, 8, 8, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        launched = kernels_launched(lambda: compiled(x))
    ours = [k for k in launched if "deconv::" in k]
    assert sum("conv_transpose2d_gemm_kernel" in k for k in ours) >= 2, launched
    assert not any("pack" in k for k in ours), launched


def _decoder(dtype: torch.dtype, ours: bool) -> nn.Module:
    torch.manual_seed(2)
    model = nn.Sequential(
        nn.ConvTranspose2d(256, 128, 4, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(128, 64, 4, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(64, 3, 4, stride=2, padding=1), nn.Tanh(),
    ).cuda().to(dtype).eval()
    return kernels.convert(model) if ours else model


@pytest.mark.slow
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_model_matches_eager_and_the_reference(ext, mode: str | None) -> None:
    dtype = torch.bfloat16
    ours = _decoder(dtype, True)
    compiled = torch.compile(ours, fullgraph=True, mode=mode)
    cudnn = _decoder(dtype, False)
    ref_model = _decoder(torch.float64, False)
    with torch.no_grad():
        for seed in range(4):
            g = torch.Generator(device="cuda").manual_seed(seed)
            x = torch.randn(8, 256, 8, 8, device="cuda", generator=g).to(dtype)
            y = compiled(x).clone()
            ref = ref_model(x.double())
            # Three bf16 layers round their activations three times: no closer to float64 than cuDNN's model.
            assert rel_err(y, ref) <= max(TOL[dtype], 1.5 * rel_err(cudnn(x), ref))
            assert rel_err(y, ours(x).double()) < 1e-2  # the compiled graph computes what eager does


def test_export_runs_our_operator_on_the_gpu(ext) -> None:
    model = _decoder(torch.float32, True)
    x = torch.randn(2, 256, 8, 8, device="cuda")
    program = torch.export.export(model, (x,))
    assert sum("deconv.conv_transpose2d" in str(n.target) for n in program.graph.nodes) == 3
    with torch.no_grad():
        assert rel_err(program.module()(x), _decoder(torch.float64, False)(x.double())) < TOL[torch.float32]


@pytest.mark.skipif(not SM90, reason="the gemm kernel runs on sm_90 (H100/H200) only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_steady_channels_last_call_launches_only_the_gemm_kernel(ext, dtype: torch.dtype) -> None:
    x, w, b = problem(dtype, True, n=8, c_in=256, c_out=128)
    with torch.no_grad():
        launched = kernels_launched(lambda: kernels.conv_transpose2d(x, w, b, 2, 1))
    gemm = [k for k in launched if "gemm_reduce" not in k]  # a split-K reduction may follow where chosen
    assert len(gemm) == 1, launched
    assert "conv_transpose2d_gemm_kernel" in gemm[0], launched
