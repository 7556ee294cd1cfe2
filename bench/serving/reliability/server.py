"""The server under test and how the reliability runs talk to it: ``python -m service`` started on 127.0.0.1 and
stopped (``Server``), its /metrics read (``scrape``, ``metric_sum``), its RSS sampled, .npy bodies, and raw HTTP on
asyncio streams (``head``, ``request``, ``read_answer``)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.serving.servers import free_port

ROOT = Path(__file__).resolve().parents[3]
NPY = "application/x-npy"
JSON = "application/json"


@dataclass
class Server:
    """``python -m service`` on 127.0.0.1 in a subprocess, its output in ``log_path``."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    @classmethod
    def start(cls, env: dict[str, str], log_path: Path, ready_timeout: float | None = 120.0) -> Server:
        """Start the server with ``env`` on top of this process's environment and wait until it is ready (not at
        all when ``ready_timeout`` is None)."""
        port = free_port()
        full_env = {**os.environ, "DECONV_DEVICES": "cpu", "DECONV_LOG_LEVEL": "warning", **env,
                    "DECONV_HOST": "127.0.0.1", "DECONV_PORT": str(port), "PYTHONUNBUFFERED": "1"}
        log = open(log_path, "wb")  # noqa: SIM115  (the child writes to it; closed with the process)
        proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=ROOT, env=full_env, stdout=log,
                                stderr=subprocess.STDOUT)
        log.close()
        server = cls(proc, f"http://127.0.0.1:{port}", log_path)
        if ready_timeout is not None:
            server.wait_ready(ready_timeout)
        return server

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self.proc.pid

    def log(self) -> str:
        """Everything the server wrote so far."""
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str, count: int = 1, timeout: float = 120.0) -> None:
        """Block until the log holds ``text`` ``count`` times (``timeout`` bounds the wait for a broken server)."""
        deadline = time.monotonic() + timeout
        while self.log().count(text) < count:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{text!r} not logged {count} times (exit status {self.proc.poll()}):\n"
                                   f"{self.log()[-3000:]}")
            time.sleep(0.02)

    def wait_ready(self, timeout: float) -> None:
        """Block until /health/ready answers 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()[-3000:]}")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait (SIGKILL after ``timeout``); the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


@contextlib.contextmanager
def running(env: dict[str, str], log_path: Path) -> Iterator[Server]:
    """A started server, stopped on exit."""
    server = Server.start(env, log_path)
    try:
        yield server
    finally:
        server.stop()


_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)")


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text as (name, labels, value) samples."""
    samples = []
    for line in text.splitlines():
        m = _SAMPLE.fullmatch(line)
        if line.startswith("#") or m is None:
            continue
        samples.append((m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")), float(m.group(3))))
    return samples


def metric_sum(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """The sum of every sample of ``name`` whose labels include ``labels``."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def statuses(samples: list[tuple[str, dict[str, str], float]], layer: str) -> dict[str, int]:
    """``deconv_requests_total`` of one layer by status, over both APIs."""
    out: dict[str, int] = {}
    for n, lab, v in samples:
        if n == "deconv_requests_total" and lab.get("layer") == layer:
            out[lab["status"]] = out.get(lab["status"], 0) + int(v)
    return out


async def scrape(client: httpx.AsyncClient) -> list[tuple[str, dict[str, str], float]]:
    """The server's /metrics."""
    return parse_metrics((await client.get("/metrics")).text)


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Per-status counts of ``after`` minus ``before``, zeros left out."""
    keys = set(after) | set(before)
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(keys) if after.get(k, 0) != before.get(k, 0)}


def rss_bytes(pid: int) -> int:
    """Resident set size of a process."""
    import psutil

    return int(psutil.Process(pid).memory_info().rss)


def npy(x: np.ndarray) -> bytes:
    """``x`` as .npy bytes (numpy's writer, no pickle)."""
    buf = io.BytesIO()
    np.save(buf, x, allow_pickle=False)
    return buf.getvalue()


def load(body: bytes) -> np.ndarray:
    """.npy bytes as an array (no pickle)."""
    return np.load(io.BytesIO(body), allow_pickle=False)


def histogram_quantile(after: list[Any], before: list[Any], name: str, q: float, **labels: str) -> float | None:
    """The upper bound of the histogram bucket holding quantile ``q`` of the samples between two scrapes."""
    buckets = []
    for n, lab, v in after:
        if n == f"{name}_bucket" and all(lab.get(k) == x for k, x in labels.items()):
            le = float(lab["le"])
            buckets.append((le, v - metric_sum(before, f"{name}_bucket", le=lab["le"], **labels)))
    buckets.sort()
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    return next(le for le, count in buckets if count >= q * total)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile, or None for no values."""
    return float(np.percentile(values, q)) if values else None


async def read_answer(reader: asyncio.StreamReader, timeout_s: float) -> tuple[int | str, dict[str, str], bytes]:
    """One HTTP answer from ``reader`` within ``timeout_s``: its status (or what happened instead: ``"closed"``,
    ``"reset"``, ``"no answer"``), its headers (lower-case names) and its body."""
    async def read() -> tuple[int | str, dict[str, str], bytes]:
        line = await reader.readuntil(b"\r\n")
        status = int(line.split(b" ", 2)[1])
        headers = {}
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers, await reader.readexactly(int(headers.get("content-length", "0")))

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except asyncio.IncompleteReadError as exc:
        return ("closed" if not exc.partial else "cut"), {}, b""
    except ConnectionResetError:
        return "reset", {}, b""
    except asyncio.TimeoutError:
        return "no answer", {}, b""


async def closed_by_server(reader: asyncio.StreamReader, timeout_s: float) -> bool:
    """Whether the server closes the connection (end of file or reset) within ``timeout_s``."""
    try:
        return await asyncio.wait_for(reader.read(1 << 16), timeout_s) == b""
    except ConnectionResetError:
        return True
    except asyncio.TimeoutError:
        return False


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def head(path: str, length: int | None = None, extra: str = "", content_type: str = NPY) -> bytes:
    """A POST request's head."""
    size = "" if length is None else f"Content-Length: {length}\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: deconv\r\nContent-Type: {content_type}\r\n{size}{extra}"
            "\r\n").encode()


async def request(url: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                  timeout_s: float = 60.0) -> tuple[int | str, dict[str, str], bytes]:
    """One request on a new connection (with a multi-process server, each may land in another HTTP process)."""
    host, port = host_port(url)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: deconv\r\nContent-Length: {len(body)}\r\n{extra}"
                     "\r\n".encode() + body)
        await writer.drain()
        return await read_answer(reader, timeout_s)
    finally:
        writer.close()


class RssSampler:
    """The server's RSS before, at its peak (sampled every 50 ms in a thread) and after."""

    def __init__(self, pid: int) -> None:

        self.pid = pid
        self.before = rss_bytes(pid)
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            with contextlib.suppress(Exception):
                self.peak = max(self.peak, rss_bytes(self.pid))

    def stop(self) -> dict[str, float]:
        """Stop sampling; before, peak and after in MiB."""
        self._stop.set()
        self._thread.join()
        after = rss_bytes(self.pid)
        self.peak = max(self.peak, after)
        return {"rss_before_mib": round(self.before / 2**20, 1), "rss_peak_mib": round(self.peak / 2**20, 1),
                "rss_after_mib": round(after / 2**20, 1)}


async def wait_metric(url: str, name: str, at_least: float, timeout_s: float = 60.0) -> float:
    """Poll /metrics until ``name`` (summed) reaches ``at_least``; its last value."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while True:
            value = metric_sum(await scrape(client), name)
            if value >= at_least or time.monotonic() > deadline:
                return value
            await asyncio.sleep(0.02)
