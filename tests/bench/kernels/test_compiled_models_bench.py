"""bench/kernels/compiled_models.py on the CPU: the two decoders it compiles are the models it says, and without a GPU
it stops with a message rather than a traceback."""

from __future__ import annotations

import pytest
import torch

from bench.kernels import compiled_models as cm


@pytest.mark.parametrize(("name", "out_shape"), [("dcgan", (2, 3, 64, 64)), ("unet", (2, 64, 448, 448))])
def test_the_models_are_the_decoders_named(name: str, out_shape: tuple[int, ...]) -> None:
    model, shape = cm.MODELS[name](2)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.ConvTranspose2d)]
    assert len(convs) == (5 if name == "dcgan" else 4)
    with torch.no_grad():
        assert tuple(model.eval()(torch.randn(shape)).shape) == out_shape


def test_without_a_gpu_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        cm.main(["--models", "dcgan"])
