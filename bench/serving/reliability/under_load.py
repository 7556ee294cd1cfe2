"""The reliability scenarios under load, each against a server started for it: ``overload`` (far more requests than
the queue holds: only 200 and 429, none lost, each 200 its own request's output), ``cancellation`` (clients that hang
up at random moments), ``faults`` (injected kernel errors, out of memory, a worker that dies or hangs) and ``sigterm``
(the signal with requests queued and executing). ``Probe`` makes inputs whose outputs identify them."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from bench.serving.reliability.server import (
    NPY,
    ROOT,
    Server,
    diff,
    histogram_quantile,
    load,
    metric_sum,
    npy,
    percentile,
    rss_bytes,
    scrape,
    statuses,
)


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
