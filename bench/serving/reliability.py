"""Reliability runs against a live server: overload, cancellation, injected faults, SIGTERM under load, fuzzing.

Each scenario starts ``python -m service`` as a subprocess on 127.0.0.1 (CPU unless ``--devices`` says otherwise),
drives it from this process, checks what it promises, and stops it:

- ``overload``: ``--requests`` requests from ``--concurrency`` clients, far more than the queue holds: every response
  is 200 or 429, every 200 is the output of its own input (inputs are distinct linear combinations, outputs are
  checked against them), and the client's counts per status equal the server's ``deconv_requests_total``.
- ``cancellation``: clients that hang up at random moments (while sending the body, while queued, while executing):
  no worker failure, the queue drains, later requests succeed, the server's RSS returns to its baseline, and the
  server counted every request.
- ``faults``: ``DECONV_FAULTS`` in test mode: a kernel error, out of memory (split and retried; and failing even for
  one sample), a worker thread that dies and one that hangs; the service stays ready and later requests succeed.
- ``sigterm``: SIGTERM while requests are queued and executing: every accepted request is answered 200, requests
  after the signal get 503 (or find the port closed), and the process exits 0 within the drain timeout.
- ``fuzz``: runs the hypothesis and schemathesis suites of tests/reliability with ``--fuzz-examples`` cases each.
- ``limits``: raw connections against the limits: slow request heads (slowloris), a huge header, bodies declared
  64 MiB that never arrive, many large bodies against a small bytes-in-flight budget, KServe JSON answers too large
  to encode; statuses counted and the server's RSS before, at its peak and after.
- ``drain``: SIGTERM with 128 kept-alive connections and one request arriving, ``drain_runs`` times with one
  process and with ``DECONV_HTTP_PROCESSES=2``: every connection closed, the arriving request answered 503, exit 0,
  and the time from the signal to the exit.
- ``regions``, ``json``, ``drain_load``, ``refusals``: the attacks of ``bench/serving/reliability_attacks.py`` (a region
  moved to another object while a request is held, a replaced object, long JSON integers, JSON bombs with
  /health/live probed, SIGTERM under a stream of new connections ``drain_runs`` times per mode, refusals before the
  body), in one and two HTTP processes.

    python -m bench.serving.reliability                      # bounded sizes (about a minute)
    python -m bench.serving.reliability --full --out docs/benchmarks/reliability-cpu.json

The tests in tests/reliability call the same functions with smaller sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
NPY = "application/x-npy"
SCENARIOS = ("overload", "cancellation", "faults", "sigterm", "fuzz", "limits", "drain", "regions", "json",
             "drain_load", "refusals")
# Full-size runs (issue 7) and the bounded defaults.
FULL = {"overload_requests": 10_000, "cancellation_requests": 1_000, "sigterm_requests": 1_000, "fuzz_examples": 10_000,
        "slow_connections": 200, "stalled_bodies": 20, "header_bytes": 16 * 2**20, "drain_runs": 10,
        "region_trials": 5, "bombs": 8, "bomb_rounds": 20}
BOUNDED = {"overload_requests": 1_000, "cancellation_requests": 200, "sigterm_requests": 200, "fuzz_examples": 300,
           "slow_connections": 20, "stalled_bodies": 4, "header_bytes": 2**20, "drain_runs": 2,
           "region_trials": 1, "bombs": 4, "bomb_rounds": 2}


# --- the server ------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


# --- metrics -------------------------------------------------------------------------------------------------------

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


# --- inputs whose outputs identify them ----------------------------------------------------------------------------


def npy(x: np.ndarray) -> bytes:
    """``x`` as .npy bytes (numpy's writer, no pickle)."""
    buf = io.BytesIO()
    np.save(buf, x, allow_pickle=False)
    return buf.getvalue()


def load(body: bytes) -> np.ndarray:
    """.npy bytes as an array (no pickle)."""
    return np.load(io.BytesIO(body), allow_pickle=False)


@dataclass
class Probe:
    """Inputs ``x_i = a_i * u + b_i * v``, expected outputs ``a_i * Y(u) + b_i * Y(v) + (1 - a_i - b_i) * Y(0)``.

    The layer is affine, so three answers from the server give every other one: a response that is not the output
    of its own request's input (mixed up, duplicated, stale) fails ``check`` (neighbours differ by 1 in a or b).
    """

    layer: str
    shape: tuple[int, ...]
    u: np.ndarray
    v: np.ndarray
    y_u: np.ndarray = field(default_factory=lambda: np.zeros(0))
    y_v: np.ndarray = field(default_factory=lambda: np.zeros(0))
    y_0: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @classmethod
    async def create(cls, client: httpx.AsyncClient, layer: str, shape: tuple[int, ...], seed: int = 0) -> Probe:
        """Ask the server for Y(u), Y(v) and Y(0) (retrying on 429/503)."""
        rng = np.random.default_rng(seed)
        u = rng.standard_normal(shape).astype(np.float32)
        v = rng.standard_normal(shape).astype(np.float32)
        probe = cls(layer, shape, u, v)
        probe.y_u, probe.y_v, probe.y_0 = [await probe._ask(client, x) for x in (u, v, np.zeros_like(u))]
        return probe

    async def _ask(self, client: httpx.AsyncClient, x: np.ndarray) -> np.ndarray:
        for _ in range(100):
            r = await client.post(f"/deconv?layer={self.layer}", content=npy(x), headers={"content-type": NPY})
            if r.status_code == 200:
                return load(r.content).astype(np.float64)
            await asyncio.sleep(0.05)
        raise RuntimeError(f"no answer for a probe input: {r.status_code} {r.text[:200]}")

    @staticmethod
    def coefficients(i: int) -> tuple[float, float]:
        """Request ``i``'s (a, b)."""
        return float(i // 128 + 1), float(i % 128 + 1)

    def body(self, i: int) -> bytes:
        """Request ``i``'s .npy body."""
        a, b = self.coefficients(i)
        return npy((a * self.u + b * self.v).astype(np.float32))

    def check(self, i: int, body: bytes) -> bool:
        """Whether ``body`` is the output of request ``i``'s input (norm-wise relative error within 1e-3)."""
        a, b = self.coefficients(i)
        expected = a * self.y_u + b * self.y_v + (1 - a - b) * self.y_0
        y = load(body).astype(np.float64)
        if y.shape != expected.shape:
            return False
        return float(np.linalg.norm(y - expected) / np.linalg.norm(expected)) < 1e-3


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


# --- 1. overload -------------------------------------------------------------------------------------------------


class Connection:
    """One kept-alive HTTP/1.1 connection on asyncio streams: a load generator's client, without a pool.

    (httpx's pool costs more client CPU per request than the server spends at hundreds of connections, and its
    queueing would be measured as latency.)
    """

    def __init__(self, url: str) -> None:
        host_port = url.removeprefix("http://")
        self.host, port = host_port.rsplit(":", 1)
        self.port = int(port)
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, path: str, body: bytes, content_type: str) -> tuple[int, dict[str, str], bytes]:
        """POST ``body``; the status, the headers (lower-case names) and the body of the answer."""
        if self._streams is None:
            self._streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._streams
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: {content_type}\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        try:
            await writer.drain()
            status = int((await reader.readuntil(b"\r\n")).split(b" ", 2)[1])
            headers = {}
            while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            content = await reader.readexactly(int(headers.get("content-length", "0")))
        except BaseException:
            self.close()
            raise
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, headers, content

    def close(self) -> None:
        """Close the connection (the next request opens a new one)."""
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None



async def overload(url: str, *, requests: int, concurrency: int, layer: str = "demo",
                   shape: tuple[int, ...] = (1, 16, 16, 16), timeout: float = 120.0) -> dict[str, Any]:
    """``requests`` requests from ``concurrency`` clients at once (no retries): only 200 and 429, none lost.

    Returns the figures and ``checks`` (each True when it holds).
    """
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        probe = await Probe.create(client, layer, shape)
        before = await scrape(client)
        counts: dict[str, int] = {}
        latencies: list[float] = []
        wrong: list[int] = []
        no_retry_after = 0
        bodies = [probe.body(i) for i in range(min(requests, 4096))]  # encoded once; a_i, b_i repeat after 4096
        issued = 0

        async def client_loop() -> None:
            nonlocal issued, no_retry_after
            conn = Connection(url)
            while issued < requests:
                i = issued
                issued += 1
                t0 = time.perf_counter()
                try:
                    status, headers, content = await asyncio.wait_for(
                        conn.post(f"/deconv?layer={layer}", bodies[i % len(bodies)], NPY), timeout)
                except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as exc:
                    counts[type(exc).__name__] = counts.get(type(exc).__name__, 0) + 1
                    continue
                dt = time.perf_counter() - t0
                counts[str(status)] = counts.get(str(status), 0) + 1
                if status == 200:
                    latencies.append(dt * 1e3)
                    if not probe.check(i % len(bodies), content):
                        wrong.append(i)
                elif status == 429 and "retry-after" not in headers:
                    no_retry_after += 1
            conn.close()

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        samples = await scrape(client)
        server = diff(statuses(samples, layer), statuses(before, layer))
        depth = metric_sum(samples, "deconv_queue_depth", layer=layer)
        server_p99 = histogram_quantile(samples, before, "deconv_request_latency_seconds", 0.99, layer=layer)
    accepted = counts.get("200", 0)
    checks = {
        "only_200_or_429": set(counts) <= {"200", "429"},
        "none_lost": sum(counts.values()) == requests and sum(server.values()) == requests,
        "client_counts_equal_server_counts": counts == server,
        "every_200_is_its_own_output": not wrong,
        "every_429_has_retry_after": no_retry_after == 0,
        "queue_empty_after": depth == 0,
        "some_accepted_some_refused": accepted > 0 and counts.get("429", 0) > 0,
    }
    return {
        "requests": requests, "concurrency": concurrency, "layer": layer, "shape": list(shape),
        "client_statuses": counts, "server_statuses": server, "accepted": accepted,
        "refused_429": counts.get("429", 0), "wrong_outputs": len(wrong), "wall_s": round(wall, 2),
        "accepted_per_s": round(accepted / wall, 1),
        "accepted_p50_ms": percentile(latencies, 50), "accepted_p99_ms": percentile(latencies, 99),
        "accepted_max_ms": max(latencies) if latencies else None,
        "server_p99_ms_bucket": None if server_p99 is None else server_p99 * 1e3,
        "checks": checks, "ok": all(checks.values()),
    }


# --- 2. cancellation -----------------------------------------------------------------------------------------------


async def _hang_up(port: int, path: str, body: bytes, phase: str, delay_s: float) -> None:
    """One request on a raw connection, closed by the client at a chosen moment (never reading the answer)."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: {NPY}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    try:
        if phase == "upload":  # part of the body, then gone: the server is still reading it
            writer.write(head + body[: random.randrange(1, len(body))])
            await writer.drain()
            await asyncio.sleep(delay_s)
        else:  # the whole request, then gone after delay_s: before, while or after it is queued and executed
            writer.write(head + body)
            await writer.drain()
            await asyncio.sleep(delay_s)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _wait_idle(client: httpx.AsyncClient, layer: str, timeout: float = 60.0) -> list[Any]:
    """Wait until the layer's queue is empty and no worker holds a sample; the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        samples = await scrape(client)
        busy = metric_sum(samples, "deconv_queue_depth", layer=layer) + metric_sum(
            samples, "deconv_worker_inflight_samples")
        if busy == 0 or time.monotonic() > deadline:
            return samples
        await asyncio.sleep(0.05)


async def cancellation(url: str, pid: int, *, requests: int, concurrency: int = 32, layer: str = "demo",
                       shape: tuple[int, ...] = (1, 16, 96, 96), max_wait_s: float = 0.08,
                       rss_tolerance_mib: float = 32.0) -> dict[str, Any]:
    """``requests`` requests whose clients hang up at random moments; then the server must be as before.

    A quarter hang up while sending the body; the rest after a uniform random wait in [0, ``max_wait_s``], which
    spans queueing and execution (the figures say how many the server dropped from the queue, answered to a
    closed connection, or saw leave while executing).

    Start the server with ``MALLOC_MMAP_THRESHOLD_=65536`` (``CANCELLATION_ENV``): glibc then returns every freed
    request body to the system at once, so RSS follows live memory. Without it glibc raises its mmap threshold
    as it goes and keeps freed bodies in its heap, and RSS climbs to a high-water mark that hides a leak.
    """
    port = int(url.rsplit(":", 1)[1])
    path = f"/deconv?layer={layer}"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        probe = await Probe.create(client, layer, shape)

        async def normal(count: int) -> list[bool]:
            # New connections: a kept-alive one may meet the server's keep-alive timeout after a long round.
            async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as fresh:
                sem = asyncio.Semaphore(concurrency)

                async def one(i: int) -> bool:
                    async with sem:
                        r = await fresh.post(path, content=probe.body(i), headers={"content-type": NPY})
                        return r.status_code == 200 and probe.check(i, r.content)

                return list(await asyncio.gather(*(one(i) for i in range(count))))

        rng = random.Random(7)
        sem = asyncio.Semaphore(concurrency)
        body = probe.body(0)
        client_errors = 0

        def make_plan(count: int) -> list[tuple[str, float]]:
            return [("upload" if rng.random() < 0.25 else "after_body", rng.uniform(0, max_wait_s))
                    for _ in range(count)]

        async def cancelled(phase: str, wait: float) -> None:
            nonlocal client_errors
            async with sem:
                try:
                    await _hang_up(port, path, body, phase, wait)
                except OSError:
                    client_errors += 1

        # Steady state first: the allocator's high-water mark after the same traffic (normal requests and a
        # round of hang-ups); a leak shows as growth beyond it that scales with the number of requests.
        await _wait_idle(client, layer)
        rss_first = rss_bytes(pid)
        warm = await normal(4 * concurrency)
        await asyncio.gather(*(cancelled(p, w) for p, w in make_plan(min(requests, 200))))
        await _wait_idle(client, layer)
        await asyncio.sleep(0.5)
        rss_base = rss_bytes(pid)
        before = await scrape(client)

        plan = make_plan(requests)
        client_errors = 0
        t0 = time.perf_counter()
        await asyncio.gather(*(cancelled(p, w) for p, w in plan))
        wall = time.perf_counter() - t0
        # The server notices the last hang-ups a moment later.
        deadline = time.monotonic() + 30
        while True:
            after = await _wait_idle(client, layer)
            server = diff(statuses(after, layer), statuses(before, layer))
            if sum(server.values()) >= requests or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        later = await normal(2 * concurrency)
        await _wait_idle(client, layer)
        await asyncio.sleep(0.5)
        rss_after = rss_bytes(pid)
        final = await scrape(client)
        ready = (await client.get("/health/ready")).status_code

    def delta(name: str, **labels: str) -> float:
        return metric_sum(final, name, **labels) - metric_sum(before, name, **labels)

    dropped_queued = int(delta("deconv_requests_dropped_total", layer=layer, reason="disconnected"))
    gone = server.get("499", 0)
    growth_mib = (rss_after - rss_base) / 2**20
    checks = {
        "warm_up_succeeded": all(warm),
        "no_worker_failure": metric_sum(final, "deconv_worker_failures_total") == 0,
        "no_worker_restart": metric_sum(final, "deconv_worker_restarts_total") == 0,
        "queue_drained": metric_sum(final, "deconv_queue_depth", layer=layer) == 0
        and metric_sum(final, "deconv_worker_inflight_samples") == 0,
        "server_counted_every_request": sum(server.values()) == requests,
        "only_200_or_499": set(server) <= {"200", "499"},
        "later_requests_succeed": all(later),
        "still_ready": ready == 200,
        "rss_back_to_baseline": growth_mib < rss_tolerance_mib,
    }
    return {
        "requests": requests, "concurrency": concurrency, "layer": layer, "shape": list(shape),
        "hang_up_while_sending_body": sum(1 for p, _ in plan if p == "upload"),
        "hang_up_after_body": sum(1 for p, _ in plan if p != "upload"),
        "server_statuses": server, "dropped_while_queued": dropped_queued,
        # Gone after the body and not while queued: executing (or between the body and the queue).
        "gone_while_executing": max(0, gone - dropped_queued - sum(1 for p, _ in plan if p == "upload")),
        "answered_to_a_closed_connection": server.get("200", 0), "client_socket_errors": client_errors,
        "later_requests": len(later), "wall_s": round(wall, 2),
        "rss_before_warm_up_mib": round(rss_first / 2**20, 1),
        "rss_baseline_mib": round(rss_base / 2**20, 1), "rss_after_mib": round(rss_after / 2**20, 1),
        "rss_growth_mib": round(growth_mib, 1), "rss_tolerance_mib": rss_tolerance_mib,
        "body_bytes": len(body), "checks": checks, "ok": all(checks.values()),
    }


# Server settings of the cancellation scenario: a 10 ms kernel call (injected delay) and a 10 ms batching window
# widen the queued and executing phases; the allocator returns freed bodies to the system (see cancellation()).
CANCELLATION_ENV = {"DECONV_TEST_MODE": "1", "DECONV_FAULTS": "delay:ms=10", "DECONV_MAX_QUEUE_DELAY_MS": "10",
                    "MALLOC_MMAP_THRESHOLD_": "65536"}


# --- 3. faults -----------------------------------------------------------------------------------------------------

# kind -> (DECONV_FAULTS, extra settings, what the first concurrent wave must get)
FAULTS: dict[str, tuple[str, dict[str, str], str]] = {
    "kernel_error": ("error:times=1", {}, "first batch 500, the rest 200"),
    "oom_split": ("oom:above=1", {}, "all 200 (batch split in halves down to one sample)"),
    "oom_one_sample": ("oom:above=0:times=4", {}, "the batch's requests 500 after splitting; later ones 200"),
    "worker_dies": ("exit:times=1", {}, "the dead thread's batch 500; worker restarted; the rest 200"),
    "worker_hangs": ("hang:times=1", {"DECONV_WORKER_TIMEOUT_S": "1"},
                     "the hung batch 500 after the worker timeout; worker restarted; the rest 200"),
}


async def fault_run(url: str, kind: str, *, layer: str = "demo", shape: tuple[int, ...] = (1, 16, 8, 8),
                    wave: int = 8, later: int = 16) -> dict[str, Any]:
    """One fault of ``FAULTS`` on a server started with it: a concurrent wave, then ``later`` requests."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        rng = np.random.default_rng(1)
        xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(wave + later)]
        t0 = time.perf_counter()
        first = await asyncio.gather(*(client.post(f"/deconv?layer={layer}", content=npy(x),
                                                   headers={"content-type": NPY}) for x in xs[:wave]))
        first_s = time.perf_counter() - t0
        rest = [await client.post(f"/deconv?layer={layer}", content=npy(x), headers={"content-type": NPY})
                for x in xs[wave:]]
        samples = await scrape(client)
        ready = (await client.get("/health/ready")).status_code
    wave_statuses: dict[str, int] = {}
    for r in first:
        wave_statuses[str(r.status_code)] = wave_statuses.get(str(r.status_code), 0) + 1
    errors = [r for r in first if r.status_code != 200]
    leaks = [r.text for r in errors if any(mark in r.text for mark in ("Traceback", 'File "', str(ROOT), sys.prefix))]
    failures = {k: metric_sum(samples, "deconv_worker_failures_total", kind=k) for k in ("oom_retry", "oom", "error")}
    restarts = {k: metric_sum(samples, "deconv_worker_restarts_total", reason=k) for k in ("died", "stalled")}
    expected_errors = {"kernel_error": errors and all(r.json()["error"]["type"] == "internal" for r in errors),
                       "oom_split": not errors and failures["oom_retry"] > 0,
                       "oom_one_sample": errors and failures["oom"] > 0,
                       "worker_dies": errors and restarts["died"] == 1,
                       "worker_hangs": errors and restarts["stalled"] == 1}[kind]
    checks = {
        "only_200_or_500": set(wave_statuses) <= {"200", "500"},
        "fault_had_its_effect": bool(expected_errors),
        "errors_carry_no_internals": not leaks,
        "later_requests_succeed": all(r.status_code == 200 for r in rest),
        "still_ready": ready == 200,
    }
    return {"fault": kind, "spec": FAULTS[kind][0], "expected": FAULTS[kind][2], "wave": wave,
            "wave_statuses": wave_statuses, "wave_s": round(first_s, 2), "later_requests": later,
            "worker_failures": failures, "worker_restarts": restarts, "checks": checks, "ok": all(checks.values())}


# --- 4. SIGTERM under load -----------------------------------------------------------------------------------------


# The sigterm scenario's server: batches of 8, and every batch after the probe's three held until the drain begins
# (test-mode fault), so that the signal finds every accepted request still queued or executing.
SIGTERM_ENV = {"DECONV_MAX_BATCH_SIZE": "8", "DECONV_LOG_LEVEL": "info", "DECONV_TEST_MODE": "1",
               "DECONV_FAULTS": "hold:after=3"}


async def sigterm(server: Server, *, requests: int, after: int = 50, layer: str = "demo",
                  shape: tuple[int, ...] = (1, 16, 64, 64), drain_timeout_s: float = 35.0) -> dict[str, Any]:
    """SIGTERM once ``requests`` requests are accepted (queued or executing); then ``after`` more requests.

    Each request has its own connection (no keep-alive), so that every failure to connect after the signal is
    visibly a refusal, never a request lost on a reused connection. The server must log at ``info`` (its access
    log is compared with what the client received).
    """
    limits = httpx.Limits(max_connections=requests + after, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
        probe = await Probe.create(client, layer, shape)
        before = statuses(await scrape(client), layer)
        bodies = [probe.body(i) for i in range(requests)]

        async def post(i: int) -> httpx.Response | str:
            try:
                return await client.post(f"/deconv?layer={layer}", content=bodies[i % len(bodies)],
                                         headers={"content-type": NPY})
            except httpx.HTTPError as exc:
                return type(exc).__name__

        wave = [asyncio.ensure_future(post(i)) for i in range(requests)]
        # Accepted = queued, in a worker, or answered: wait until the server holds every one of them.
        deadline = time.monotonic() + 60
        while True:
            samples = await scrape(client)
            held = (metric_sum(samples, "deconv_queue_depth", layer=layer)
                    + metric_sum(samples, "deconv_worker_inflight_samples")
                    + sum(diff(statuses(samples, layer), before).values()))
            if held >= requests or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.005)
        answered_before_signal = sum(diff(statuses(samples, layer), before).values())
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        # Later requests go once the server has taken the signal in (readiness 503, or the port closed).
        while time.monotonic() - t0 < 10:
            try:
                if (await client.get("/health/ready", timeout=1)).status_code == 503:
                    break
            except httpx.HTTPError:
                break
        late = [asyncio.ensure_future(post(i)) for i in range(after)]
        results = await asyncio.gather(*wave)
        late_results = await asyncio.gather(*late)
        answered_s = time.monotonic() - t0
    try:
        code: int | None = await asyncio.to_thread(server.proc.wait, drain_timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    exit_s = time.monotonic() - t0
    accepted_statuses: dict[str, int] = {}
    wrong = 0
    for i, r in enumerate(results):
        key = r if isinstance(r, str) else str(r.status_code)
        accepted_statuses[key] = accepted_statuses.get(key, 0) + 1
        if not isinstance(r, str) and r.status_code == 200 and not probe.check(i, r.content):
            wrong += 1
    late_statuses: dict[str, int] = {}
    for r in late_results:
        key = r if isinstance(r, str) else str(r.status_code)
        late_statuses[key] = late_statuses.get(key, 0) + 1
    log = server.log()
    # uvicorn's access log has one line per response the server sent: the client got every one of them (the
    # 3 probe requests included), so a late request that failed to connect or read was never read by the server.
    logged: dict[str, int] = {}
    for status in re.findall(rf'"POST /deconv\?layer={layer} HTTP/1.1" (\d{{3}})', log):
        logged[status] = logged.get(status, 0) + 1
    received = {"200": accepted_statuses.get("200", 0) + 3}
    for key, n in late_statuses.items():
        if key.isdigit():
            received[key] = received.get(key, 0) + n
    checks = {
        "every_accepted_request_answered_200": accepted_statuses == {"200": requests},
        "every_answer_is_its_own_output": wrong == 0,
        "late_requests_refused": set(late_statuses) <= {"503", "ConnectError", "ReadError", "RemoteProtocolError"},
        "every_response_sent_was_received": logged == received,
        "exit_status_0": code == 0,
        "exit_within_drain_timeout": exit_s < drain_timeout_s,
        "no_traceback_in_log": "Traceback" not in log,
    }
    return {
        "accepted": requests, "answered_before_signal": answered_before_signal,
        "accepted_statuses": accepted_statuses, "late_requests": after, "late_statuses": late_statuses,
        "server_access_log_statuses": logged, "wrong_outputs": wrong, "exit_status": code,
        "last_answer_after_signal_s": round(answered_s, 2),
        "exit_after_signal_s": round(exit_s, 2), "drain_timeout_s": drain_timeout_s, "layer": layer,
        "shape": list(shape), "checks": checks, "ok": all(checks.values()),
    }


# --- 6. attacks on the limits: raw connections ---------------------------------------------------------------------


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


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def head(path: str, length: int | None = None, extra: str = "", content_type: str = NPY) -> bytes:
    """A POST request's head."""
    size = "" if length is None else f"Content-Length: {length}\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: deconv\r\nContent-Type: {content_type}\r\n{size}{extra}"
            "\r\n").encode()


class RssSampler:
    """The server's RSS before, at its peak (sampled every 50 ms in a thread) and after."""

    def __init__(self, pid: int) -> None:
        import threading

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


async def slow_heads(server: Server, *, connections: int, header_timeout_s: float) -> dict[str, Any]:
    """Slowloris: ``connections`` connections that send part of a request head (half of them nothing at all) and
    then wait. Each must get a 408 (or, having sent nothing, at least be closed) within twice the header timeout
    plus a margin for a busy machine."""
    host, port = _host_port(server.url)
    rss = RssSampler(server.pid)
    streams = [await asyncio.open_connection(host, port) for _ in range(connections)]
    for i, (_, writer) in enumerate(streams):
        if i % 2:
            writer.write(b"POST /deconv?layer=demo HTTP/1.1\r\nHost: deconv\r\nX-Slow: ")
            await writer.drain()
    wait_s = 2 * header_timeout_s + 20
    answers = await asyncio.gather(*(read_answer(r, wait_s) for r, _ in streams))
    closed = await asyncio.gather(*(closed_by_server(r, 5) for r, _ in streams))
    for _, writer in streams:
        writer.close()
    counted = dict(Counter(str(a[0]) for a in answers))
    checks = {"every_slow_head_answered_408": all(a[0] == 408 for i, a in enumerate(answers) if i % 2),
              "every_silent_connection_closed": all(a[0] in (408, "closed") for i, a in enumerate(answers)
                                                    if not i % 2),
              "every_connection_closed": all(closed)}
    return {"connections": connections, "header_timeout_s": header_timeout_s, "statuses": counted, **rss.stop(),
            "checks": checks, "ok": all(checks.values())}


async def huge_header(server: Server, *, size: int) -> dict[str, Any]:
    """One request whose head carries a header value of ``size`` bytes: 431, then the connection closes."""
    host, port = _host_port(server.url)
    reader, writer = await asyncio.open_connection(host, port)
    rss = RssSampler(server.pid)
    writer.write(head("/deconv?layer=demo", 0, extra="X-Big: "))
    sent = 0
    with contextlib.suppress(ConnectionError):
        while sent < size:  # in pieces, as a client would send it; the server may close before the end
            writer.write(b"a" * min(1 << 16, size - sent))
            await writer.drain()
            sent += min(1 << 16, size - sent)
        writer.write(b"\r\n\r\n")
        await writer.drain()
    status, _, body = await read_answer(reader, 30)
    closed = await closed_by_server(reader, 10)
    writer.close()
    checks = {"answered_431": status == 431, "closed": closed}
    return {"header_bytes": size, "status": status, "body": body.decode(errors="replace")[:200], **rss.stop(),
            "checks": checks, "ok": all(checks.values())}


async def stalled_bodies(server: Server, *, connections: int, declared: int, sent: int,
                         body_timeout_s: float) -> dict[str, Any]:
    """``connections`` requests that declare ``declared`` body bytes and send ``sent``: the server must not allocate
    for what has not arrived (RSS), must count it in its budget, and must answer 408 after the body timeout."""
    host, port = _host_port(server.url)
    rss = RssSampler(server.pid)
    streams = [await asyncio.open_connection(host, port) for _ in range(connections)]
    for _, writer in streams:
        writer.write(head("/deconv?layer=demo", declared) + b"\x93NUMPY"[:sent])
        await writer.drain()
    held = await wait_metric(server.url, "deconv_inflight_bytes", connections * declared)
    rss_held_mib = round(rss_bytes(server.pid) / 2**20, 1)
    answers = await asyncio.gather(*(read_answer(r, body_timeout_s + 30) for r, _ in streams))
    closed = await asyncio.gather(*(closed_by_server(r, 5) for r, _ in streams))
    for _, writer in streams:
        writer.close()
    after = await wait_metric(server.url, "deconv_inflight_bytes", 0)
    figures = rss.stop()
    counted = dict(Counter(str(a[0]) for a in answers))
    checks = {"budget_counts_the_declared_bytes": held >= connections * declared,
              "rss_does_not_follow_the_declared_bytes":
                  rss_held_mib - figures["rss_before_mib"] < connections * declared / 2**20 / 4,
              "every_request_answered_408": counted == {"408": connections},
              "every_connection_closed": all(closed), "budget_given_back": after == 0}
    return {"connections": connections, "declared_bytes": declared, "sent_bytes": sent, "statuses": counted,
            "inflight_bytes_held": held, "rss_while_held_mib": rss_held_mib, **figures, "checks": checks,
            "ok": all(checks.values())}


def budget_for(admitted: int, shape: tuple[int, ...] = (1, 16, 64, 64)) -> int:
    """The ``DECONV_MAX_INFLIGHT_BYTES`` that ``admitted`` requests of ``shape`` on the demo layer fill exactly
    (their bodies and their outputs, [N, 8, 2H, 2W] fp32)."""
    n, _, h, w = shape
    return admitted * (len(npy(np.zeros(shape, np.float32))) + n * 8 * 2 * h * 2 * w * 4)


async def budget_flood(server: Server, *, admitted: int, refused: int, shape: tuple[int, ...] = (1, 16, 64, 64),
                       late_shape: tuple[int, ...] = (1, 16, 128, 128), layer: str = "demo") -> dict[str, Any]:
    """Concurrent large bodies against a ``DECONV_MAX_INFLIGHT_BYTES`` of ``budget_for(admitted, shape)``:
    ``admitted`` requests send half their body and wait; once the server holds them (its deconv_inflight_bytes),
    ``refused`` requests of the larger ``late_shape``, which does not fit beside them, must each get 429 with
    Retry-After; then the first ones finish their bodies and get 200, and the budget empties."""
    host, port = _host_port(server.url)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    body = npy(x)
    late_body = npy(np.ones(late_shape, np.float32))
    rss = RssSampler(server.pid)
    firsts = [await asyncio.open_connection(host, port) for _ in range(admitted)]
    for _, writer in firsts:
        writer.write(head(f"/deconv?layer={layer}", len(body)) + body[:len(body) // 2])
        await writer.drain()
    held = await wait_metric(server.url, "deconv_inflight_bytes", admitted * len(body))

    async def late() -> tuple[int | str, dict[str, str], bytes]:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(head(f"/deconv?layer={layer}", len(late_body)) + late_body)
        await writer.drain()
        try:
            return await read_answer(reader, 30)
        finally:
            writer.close()

    late_answers = await asyncio.gather(*(late() for _ in range(refused)))
    for _, writer in firsts:
        writer.write(body[len(body) // 2:])
        await writer.drain()
    first_answers = await asyncio.gather(*(read_answer(r, 60) for r, _ in firsts))
    for _, writer in firsts:
        writer.close()
    after = await wait_metric(server.url, "deconv_inflight_bytes", 0)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        refusals = metric_sum(await scrape(client), "deconv_inflight_refused_total")
    late_counted = dict(Counter(str(a[0]) for a in late_answers))
    checks = {"late_requests_429_with_retry_after": all(a[0] == 429 and "retry-after" in a[1] for a in late_answers),
              "held_requests_answered_200": all(a[0] == 200 and load(a[2]).shape[1] == 8 for a in first_answers),
              "refusals_counted": refusals >= refused, "budget_given_back": after == 0}
    return {"body_bytes": len(body), "late_body_bytes": len(late_body), "admitted": admitted,
            "inflight_bytes_held": held,
            "admitted_statuses": dict(Counter(str(a[0]) for a in first_answers)), "late_statuses": late_counted,
            "refused_metric": refusals, **rss.stop(), "checks": checks, "ok": all(checks.values())}


async def json_output_flood(server: Server, *, requests: int,
                            shape: tuple[int, ...] = (7, 16, 256, 256)) -> dict[str, Any]:
    """KServe JSON requests (gzip-compressed, tiny) whose JSON answer would be about a gigabyte: 413 before any
    work, with a message that points to binary output; /health/live answers meanwhile."""
    import gzip

    count = int(np.prod(shape))
    request = {"inputs": [{"name": "input", "shape": list(shape), "datatype": "FP32", "data": [0.5] * count}]}
    body = gzip.compress(json.dumps(request).encode())
    rss = RssSampler(server.pid)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        answers = await asyncio.gather(*(client.post("/v2/models/demo/infer", content=body,
                                                     headers={"content-encoding": "gzip"})
                                         for _ in range(requests)))
        live = (await client.get("/health/live")).status_code
    counted = dict(Counter(str(r.status_code) for r in answers))
    checks = {"every_answer_413": counted == {"413": requests},
              "message_says_binary": all("binary" in r.json()["error"] for r in answers), "live_200": live == 200}
    return {"shape": list(shape), "request_bytes": len(body), "requests": requests, "statuses": counted,
            "message": answers[0].text[:300], **rss.stop(), "checks": checks, "ok": all(checks.values())}


async def keepalive_requests(server: Server, *, requests: int, layer: str = "demo") -> dict[str, Any]:
    """``requests`` requests one after the other on one kept-alive connection, each sent in one write: all 200."""
    host, port = _host_port(server.url)
    body = npy(np.zeros((1, 16, 8, 8), np.float32))
    reader, writer = await asyncio.open_connection(host, port)
    statuses: Counter[str] = Counter()
    for _ in range(requests):
        writer.write(head(f"/deconv?layer={layer}", len(body)) + body)
        await writer.drain()
        statuses[str((await read_answer(reader, 60))[0])] += 1
    writer.close()
    checks = {"every_request_200": statuses == Counter({"200": requests})}
    return {"requests": requests, "statuses": dict(statuses), "checks": checks, "ok": all(checks.values())}


async def drain_keepalive(server: Server, *, idle: int, body_shape: tuple[int, ...] = (1, 16, 128, 128),
                          layer: str = "demo") -> dict[str, Any]:
    """SIGTERM with ``idle`` kept-alive connections between requests and one whose request head is arriving.

    The idle connections must be closed by the server; the arriving request, whose body (1 MiB by default) is sent
    after the signal, must get its 503 (not a reset) with ``Connection: close``, then the connection closes; the
    server exits 0.
    """
    host, port = _host_port(server.url)
    body = npy(np.zeros(body_shape, np.float32))
    small = npy(np.zeros((1, 16, 8, 8), np.float32))
    conns = [await asyncio.open_connection(host, port) for _ in range(idle)]
    first = []
    for reader, writer in conns:
        writer.write(head(f"/deconv?layer={layer}", len(small)) + small)
        await writer.drain()
        first.append((await read_answer(reader, 60))[0])
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"POST /deconv?layer={layer} HTTP/1.1\r\n".encode())
    await writer.drain()
    await wait_metric(server.url, "deconv_requests_total", idle)  # (the head's first line is in by now)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
        while time.monotonic() - t0 < 30:  # until the server shows it took the signal in
            try:
                if (await client.get("/health/ready")).status_code == 503:
                    break
            except httpx.HTTPError:
                break
    writer.write(f"Host: deconv\r\nContent-Type: {NPY}\r\nContent-Length: {len(body)}\r\n\r\n".encode())
    with contextlib.suppress(ConnectionError):
        writer.write(body)
        await writer.drain()
    status, headers, _ = await read_answer(reader, 60)
    arriving_closed = await closed_by_server(reader, 30)
    writer.close()
    idle_closed = await asyncio.gather(*(closed_by_server(r, 30) for r, _ in conns))
    for _, w in conns:
        w.close()
    try:
        code: int | None = await asyncio.to_thread(server.proc.wait, 60)
    except subprocess.TimeoutExpired:
        code = None
    exit_s = time.monotonic() - t0
    checks = {"arriving_request_answered_503": status == 503,
              "answer_says_connection_close": headers.get("connection", "").lower() == "close",
              "arriving_connection_closed": arriving_closed, "idle_connections_closed": all(idle_closed),
              "exit_status_0": code == 0, "no_traceback_in_log": "Traceback" not in server.log()}
    return {"idle_connections": idle, "first_statuses": dict(Counter(map(str, first))),
            "arriving_request": {"body_bytes": len(body), "status": status, "connection": headers.get("connection")},
            "idle_closed": sum(idle_closed), "exit_status": code, "exit_after_signal_s": round(exit_s, 2),
            "checks": checks, "ok": all(checks.values())}


# --- 5. fuzzing ----------------------------------------------------------------------------------------------------


def fuzz(examples: int, report: Path) -> dict[str, Any]:
    """Run the hypothesis and schemathesis suites with ``examples`` cases each; the counts they report."""
    env = {**os.environ, "DECONV_FUZZ_EXAMPLES": str(examples), "DECONV_FUZZ_REPORT": str(report)}
    report.unlink(missing_ok=True)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/reliability/test_fuzz.py", "tests/reliability/test_schemathesis.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    report.with_suffix(".log").write_text(done.stdout + done.stderr)  # the failures, when there are any
    counts = json.loads(report.read_text()) if report.exists() else {}
    tail = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []
    checks = {"pytest_passed": done.returncode == 0,
              "every_fuzzer_ran_the_cases": bool(counts) and all(v >= examples for v in counts.values())}
    return {"examples_per_fuzzer": examples, "cases": counts, "pytest": tail[0] if tail else done.stderr[-500:],
            "wall_s": round(wall, 1), "checks": checks, "ok": all(checks.values())}


# --- command line --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios, print each result, write them all as JSON; exit 1 if any check failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="issue 7's sizes (10,000 overload requests, ...)")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, help="run only these (repeatable)")
    parser.add_argument("--devices", default="cpu", help="DECONV_DEVICES of the servers (default cpu)")
    parser.add_argument("--concurrency", type=int, default=256, help="overload: concurrent clients")
    parser.add_argument("--queue-size", type=int, default=32, help="overload: the server's DECONV_MAX_QUEUE_SIZE")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/deconv-reliability"), help="server logs")
    args = parser.parse_args(argv)
    sizes = FULL if args.full else BOUNDED
    args.workdir.mkdir(parents=True, exist_ok=True)
    base = {"DECONV_DEVICES": args.devices}
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "devices": args.devices,
                    "python": platform.python_version()},
        "full": args.full, "sizes": sizes,
    }
    chosen = args.scenario or list(SCENARIOS)

    def show(name: str, result: dict[str, Any]) -> None:
        results[name] = result
        failed = [k for k, ok in result.get("checks", {}).items() if not ok]
        print(f"== {name}: {'ok' if result['ok'] else 'FAILED ' + ', '.join(failed)}")
        print(json.dumps({k: v for k, v in result.items() if k != "checks"}, indent=None), flush=True)

    if "overload" in chosen:
        # The kernel call made to take 20 ms (injected delay) with at most 2 samples a call: capacity ~100
        # requests/s, far below what the clients offer, so that the queue fills and 429 answers the rest.
        env = {**base, "DECONV_MAX_QUEUE_SIZE": str(args.queue_size), "DECONV_MAX_BATCH_SIZE": "2",
               "DECONV_TEST_MODE": "1", "DECONV_FAULTS": "delay:ms=20"}
        with running(env, args.workdir / "overload.log") as server:
            show("overload", asyncio.run(overload(server.url, requests=sizes["overload_requests"],
                                                  concurrency=args.concurrency)))
    if "cancellation" in chosen:
        env = {**base, **CANCELLATION_ENV}
        with running(env, args.workdir / "cancellation.log") as server:
            show("cancellation", asyncio.run(cancellation(server.url, server.pid,
                                                          requests=sizes["cancellation_requests"])))
    if "faults" in chosen:
        out = {}
        for kind, (spec, extra, _) in FAULTS.items():
            env = {**base, "DECONV_TEST_MODE": "1", "DECONV_FAULTS": spec, "DECONV_MAX_QUEUE_DELAY_MS": "50", **extra}
            with running(env, args.workdir / f"fault-{kind}.log") as server:
                out[kind] = asyncio.run(fault_run(server.url, kind))
        show("faults", {**out, "ok": all(r["ok"] for r in out.values()),
                        "checks": {k: r["ok"] for k, r in out.items()}})
    if "sigterm" in chosen:
        env = {**base, **SIGTERM_ENV, "DECONV_MAX_QUEUE_SIZE": str(2 * sizes["sigterm_requests"])}
        server = Server.start(env, args.workdir / "sigterm.log")
        try:
            show("sigterm", asyncio.run(sigterm(server, requests=sizes["sigterm_requests"])))
        finally:
            server.stop()
    if "fuzz" in chosen:
        show("fuzz", fuzz(sizes["fuzz_examples"], args.workdir / "fuzz.json"))
    if "limits" in chosen:
        out = {}
        with running({**base, "DECONV_HEADER_TIMEOUT_S": "2"}, args.workdir / "slow-heads.log") as server:
            out["slow_heads"] = asyncio.run(slow_heads(server, connections=sizes["slow_connections"],
                                                       header_timeout_s=2.0))
            out["huge_header"] = asyncio.run(huge_header(server, size=sizes["header_bytes"]))
        with running({**base, "DECONV_BODY_TIMEOUT_S": "5"}, args.workdir / "stalled.log") as server:
            out["stalled_bodies"] = asyncio.run(stalled_bodies(server, connections=sizes["stalled_bodies"],
                                                               declared=64 * 2**20, sent=6, body_timeout_s=5.0))
        with running({**base, "DECONV_MAX_INFLIGHT_BYTES": str(budget_for(2))}, args.workdir / "budget.log") as server:
            out["budget"] = asyncio.run(budget_flood(server, admitted=2, refused=64))
        with running(base, args.workdir / "json-output.log") as server:
            out["json_output"] = asyncio.run(json_output_flood(server, requests=4))
        show("limits", {**out, "ok": all(r["ok"] for r in out.values()),
                        "checks": {k: r["ok"] for k, r in out.items()}})
    if "drain" in chosen:
        out = {}
        for processes in (1, 2):
            runs = []
            for i in range(sizes["drain_runs"]):
                env = {**base, "DECONV_HTTP_PROCESSES": str(processes), "DECONV_LOG_LEVEL": "info"}
                server = Server.start(env, args.workdir / f"drain-{processes}-{i}.log")
                try:
                    runs.append(asyncio.run(drain_keepalive(server, idle=128)))
                finally:
                    server.stop()
            times = sorted(r["exit_after_signal_s"] for r in runs)
            out[f"processes_{processes}"] = {
                "runs": len(runs), "exit_after_signal_s": times, "max_s": times[-1],
                "arriving_statuses": dict(Counter(str(r["arriving_request"]["status"]) for r in runs)),
                "idle_closed": sum(r["idle_closed"] for r in runs), "exit_statuses": [r["exit_status"] for r in runs],
                "ok": all(r["ok"] for r in runs), "failed": [r for r in runs if not r["ok"]][:2]}
        show("drain", {**out, "ok": all(r["ok"] for r in out.values()),
                       "checks": {k: r["ok"] for k, r in out.items()}})
    if set(chosen) & {"regions", "json", "drain_load", "refusals"}:
        from bench.serving import reliability_attacks

        for name, result in reliability_attacks.run(chosen, sizes, base, args.workdir).items():
            show(name, result)
    ok = all(results[s]["ok"] for s in chosen)
    if args.out:
        # Scenarios run now replace their earlier results in the file; the others are kept.
        old = json.loads(args.out.read_text()) if args.out.exists() and args.scenario else {}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**old, **results}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
