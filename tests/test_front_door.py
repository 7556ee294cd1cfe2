"""What a new user meets first: the server's address, a wrong layer path, exporting a model from the current
directory, empty bodies, and what the API says about itself."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service.codec import NPY, SAFETENSORS, decode_raw
from service.config import DEFAULT_LAYER_REPOSITORY, Settings
from service.errors import MalformedBodyError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("media", "kind"), [(NPY, ".npy"), (SAFETENSORS, "safetensors")])
def test_an_empty_body_is_called_empty(media: str, kind: str) -> None:
    with pytest.raises(MalformedBodyError, match=f"the request body is empty: send one tensor as {kind}"):
        decode_raw(b"", media)


def test_a_png_sent_as_safetensors_is_not_safetensors() -> None:
    png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(64)
    with pytest.raises(MalformedBodyError, match="body is not safetensors"):
        decode_raw(png, SAFETENSORS)


def test_a_relative_layer_repository_resolves_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert Settings(layer_repository="my_layers").layer_repository == tmp_path / "my_layers"
    assert Settings().layer_repository == DEFAULT_LAYER_REPOSITORY


def test_a_wrong_layer_path_is_one_line_and_status_3(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "DECONV_LAYER_REPOSITORY": "no_such_dir", "DECONV_PORT": "1"}
    proc = subprocess.run([sys.executable, "-m", "service"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3
    assert proc.stderr.strip().splitlines() == [
        f"error: layer repository {tmp_path / 'no_such_dir'} is not a directory "
        f"(DECONV_LAYER_REPOSITORY=no_such_dir, from {tmp_path})"]


def test_an_invalid_layer_stops_the_server_before_it_listens(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{}")
    env = {"PATH": "/usr/bin:/bin", "DECONV_LAYER_REPOSITORY": str(tmp_path), "DECONV_PORT": "1"}
    proc = subprocess.run([sys.executable, "-m", "service"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3
    assert "Traceback" not in proc.stderr
    assert "bad.json: field 'in_channels': Field required" in proc.stderr


def test_export_imports_a_module_from_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.export import main

    (tmp_path / "front_door_model.py").write_text(
        "from torch import nn\n\n\ndef generator():\n"
        "    return nn.Sequential(nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1), nn.ReLU())\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "front_door_model", raising=False)
    main(["front_door_model:generator", "--out", "my_layers", "--prefix", "g_"])
    assert sorted(p.name for p in (tmp_path / "my_layers").iterdir()) == ["g_0.json", "g_0.safetensors"]
    sys.modules.pop("front_door_model", None)


def test_the_api_does_not_claim_cuda_kernels_on_every_machine() -> None:
    from service.http.app import create_app

    description = create_app(Settings(devices="cpu")).openapi()["info"]["description"]
    first = description.split("\n\n", 1)[0]
    assert "on NVIDIA GPUs" in first
    assert "without a GPU runs PyTorch's reference implementation on the CPU" in first


def make_serve(args: list[str], env: dict[str, str], cwd: Path = ROOT) -> str:
    """The command ``make serve`` would run (dry run), with only ``env`` in the environment."""
    out = subprocess.run(["make", "-n", "-C", str(ROOT), "serve", *args], cwd=cwd, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", **env}, check=True).stdout
    return [line for line in out.splitlines() if "deconv-serve" in line][-1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_serve_takes_the_address_from_deconv_settings_port_or_its_command_line(tmp_path: Path) -> None:
    bare = make_serve([], {"PWD": str(ROOT)})
    assert bare.endswith("/.venv/bin/deconv-serve")  # the server's own defaults, or DECONV_HOST / DECONV_PORT
    assert make_serve([], {"DECONV_PORT": "8001", "DECONV_HOST": "0.0.0.0"}) == bare
    assert make_serve([], {"PORT": "7000", "PWD": str(ROOT)}) == bare + " --port 7000"
    assert make_serve([], {"PORT": "7000", "DECONV_PORT": "8001", "PWD": str(ROOT)}) == bare
    assert make_serve([], {"HOST": "somehost", "PWD": str(ROOT)}) == bare  # a shell's HOST is not an address
    cli = make_serve(["HOST=0.0.0.0", "PORT=9"], {"DECONV_PORT": "8001", "PWD": str(ROOT)})
    assert cli == bare + " --host 0.0.0.0 --port 9"
    # The server runs in the caller's directory, so relative DECONV_* paths resolve from there.
    assert make_serve([], {"PWD": str(tmp_path)}, cwd=tmp_path).startswith(f'cd "{tmp_path}" && ')
