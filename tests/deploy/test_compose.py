"""docker-compose.yml: every variant validates (``docker-compose config``), and the rendered configuration has the
GPU reservation, the health check, the volumes and the settings the service reads.

Needs ``docker-compose`` (Debian's package; CI installs it) or ``docker compose``, but no Docker engine; skipped
without either.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.config import Settings
from tests.deploy.conftest import REPO_ROOT, build_args, dockerfile_instructions

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
KERNEL_CACHE = "/opt/deconv/kernel-cache"
HEALTHCHECK = "/opt/deconv/app/deploy/healthcheck.py"
# DECONV_* variables the containers read that are not service Settings fields.
NON_SETTINGS = {"DECONV_KERNEL_CACHE"}  # read by kernels/build.py


def _compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


@pytest.fixture(scope="module")
def compose(tmp_path_factory):
    """``compose(*args, env=...)`` -> CompletedProcess, in a clean environment (only what the test sets)."""
    command = _compose_command()
    if command is None:
        pytest.skip("docker-compose is not installed (CI installs Debian's docker-compose)")
    env_file = tmp_path_factory.mktemp("compose") / "empty.env"
    env_file.write_text("")  # no .env of the machine's

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(env_file.parent)}
        return subprocess.run([*command, "--env-file", str(env_file), "-f", str(COMPOSE_FILE), *args],
                              cwd=REPO_ROOT, env={**base, **(env or {})}, capture_output=True, text=True,
                              timeout=60)

    return run


@pytest.fixture(scope="module")
def rendered(compose):
    """``rendered(profile=None, **env)`` -> the configuration docker-compose resolves (variables, anchors)."""

    def render(profile: str | None = None, **env: str) -> dict[str, Any]:
        args = ["--profile", profile] if profile else []
        result = compose(*args, "config", env=env)
        assert result.returncode == 0, result.stderr
        return yaml.safe_load(result.stdout)

    return render


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _port_bindings(service: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(host ip, published, target) for the short (Compose v1) or long (v2) syntax."""
    out = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            out.append((port.get("host_ip", ""), str(port.get("published")), str(port.get("target"))))
        else:
            m = re.fullmatch(r"(?:([\d.]+):)?(\d+):(\d+)(?:/tcp)?", port)
            assert m, port
            out.append((m.group(1) or "", m.group(2), m.group(3)))
    return out


# --- validation -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("profile", "services"), [(None, {"deconv"}), ("cpu", {"deconv", "deconv-cpu"})])
def test_every_variant_validates(compose, profile, services):
    args = ["--profile", profile] if profile else []
    result = compose(*args, "config", "--quiet")
    assert result.returncode == 0, result.stderr
    listed = compose(*args, "config", "--services")
    assert listed.returncode == 0, listed.stderr
    assert services <= set(listed.stdout.split())


def test_a_broken_file_is_caught(compose, tmp_path):
    # The validation this suite relies on does reject mistakes: a misspelt healthcheck key.
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE_FILE.read_text().replace("start_period:", "start_periode:", 1))
    command = _compose_command()
    assert command is not None
    result = subprocess.run([*command, "-f", str(broken), "config", "--quiet"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"]})
    assert result.returncode != 0
    assert "start_periode" in result.stderr


# --- the GPU server -------------------------------------------------------------------------------------------


def test_gpu_reservation(rendered):
    service = rendered()["services"]["deconv"]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert device["capabilities"] == ["gpu"]
    assert str(device["count"]) in ("all", "-1")
    assert "device_ids" not in device  # Docker refuses count and device_ids together
    assert _environment(service)["DECONV_DEVICES"] == "auto"


def test_gpu_count_and_devices_come_from_the_environment(rendered):
    service = rendered(DECONV_GPU_COUNT="2", DECONV_DEVICES="0,1")["services"]["deconv"]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert str(device["count"]) == "2"
    assert _environment(service)["DECONV_DEVICES"] == "0,1"


def test_healthcheck_restart_and_shutdown(rendered):
    for name, service in rendered("cpu")["services"].items():
        check = service["healthcheck"]
        assert check["test"] == ["CMD", "python", HEALTHCHECK], name
        for key in ("interval", "timeout", "retries", "start_period"):
            assert key in check, (name, key)
        assert service["restart"] == "unless-stopped"
        assert service["init"] is True  # signals reach the server, zombies are reaped
        grace = re.fullmatch(r"(\d+)s", str(service["stop_grace_period"]))
        assert grace, service["stop_grace_period"]
        timeout = float(_environment(service)["DECONV_REQUEST_TIMEOUT_S"])
        assert int(grace.group(1)) > timeout, "a stopping server gets the request timeout to drain"
    assert "/health/ready" in (REPO_ROOT / "deploy" / "healthcheck.py").read_text()


def test_volumes_for_layers_and_kernel_cache(rendered):
    config = rendered()
    service = config["services"]["deconv"]
    env = _environment(service)
    volumes = {v["target"]: v for v in service["volumes"]}
    layers = volumes[env["DECONV_LAYER_REPOSITORY"]]
    assert layers["type"] == "bind"
    assert layers["read_only"] is True
    assert Path(layers["source"]) == REPO_ROOT / "layers"  # the bundled repository by default
    cache = volumes[env["DECONV_KERNEL_CACHE"]]
    assert env["DECONV_KERNEL_CACHE"] == KERNEL_CACHE  # where the image compiled its kernels
    assert cache["type"] == "volume"
    assert cache["source"] in config["volumes"]


def test_layer_repository_from_the_environment(rendered, tmp_path):
    service = rendered(DECONV_LAYERS_DIR=str(tmp_path))["services"]["deconv"]
    sources = {v["target"]: v["source"] for v in service["volumes"]}
    assert sources["/layers"] == str(tmp_path)


def test_ports_and_settings(rendered):
    config = rendered("cpu")
    for name, service in config["services"].items():
        env = _environment(service)
        assert (env["DECONV_HOST"], env["DECONV_PORT"]) == ("0.0.0.0", "8000")
        assert _port_bindings(service) == [("127.0.0.1", "8000", "8000")], name
        # Every DECONV_* the container gets is a setting the service reads (no typos that pass silently).
        for key in env:
            assert key.startswith("DECONV_")
            assert key in NON_SETTINGS or key.removeprefix("DECONV_").lower() in Settings.model_fields, key
        Settings(**{k.removeprefix("DECONV_").lower(): v for k, v in env.items() if k not in NON_SETTINGS})
    published = rendered(DECONV_BIND="0.0.0.0", DECONV_HTTP_PORT="9000")["services"]["deconv"]
    assert _port_bindings(published) == [("0.0.0.0", "9000", "8000")]


def test_build_arguments_are_the_dockerfiles_defaults(rendered):
    defaults = build_args(dockerfile_instructions((REPO_ROOT / "Dockerfile").read_text()))
    args = rendered()["services"]["deconv"]["build"]["args"]
    for name in ("BASE_IMAGE", "TORCH_SPEC", "PIP_ARGS", "CUDA_ARCHS"):
        assert str(args[name]) == defaults[name], name


# --- the CPU variant ------------------------------------------------------------------------------------------


def test_cpu_variant_has_no_gpu_and_no_kernel_cache(rendered):
    service = rendered("cpu")["services"]["deconv-cpu"]
    assert "deploy" not in service
    assert service["profiles"] == ["cpu"]
    assert _environment(service)["DECONV_DEVICES"] == "cpu"
    assert [v["target"] for v in service["volumes"]] == ["/layers"]
    args = service["build"]["args"]
    assert str(args["CUDA_ARCHS"]) == ""  # the Dockerfile then builds no kernels
    assert not str(args["BASE_IMAGE"]).startswith("nvidia/")
    assert str(args["TORCH_SPEC"]).endswith("+cpu")
    assert "whl/cpu" in str(args["PIP_ARGS"])


def test_compose_file_parses_without_docker_compose():
    # Always runs (no docker-compose needed): the anchors resolve and both services are there.
    config = yaml.safe_load(COMPOSE_FILE.read_text())
    assert set(config["services"]) == {"deconv", "deconv-cpu"}
    assert config["services"]["deconv"]["healthcheck"]["test"][-1] == HEALTHCHECK


def test_http_processes_are_sized_from_the_machine_unless_set(rendered):
    for name, service in rendered("cpu")["services"].items():
        assert _environment(service)["DECONV_HTTP_PROCESSES"] == "auto", name
    service = rendered(DECONV_HTTP_PROCESSES="8")["services"]["deconv"]
    assert _environment(service)["DECONV_HTTP_PROCESSES"] == "8"
