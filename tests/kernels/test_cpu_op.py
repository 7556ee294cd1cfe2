"""The registered operator ``deconv::conv_transpose2d`` as tracers see it, on CPU: torch.library's own checks,
torch.compile with ``fullgraph=True`` (no graph break), torch.export (strict and not) and dispatch modes.

The GPU side (our kernels under torch.compile, CUDA graphs, measured choice kept out of captures) is in
tests/kernels/test_cuda_op.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.library import opcheck
from torch.utils.flop_counter import FlopCounterMode

import kernels
from kernels.op import OP_NAME

OP = torch.ops.deconv.conv_transpose2d.default


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        kernels.ConvTranspose2d(8, 6, 4, stride=2, padding=1),
        nn.ReLU(),
        kernels.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1, groups=2, bias=False),
    )


def test_the_operator_is_registered_under_its_name() -> None:
    assert OP_NAME == "deconv::conv_transpose2d"
    assert OP.name() == "deconv::conv_transpose2d"


@pytest.mark.parametrize("layout", ["nchw", "channels_last_input", "channels_last_weight"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_opcheck(layout: str, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 5, 4, dtype=torch.float64, generator=g)
    w = torch.randn(6, 2, 3, 3, dtype=torch.float64, generator=g)
    b = torch.randn(6, dtype=torch.float64, generator=g) if with_bias else None
    if layout == "channels_last_input":
        x = x.contiguous(memory_format=torch.channels_last)
    if layout == "channels_last_weight":
        w = w.contiguous(memory_format=torch.channels_last)
    args = (x.requires_grad_(), w.requires_grad_(), None if b is None else b.requires_grad_(), [2, 1], [1, 0],
            [1, 0], 3, [1, 2], None)
    result = opcheck(OP, args)
    assert set(result.values()) == {"SUCCESS"}, result


def test_fake_output_has_the_real_output_strides() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(2, 4, 5, 5).contiguous(memory_format=torch.channels_last)
    w = torch.randn(4, 3, 3, 3)
    real = OP(x, w, None, [2, 2], [1, 1], [0, 0], 1, [1, 1], None)
    with FakeTensorMode() as mode:
        fake = OP(mode.from_tensor(x), mode.from_tensor(w), None, [2, 2], [1, 1], [0, 0], 1, [1, 1], None)
    assert fake.shape == real.shape
    assert fake.stride() == real.stride()


@pytest.mark.slow
def test_compile_fullgraph_traces_the_operator_without_a_graph_break() -> None:
    model = _model()
    x = torch.randn(2, 8, 6, 6)
    want = model(x)
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got = compiled(x)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-6)
    assert sum("deconv.conv_transpose2d" in t for t in seen) == 2, seen


@pytest.mark.slow
def test_compile_fullgraph_trains_like_eager() -> None:
    model = _model()
    ref = _model()
    x = torch.randn(2, 8, 6, 6)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(x).square().sum().backward()
    ref(x).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strict", [True, False])
def test_export_sees_the_operator(strict: bool) -> None:
    model = _model()
    x = torch.randn(2, 8, 6, 6)
    program = torch.export.export(model, (x,), strict=strict)
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count("deconv.conv_transpose2d.default") == 2, targets
    assert torch.allclose(program.module()(x), model(x), atol=1e-6, rtol=1e-6)


def test_a_dispatch_mode_sees_the_operator() -> None:
    """A dispatch mode (here PyTorch's FLOP counter, which knows no rule for our operator) is handed our operator,
    not the convolution inside it."""
    x = torch.randn(2, 8, 6, 6)
    w = torch.randn(8, 6, 4, 4)
    with FlopCounterMode(display=False) as counter:
        y = kernels.conv_transpose2d(x, w, None, 2, 1)
    assert torch.equal(y, F.conv_transpose2d(x, w, None, 2, 1))
    assert counter.get_total_flops() == 0  # the inner aten.convolution was not seen: our operator was
