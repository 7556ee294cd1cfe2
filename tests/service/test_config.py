"""Settings: DECONV_* environment variables, defaults, validation; the command line."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from service import config
from service.config import DEFAULT_LAYER_REPOSITORY, VERSION, Settings, auto_http_processes, parse_devices

from .conftest import REPO_ROOT, write_layer


def test_defaults(monkeypatch):
    for key in ("DECONV_PORT", "DECONV_HOST", "DECONV_DEVICES", "DECONV_LAYER_REPOSITORY", "DECONV_API_KEY",
                "DECONV_HTTP_PROCESSES"):
        monkeypatch.delenv(key, raising=False)
    s = Settings()
    assert (s.host, s.port, s.devices) == ("127.0.0.1", 8000, "auto")
    assert s.layer_repository == DEFAULT_LAYER_REPOSITORY
    assert (DEFAULT_LAYER_REPOSITORY / "demo.json").is_file()
    assert (s.max_batch_size, s.max_queue_delay_ms, s.max_queue_size) == (64, 0.0, 256)
    assert s.api_key is None
    assert s.access_log is True
    assert Settings.model_fields["http_processes"].default == "auto"
    assert s.http_processes == auto_http_processes(s.devices)[0]
    assert s.http_processes_rule.startswith("DECONV_HTTP_PROCESSES=auto: ")


def test_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DECONV_PORT", "9001")
    monkeypatch.setenv("DECONV_DEVICES", " 0, 1 ")
    monkeypatch.setenv("DECONV_LAYER_REPOSITORY", str(tmp_path))
    monkeypatch.setenv("DECONV_MAX_BATCH_SIZE", "1")
    monkeypatch.setenv("DECONV_API_KEY", "sekret-value")
    monkeypatch.setenv("DECONV_LOG_LEVEL", "DEBUG")
    s = Settings()
    assert s.port == 9001
    assert parse_devices(s.devices) == [0, 1]
    assert s.layer_repository == tmp_path
    assert s.max_batch_size == 1
    assert s.api_key is not None
    assert s.api_key.get_secret_value() == "sekret-value"
    assert "sekret-value" not in repr(s)  # the key never shows in logs
    assert s.log_level == "debug"
    monkeypatch.setenv("DECONV_ACCESS_LOG", "false")
    assert Settings().access_log is False
    monkeypatch.setenv("DECONV_HTTP_PROCESSES", "4")
    assert Settings().http_processes == 4
    assert Settings().http_processes_rule == "DECONV_HTTP_PROCESSES"
    monkeypatch.setenv("DECONV_HTTP_PROCESSES", " Auto ")
    assert Settings(devices="cpu").http_processes == 1
    monkeypatch.setenv("DECONV_API_KEY", "")
    assert Settings().api_key is None


@pytest.mark.parametrize("spec", ["gpu", "0,0", "-1", "", "0,x"])
def test_bad_devices(spec):
    with pytest.raises(ValidationError):
        Settings(devices=spec)


@pytest.mark.parametrize("field", [{"max_batch_size": 0}, {"port": 70000}, {"request_timeout_s": 0},
                                   {"log_level": "loud"}, {"http_processes": 0}, {"http_processes": 65},
                                   {"http_processes": "many"}])
def test_bad_values(field):
    with pytest.raises(ValidationError):
        Settings(**field)


def test_parse_devices():
    assert parse_devices("AUTO") == "auto"
    assert parse_devices("cpu") == "cpu"
    assert parse_devices("all") == "all"
    assert parse_devices("cuda:1,2") == [1, 2]


@pytest.mark.parametrize(("cores", "gpus", "count"), [
    (16, 1, 8), (32, 2, 16),  # the two machines of the docs
    (1, 1, 1), (2, 1, 1), (2, 8, 1),  # a 2-core machine: one process
    (3, 1, 1), (4, 1, 2), (64, 0, 1), (8, 0, 1),  # no GPU: the CPU computes
    (128, 1, 16), (128, 2, 32), (256, 8, 64),  # at most 16 a GPU and 64 in all
])
def test_auto_http_processes(cores, gpus, count):
    n, inputs = auto_http_processes("auto", cores=cores, gpus=gpus)
    assert n == count
    assert inputs.startswith(f"{cores} usable core")
    assert f" {gpus} GPU" in inputs


def test_auto_reads_the_machine(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert 1 <= config.usable_cores() <= 16  # the affinity, or a container's CPU quota when lower
    monkeypatch.setattr(config, "usable_cores", lambda: 32)
    monkeypatch.setattr(config, "gpu_count", lambda devices: {"0": 1, "0,1": 2}.get(devices, 0))
    assert Settings(devices="0").http_processes == 16
    assert Settings(devices="0,1").http_processes == 16
    assert Settings(devices="0,1").http_processes_rule == "DECONV_HTTP_PROCESSES=auto: 32 usable cores, 2 GPUs"
    assert Settings(devices="cpu").http_processes == 1
    assert Settings(devices="0,1", http_processes=3).http_processes == 3
    monkeypatch.setattr(config, "usable_cores", lambda: 2)
    assert Settings(devices="0,1").http_processes == 1


def test_gpu_count_follows_the_devices():
    assert config.gpu_count("cpu") == 0
    assert config.gpu_count("0,2,3") == 3
    import torch

    assert config.gpu_count("auto") == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


# --- the command line --------------------------------------------------------------------------------------


def _cli(*args: str, script: str | None = None) -> subprocess.CompletedProcess[str]:
    command = [str(Path(sys.executable).parent / script)] if script else [sys.executable, "-m", "service"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)


@pytest.mark.parametrize(("script", "prog"), [("deconv-serve", "deconv-serve"), (None, "python -m service")])
def test_help_names_the_program_and_lists_every_setting_with_its_default(script, prog):
    if script and not (Path(sys.executable).parent / script).exists():
        pytest.skip(f"{script} is not installed in this environment")
    result = _cli("--help", script=script)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith(f"usage: {prog} ")
    for flag in ("--host", "--port", "--version"):
        assert flag in out
    listed = dict(re.findall(r"^  (DECONV_[A-Z_]+)=(.*)$", out, re.M))
    assert set(listed) == {f"DECONV_{name.upper()}" for name in Settings.model_fields}
    assert listed["DECONV_HTTP_PROCESSES"] == "auto"
    assert (listed["DECONV_PORT"], listed["DECONV_HOST"], listed["DECONV_DEVICES"]) == ("8000", "127.0.0.1", "auto")
    assert (listed["DECONV_API_KEY"], listed["DECONV_WORKERS_PER_DEVICE"]) == ("unset", "unset")
    assert (listed["DECONV_REQUEST_TIMEOUT_S"], listed["DECONV_SELF_TEST"], listed["DECONV_FAULTS"]) == (
        "30", "true", '""')
    assert listed["DECONV_LAYER_REPOSITORY"] == str(DEFAULT_LAYER_REPOSITORY)
    assert "Processes serving HTTP." in out  # each setting's description
    assert "DECONV_KERNEL_CACHE" in out


def test_version():
    result = _cli("--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"python -m service {VERSION}")


def test_the_http_process_count_and_its_rule_are_logged_at_start(server_factory, tmp_path):
    write_layer(tmp_path, "fast", in_channels=2, out_channels=2, kernel_size=2)
    one = server_factory({"DECONV_LAYER_REPOSITORY": str(tmp_path)})  # DECONV_HTTP_PROCESSES unset: auto
    count, inputs = auto_http_processes("cpu")
    assert f"HTTP processes: {count} (DECONV_HTTP_PROCESSES=auto: {inputs})" in one.log()
    two = server_factory({"DECONV_LAYER_REPOSITORY": str(tmp_path), "DECONV_HTTP_PROCESSES": "2"})
    assert "HTTP processes: 2 (DECONV_HTTP_PROCESSES)" in two.log()


def test_building_the_kernels_on_a_cpu_build_of_torch_says_what_it_needs_in_one_line():
    import torch

    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch: the kernels can be built here")
    for env in ({}, {"CUDA_HOME": "/usr/local/cuda"}):
        result = subprocess.run([sys.executable, "-m", "kernels.build", "--arch", "9.0"], capture_output=True,
                                text=True, timeout=120, cwd=REPO_ROOT, env={**os.environ, **env})
        assert result.returncode == 1
        assert result.stdout == ""
        assert result.stderr.count("\n") == 1, result.stderr  # one line, no traceback
        assert result.stderr.startswith(f"python -m kernels.build: torch {torch.__version__} is a CPU build; ")
        assert "needs a CUDA build of torch" in result.stderr
        assert "nvcc" in result.stderr


def test_make_serve_leaves_the_http_processes_to_the_servers_default():
    if not shutil.which("make"):
        pytest.skip("make is not installed")
    result = subprocess.run(["make", "-n", "-C", str(REPO_ROOT), "serve"], capture_output=True, text=True,
                            timeout=60, env={"PATH": os.environ["PATH"], "PWD": str(REPO_ROOT)})
    (command,) = [line for line in result.stdout.splitlines() if "deconv-serve" in line]
    assert command.endswith("/bin/deconv-serve"), result.stdout
    assert "HTTP_PROCESSES" not in result.stdout
    assert Settings.model_fields["http_processes"].default == "auto"
