"""Exporting a layer repository from a PyTorch model: configuration and weights copied exactly."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import kernels
from service.config import Settings
from service.engine.registry import BatchLimits, load_repository
from service.export import ExportError, export_model, load_model, main, parser

from .conftest import NPY, REPO_ROOT, load_npy, npy_bytes, run, serve_app

LIMITS = BatchLimits(64, 1 << 28, 2.0, 256)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Sequential(
            nn.ConvTranspose2d(8, 6, 4, stride=2, padding=1, bias=False),
            nn.ReLU(),
            kernels.ConvTranspose2d(6, 4, (3, 5), stride=(2, 1), padding=(1, 2), output_padding=(1, 0),
                                    groups=2, dilation=(1, 2), precision="fp32"),
        )
        self.head = nn.Conv2d(4, 3, 1)  # not exported

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.up(x))


def test_export_copies_configuration_and_weights_exactly(tmp_path):
    torch.manual_seed(0)
    model = Decoder()
    written = export_model(model, tmp_path, prefix="dec_")
    assert [p.name for p in written] == ["dec_up_0.json", "dec_up_2.json"]
    cfg = json.loads((tmp_path / "dec_up_2.json").read_text())
    assert cfg == {**cfg, "in_channels": 6, "out_channels": 4, "kernel_size": [3, 5], "stride": [2, 1],
                   "padding": [1, 2], "output_padding": [1, 0], "dilation": [1, 2], "groups": 2, "bias": True,
                   "dtype": "float32", "precision": "fp32"}
    assert json.loads((tmp_path / "dec_up_0.json").read_text())["bias"] is False
    w = load_file(str(tmp_path / "dec_up_2.safetensors"))
    assert torch.equal(w["weight"], model.up[2].weight.detach())
    assert torch.equal(w["bias"], model.up[2].bias.detach())
    reg = load_repository(tmp_path, LIMITS)
    assert reg.names() == ["dec_up_0", "dec_up_2"]


def test_served_export_reproduces_the_module(tmp_path):
    torch.manual_seed(1)
    model = Decoder().double()
    export_model(model, tmp_path, names={"up.2": "odd"})
    assert load_repository(tmp_path, LIMITS).names() == ["odd"]
    x = torch.randn(2, 6, 5, 7, dtype=torch.float64)
    with torch.no_grad():
        expected = model.up[2](x)

    async def main_() -> None:
        async with serve_app(Settings(layer_repository=tmp_path, devices="cpu")) as (_, client):
            r = await client.post("/deconv?layer=odd", content=npy_bytes(x.numpy()), headers={"content-type": NPY})
            assert r.status_code == 200, r.text[:300]
            y = load_npy(r.content)
            assert y.dtype == np.float64
            np.testing.assert_allclose(y, expected.numpy(), rtol=1e-12, atol=1e-12)

    run(main_())


def test_export_casts_to_the_asked_dtype(tmp_path):
    layer = nn.ConvTranspose2d(4, 2, 2, stride=2)
    export_model(layer, tmp_path, dtype="bf16", names={"": "up_bf16"})
    cfg = json.loads((tmp_path / "up_bf16.json").read_text())
    assert cfg["dtype"] == "bfloat16"
    assert "precision" not in cfg
    w = load_file(str(tmp_path / "up_bf16.safetensors"))
    assert torch.equal(w["weight"], layer.weight.detach().to(torch.bfloat16))
    assert load_repository(tmp_path, LIMITS).get("up_bf16").config.precision == "bf16"


def test_export_errors(tmp_path):
    with pytest.raises(ExportError, match=r"holds no nn\.ConvTranspose2d"):
        export_model(nn.Linear(2, 2), tmp_path)
    with pytest.raises(ExportError, match=r"no nn\.ConvTranspose2d at module path"):
        export_model(Decoder(), tmp_path, names={"head": "x"})
    with pytest.raises(ExportError, match="is invalid"):
        export_model(Decoder(), tmp_path, names={"up.0": "bad name"})
    with pytest.raises(ExportError, match="written twice"):
        export_model(Decoder(), tmp_path, names={"up.0": "same", "up.2": "same"})
    with pytest.raises(ExportError, match="not servable"):
        export_model(Decoder(), tmp_path, dtype=torch.int8)
    export_model(Decoder(), tmp_path)
    with pytest.raises(ExportError, match="files exist already"):
        export_model(Decoder(), tmp_path)
    export_model(Decoder(), tmp_path, overwrite=True)


@pytest.fixture
def model_module(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "exportable_models.py").write_text(textwrap.dedent("""
        from torch import nn

        def generator(nz=8, ngf=4):
            return nn.Sequential(
                nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.ReLU(),
                nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.ReLU(),
                nn.ConvTranspose2d(ngf, 3, 4, 2, 1), nn.Tanh(),
            )
    """))
    monkeypatch.syspath_prepend(str(pkg))
    return "exportable_models:generator"


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_cli_exports_a_checkpoint(tmp_path, model_module, suffix):
    torch.manual_seed(5)
    trained = load_model(model_module, {"nz": 8, "ngf": 4})
    state = {k: v + 1.0 for k, v in trained.state_dict().items()}  # differs from a fresh init
    ckpt = tmp_path / f"gen{suffix}"
    if suffix == ".pt":
        torch.save({"state_dict": state}, ckpt)
    else:
        save_file(state, str(ckpt))
    out = tmp_path / "repo"
    main([model_module, "--kwargs", '{"nz": 8, "ngf": 4}', "--checkpoint", str(ckpt), "--out", str(out),
          "--prefix", "gen_", "--max-batch-size", "16", "--max-queue-delay-ms", "1.5"])
    reg = load_repository(out, LIMITS)
    assert reg.names() == ["gen_0", "gen_2", "gen_4"]
    assert torch.equal(reg.get("gen_2").weight, state["2.weight"])
    assert torch.equal(reg.get("gen_4").bias, state["4.bias"])
    assert reg.get("gen_0").limits.max_batch_size == 16
    assert reg.get("gen_0").limits.max_queue_delay_ms == 1.5


def test_cli_reports_errors(tmp_path, model_module):
    with pytest.raises(SystemExit, match="export failed"):
        main(["no_colon", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="export failed"):
        main([model_module, "--out", str(tmp_path), "--name", "nope=x"])


# --- the command line itself -------------------------------------------------------------------------------


@pytest.mark.parametrize(("command", "prog"), [(["deconv-export"], "deconv-export"),
                                               ([sys.executable, "-m", "service.export"], "python -m service.export")])
def test_usage_names_the_program_and_every_flag_has_help(command, prog):
    script = Path(sys.executable).parent / command[0]
    if command[0] == "deconv-export":
        if not script.exists():
            pytest.skip("deconv-export is not installed in this environment")
        command = [str(script)]
    result = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {prog} ")
    for action in parser(prog)._actions:
        assert action.help, action.option_strings or action.dest
    for flag in ("--max-batch-size", "--max-batch-bytes", "--max-queue-delay-ms", "--max-queue-size", "--max-height",
                 "--max-width", "--import-path"):
        assert flag in result.stdout
    assert "DECONV_MAX_QUEUE_SIZE" in result.stdout  # the limits say which server default they replace


def test_a_module_that_cannot_be_found_says_how_to_point_at_it(tmp_path, monkeypatch):
    models = tmp_path / "elsewhere"
    models.mkdir()
    (models / "my_model.py").write_text("from torch import nn\n\ndef generator():\n"
                                        "    return nn.Sequential(nn.ConvTranspose2d(4, 2, 3))\n")
    monkeypatch.chdir(tmp_path)  # not where the module is
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() adds --import-path to it
    monkeypatch.setitem(sys.modules, "my_model", None)  # and imports the module: gone again afterwards
    del sys.modules["my_model"]
    with pytest.raises(SystemExit) as err:
        main(["my_model:generator", "--out", str(tmp_path / "out")])
    message = str(err.value)
    assert message.startswith("export failed: cannot import the model's module 'my_model'")
    assert "--import-path DIR" in message
    assert "PYTHONPATH=DIR" in message
    assert str(tmp_path) in message  # where it looked
    main(["my_model:generator", "--out", str(tmp_path / "out"), "--import-path", str(models)])
    assert load_repository(tmp_path / "out", LIMITS).names() == ["0"]


def test_a_module_whose_own_import_fails_says_so(tmp_path, monkeypatch):
    (tmp_path / "broken_model.py").write_text("import no_such_dependency_here\n")
    (tmp_path / "plain_model.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ExportError, match="importing the model's module 'broken_model' failed: No module named "
                                          "'no_such_dependency_here'"):
        load_model("broken_model:generator")
    with pytest.raises(ExportError, match="has no attribute 'generator'"):
        load_model("plain_model:generator")
    with pytest.raises(ExportError, match=re.escape("cannot import the model's module 'plain_model.sub'")):
        load_model("plain_model.sub:generator")
