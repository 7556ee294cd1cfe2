"""Helpers for the service tests: test layer repositories, the app in-process, a uvicorn subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from service.config import Settings
from service.export import export_model
from service.http.app import create_app

REPO_ROOT = Path(__file__).resolve().parents[2]
NPY = "application/x-npy"
SAFETENSORS = "application/vnd.safetensors"


def run(coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
    """Run a coroutine on a fresh event loop, bounded in time."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def write_layer(root: Path, name: str, in_channels: int = 4, out_channels: int = 6, kernel_size: Any = 3,
                *, dtype: str = "float32", precision: str | None = "fp32", seed: int = 0, bias: bool = True,
                limits: dict[str, Any] | None = None, **conv: Any) -> nn.ConvTranspose2d:
    """Write one layer (PyTorch's default init, seeded) into ``root``; returns the float64 module."""
    torch.manual_seed(seed)
    module = nn.ConvTranspose2d(in_channels, out_channels, kernel_size, bias=bias, **conv)
    export_model(module, root, dtype=dtype, precision=precision if dtype == "float32" else None,
                 names={"": name}, limits=limits, overwrite=True)
    return module.double()


def npy_bytes(arr: np.ndarray) -> bytes:
    """``arr`` as .npy bytes, written by numpy itself."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def load_npy(data: bytes) -> np.ndarray:
    """Read .npy bytes with numpy, never unpickling."""
    return np.load(io.BytesIO(data), allow_pickle=False)


def reference(module: nn.ConvTranspose2d, x: torch.Tensor) -> torch.Tensor:
    """The module's output in float64 on the CPU."""
    w = module.weight.detach().double()
    b = module.bias.detach().double() if module.bias is not None else None
    return F.conv_transpose2d(x.double(), w, b, module.stride, module.padding, module.output_padding,
                              module.groups, module.dilation)


@contextlib.asynccontextmanager
async def serve_app(settings: Settings, *, wait_ready: bool = True,
                    timeout: float = 30.0) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """The app in-process (lifespan run explicitly) and an httpx client on it through ASGITransport."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=timeout) as client:
            if wait_ready:
                state = await started(app, timeout)
                assert state == "ready", f"not ready: {app.state.engine.readiness.reason}"
            yield app, client


async def started(app: Any, timeout: float = 60.0) -> str:
    """Wait until the start-up of ``app``'s engine ends, ready or failed, and return that state. The event: its
    readiness calls its listeners after every change; ``timeout`` only bounds how long a start-up that never ends is
    waited for."""
    readiness = app.state.engine.readiness
    changed = asyncio.Event()

    async def settle() -> None:
        while readiness.state == "starting":
            changed.clear()
            await changed.wait()

    readiness.listeners.append(changed.set)
    try:
        await asyncio.wait_for(settle(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"still starting after {timeout:g} s: {readiness.reason}") from None
    finally:
        readiness.listeners.remove(changed.set)
    return readiness.state


async def until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll ``condition``, a state that offers no event to wait on, until it holds; ``timeout`` only bounds how long
    one that never comes is waited for."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        await asyncio.sleep(0.01)


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text; 0 when absent."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)", line)
        if m is None or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return 0.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``python -m service`` in a subprocess on 127.0.0.1 (a random free port)."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        full_env = {**os.environ, "DECONV_DEVICES": "cpu", "DECONV_LOG_LEVEL": "info", **env,
                    "DECONV_HOST": "127.0.0.1", "DECONV_PORT": str(self.port), "PYTHONUNBUFFERED": "1"}
        self._log = open(log_path, "wb")  # noqa: SIM115  (closed in stop())
        self.proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=REPO_ROOT, env=full_env,
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        """Everything the server wrote so far."""
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until /health/ready answers 200 (or fail with the server's log)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.log()}")

    def terminate(self) -> None:
        """Send SIGTERM."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, wait, SIGKILL if needed; returns the exit code."""
        self.terminate()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(5)
        self._log.close()
        return code


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start servers with ``server_factory(env)``; every one is stopped at the end of the test."""
    started: list[ServerProcess] = []

    def start(env: dict[str, str], wait: bool = True) -> ServerProcess:
        server = ServerProcess(env, tmp_path / f"server-{len(started)}.log")
        started.append(server)
        if wait:
            server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()
