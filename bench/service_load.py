"""Load generator for the service: requests/s, p50/p99 latency and mean batch size, batching on vs off vs naive.

Scenarios (each server started here as a subprocess on 127.0.0.1, then stopped):

- ``batching``: ``python -m service`` with the bundled layers and its default batching limits;
- ``no-batching``: the same with ``DECONV_MAX_BATCH_SIZE=1`` (every kernel call holds one request);
  ``--http-processes N`` runs both as a multi-process server (N HTTP processes feeding one engine process);
- ``naive``: ``bench/naive_server.py``, a FastAPI endpoint calling ``nn.ConvTranspose2d`` per request.

Each scenario runs a bounded number of requests from ``--clients`` concurrent clients (httpx.AsyncClient, one
connection each; ``--client raw``: a minimal asyncio protocol in a closed loop, ~20x cheaper per request) spread
over ``--procs`` load-generator processes (one Python process with httpx tops out near 1000 requests/s, less than
the server; they run uvloop's event loop when it is installed), after a warm-up, and checks one response against
PyTorch in float64.
``--url`` drives an already running server instead (scenario ``external``). ``--rounds N`` starts every server
first and measures the scenarios N times in turn (batching, no-batching, batching, ...); the figures are the
medians over the rounds, and the ratio of batching to batching off is given for each round too. Machines drift
(the same server can lose or gain 20% within minutes), so compare only figures measured side by side.

    python bench/service_load.py --clients 64 --requests 5000 --out docs/benchmarks/service_load.json

The mean batch size comes from the ``X-Deconv-Batch-Size`` response header (samples per kernel call).
The JSON records the load generators' CPU time: when it approaches procs x wall time, the clients, not the
server, are the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("batching", "no-batching", "naive")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(scenario: str, args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if scenario == "naive":
        cmd = [sys.executable, str(ROOT / "bench" / "naive_server.py"), "--port", str(port), "--layer", args.layer,
               "--repository", str(args.repository), "--device", "auto" if args.devices in ("auto", "all") else
               ("cpu" if args.devices == "cpu" else f"cuda:{args.devices.split(',')[0]}")]
    else:
        cmd = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port)]
        env.update({"DECONV_LAYER_REPOSITORY": str(args.repository), "DECONV_DEVICES": args.devices,
                    "DECONV_LOG_LEVEL": "warning"})
        env["DECONV_HTTP_PROCESSES"] = str(args.http_processes)
        if scenario == "no-batching":
            env["DECONV_MAX_BATCH_SIZE"] = "1"
        elif args.max_queue_delay_ms is not None:
            env["DECONV_MAX_QUEUE_DELAY_MS"] = str(args.max_queue_delay_ms)
        env["DECONV_MAX_QUEUE_SIZE"] = str(max(256, 2 * args.clients))
    log = open(log_path, "wb")  # noqa: SIM115  (the child keeps writing to it)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def _http_processes(url: str) -> float:
    """``deconv_http_processes`` from /metrics (HTTP processes serving; the engine's connections when several)."""
    for line in httpx.get(f"{url}/metrics", timeout=2).text.splitlines():
        if line.startswith("deconv_http_processes "):
            return float(line.split()[1])
    return 0.0


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None, timeout: float, log_path: Path | None,
               http_processes: int = 1) -> None:
    """Wait for /health/ready and until ``http_processes`` HTTP processes serve (0: do not ask /metrics)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            text = log_path.read_text(errors="replace") if log_path else ""
            raise RuntimeError(f"server exited with {proc.returncode}:\n{text[-3000:]}")
        try:
            if (httpx.get(f"{url}/health/ready", timeout=2).status_code == 200
                    and (http_processes == 0 or _http_processes(url) >= http_processes)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def process_tree_cpu(pid: int, main_thread: bool = False) -> dict[str, float]:
    """CPU seconds (user + system) so far of ``pid`` and of each child, keyed ``"<pid> <command>"``.

    ``main_thread``: of each process's main thread only (its event loop; the GPU worker is another thread).
    """
    tick = os.sysconf("SC_CLK_TCK")
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout
    cpu = {}
    for p in [pid, *(int(c) for c in out.split())]:
        stat = f"/proc/{p}/task/{p}/stat" if main_thread else f"/proc/{p}/stat"
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        roles = ("service.engine.process", "service.http.frontend", "naive_server")
        role = next((m for m in roles if m in cmd), "service")
        cpu[f"{p} {role}"] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return cpu


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def make_payload(args: argparse.Namespace) -> tuple[bytes, np.ndarray]:
    cfg = json.loads((args.repository / f"{args.layer}.json").read_text())
    if cfg["dtype"] not in ("float32", "float16", "float64"):
        raise SystemExit(f"layer {args.layer} is {cfg['dtype']}; the load generator sends .npy (fp16/32/64)")
    x = np.random.default_rng(0).standard_normal((args.batch, cfg["in_channels"], args.height, args.width))
    x = x.astype(cfg["dtype"])
    buf = io.BytesIO()
    np.save(buf, x, allow_pickle=False)
    return buf.getvalue(), x


def check_output(args: argparse.Namespace, x: np.ndarray, body: bytes) -> float:
    """Norm-wise relative error of one response against PyTorch in float64."""
    cfg = json.loads((args.repository / f"{args.layer}.json").read_text())
    t = load_file(str(args.repository / f"{args.layer}.safetensors"))
    bias = t["bias"].double() if cfg["bias"] else None
    ref = F.conv_transpose2d(torch.from_numpy(x).double(), t["weight"].double(), bias, cfg["stride"], cfg["padding"],
                             cfg["output_padding"], cfg["groups"], cfg["dilation"])
    y = torch.from_numpy(np.load(io.BytesIO(body), allow_pickle=False).astype(np.float64))
    return float((y - ref).norm() / ref.norm())


class RawClient(asyncio.Protocol):
    """One client of ``--client raw``: a keep-alive HTTP/1.1 connection in a closed loop, speaking just enough HTTP
    for this benchmark.

    httpx costs about 1 ms of client CPU per request, several times what the server spends on one: above a few
    thousand requests/s the load generators, not the server, become the limit. Here a response is parsed in
    ``data_received`` and the next request leaves from there (``RawLoad.send_next``): no task, coroutine, future or
    timer per request (a quarter to a third less CPU a request than a coroutine per request; docs/operations.md,
    "The load generator in a closed loop").
    """

    def __init__(self, load: RawLoad) -> None:
        self.load = load
        self.transport: asyncio.Transport | None = None
        self.sent_at = 0.0  # perf_counter() when the request in flight left; 0.0: none in flight
        self.finished = False  # no more requests for this client
        self._buf = bytearray()
        self._head: bytes | None = None  # the response's head, lower-cased, once complete
        self._need = 0  # the response body's length

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (asyncio's or uvloop's)
        self.load.send(self)  # the request this connection was opened for (RawLoad._connect)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while True:
            if self._head is None:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(buf[:end + 2]).lower()  # each header line ends with \r\n
                del buf[:end + 4]
                length = header(head, b"content-length")
                if not head.startswith(b"http/1.1 ") or not length or not length.isdigit():
                    self.fail(ValueError(f"bad response head {head[:80]!r}"))
                    return
                self._head, self._need = head, int(length)
            if len(buf) < self._need:
                return
            head, body = self._head, bytes(buf[:self._need]) if self.load.want_sample else b""
            del buf[:self._need]
            self._head = None
            self.load.answered(self, head, body)
            if not buf or self.transport is None:
                return

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.load.lost(self, exc)

    def fail(self, exc: BaseException) -> None:
        """Count the request in flight as failed with ``exc`` and drop the connection."""
        self.load.count_error(self, exc)
        self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # connection_lost follows
            self.transport = None


def header(head: bytes, name: bytes) -> bytes | None:
    """The value of header ``name`` (lower case) in a lower-cased response head whose lines end with CRLF."""
    start = head.find(b"\r\n" + name + b":")
    if start < 0:
        return None
    start += len(name) + 3
    return head[start:head.index(b"\r\n", start)].strip()


class RawLoad:
    """``count`` requests from ``clients`` ``RawClient`` connections; every failure is counted under its exception's
    name (a timeout, a refused or lost connection, a malformed response) and the client goes on with a new
    connection, as long as requests remain."""

    def __init__(self, url: str, path: str, payload: bytes, content_type: str, count: int, timeout: float) -> None:
        u = httpx.URL(url)
        self.host, self.port, self.timeout = u.host, u.port or 80, timeout
        self.request = (f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: {content_type}\r\n"
                        f"content-length: {len(payload)}\r\n\r\n").encode() + payload
        self.remaining = count
        self.latencies: list[float] = []
        self.batch_sizes: list[int] = []
        self.statuses: Counter[str] = Counter()  # status code, or the name of the exception that failed a request
        self.sample = b""
        self.want_sample = True
        self.clients: set[RawClient] = set()
        self._running = 0  # clients not finished
        self._tasks: set[asyncio.Task[None]] = set()
        self._finished: asyncio.Future[None] | None = None
        self._watchdog: asyncio.TimerHandle | None = None

    async def run(self, clients: int) -> None:
        """Until every request was answered or failed."""
        loop = asyncio.get_running_loop()
        self._finished = loop.create_future()
        self._running = clients
        for _ in range(clients):
            self._connect(loop)
        self._watchdog = loop.call_later(min(1.0, self.timeout / 4), self._watch, loop)
        try:
            await self._finished
        finally:
            self._watchdog.cancel()
            for client in list(self.clients):
                client.close()

    def send_next(self, client: RawClient) -> None:
        """Send ``client``'s next request, or finish it when none remain."""
        if self.remaining <= 0:
            self._finish(client)
            return
        self.remaining -= 1
        self.send(client)

    def send(self, client: RawClient) -> None:
        """Send a request (already counted off ``remaining``) on ``client``'s connection."""
        assert client.transport is not None
        client.sent_at = time.perf_counter()
        client.transport.write(self.request)

    def answered(self, client: RawClient, head: bytes, body: bytes) -> None:
        """A complete response to ``client``'s request."""
        if not client.sent_at:  # nothing was asked on this connection
            client.fail(ValueError("a response without a request"))
            return
        dt = time.perf_counter() - client.sent_at
        client.sent_at = 0.0
        status = head[9:12].decode("latin-1")
        self.statuses[status] += 1
        if status == "200":
            self.latencies.append(dt)
            batch = header(head, b"x-deconv-batch-size")
            self.batch_sizes.append(int(batch) if batch else 1)
            if self.want_sample:
                self.sample, self.want_sample = body, False
        if header(head, b"connection") == b"close":
            client.close()  # the next request goes out on a new connection (lost())
        else:
            self.send_next(client)

    def count_error(self, client: RawClient, exc: BaseException) -> None:
        """Count ``client``'s request in flight, if any, as failed with ``exc``."""
        if client.sent_at:
            client.sent_at = 0.0
            self.statuses[type(exc).__name__] += 1

    def lost(self, client: RawClient, exc: Exception | None) -> None:
        """``client``'s connection is gone: its request in flight failed; it goes on with a new connection."""
        self.count_error(client, exc or asyncio.IncompleteReadError(b"", None))
        self.clients.discard(client)
        if not client.finished:
            client.finished = True  # this connection's client lives on in the new one
            self._connect(asyncio.get_running_loop())

    def _finish(self, client: RawClient) -> None:
        if not client.finished:
            client.finished = True
            client.close()
            self._client_done()

    def _client_done(self) -> None:
        self._running -= 1
        if self._running == 0 and self._finished is not None and not self._finished.done():
            self._finished.set_result(None)

    def _connect(self, loop: asyncio.AbstractEventLoop) -> None:
        """Open a connection for a client's next request (counted off ``remaining`` now), or finish the client."""
        if self.remaining <= 0:
            self._client_done()
            return
        self.remaining -= 1
        task = loop.create_task(self._open(loop))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            _, client = await asyncio.wait_for(
                loop.create_connection(lambda: RawClient(self), self.host, self.port), self.timeout)
        except (OSError, asyncio.TimeoutError) as exc:  # the request it was for fails; the client tries again
            self.statuses[type(exc).__name__] += 1
            self._connect(loop)
            return
        if not client.finished:
            self.clients.add(client)

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        now = time.perf_counter()
        for client in list(self.clients):
            if client.sent_at and now - client.sent_at > self.timeout:
                client.fail(asyncio.TimeoutError())
        if self._finished is not None and not self._finished.done():
            self._watchdog = loop.call_later(min(1.0, self.timeout / 4), self._watch, loop)


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (as with the service's ``uvicorn[standard]``), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def drive(url: str, args: argparse.Namespace, payload: bytes, count: int) -> dict[str, Any]:
    """Send ``count`` requests from ``args.clients`` concurrent clients; collect latencies and batch sizes."""
    path = f"/deconv?layer={args.layer}"
    content_type = "application/x-npy"
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    if args.client == "raw":
        load = RawLoad(url, path, payload, content_type, count, args.timeout)
        await load.run(args.clients)
        latencies, batch_sizes, statuses, sample = load.latencies, load.batch_sizes, load.statuses, load.sample
    else:
        latencies, batch_sizes, statuses, sample = await drive_httpx(url, args, path, payload, content_type, count)
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "latencies_ms": [v * 1e3 for v in latencies],
        "batch_sizes": batch_sizes,
        "statuses": statuses,
        "wall_s": wall,
        "client_cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
        "_sample": sample,
    }


async def drive_httpx(url: str, args: argparse.Namespace, path: str, payload: bytes, content_type: str,
                      count: int) -> tuple[list[float], list[int], dict[str, int], bytes]:
    """``drive`` with one ``httpx.AsyncClient`` connection a client: latencies (s), batch sizes, statuses (an
    exception's name for a failed request) and the first 200 response's body."""
    latencies: list[float] = []
    batch_sizes: list[int] = []
    statuses: dict[str, int] = {}
    next_index = 0
    sample = b""

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal next_index, sample
        while next_index < count:
            next_index += 1
            t0 = time.perf_counter()
            try:
                r = await client.post(path, content=payload, headers={"content-type": content_type})
            except (httpx.HTTPError, OSError) as exc:
                statuses[type(exc).__name__] = statuses.get(type(exc).__name__, 0) + 1
                continue
            dt = time.perf_counter() - t0
            statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
            if r.status_code == 200:
                latencies.append(dt)
                batch_sizes.append(int(r.headers.get("x-deconv-batch-size", "1")))
                if not sample:
                    sample = r.content

    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(args.clients)))
    return latencies, batch_sizes, statuses, sample


def summarize(count: int, parts: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    lat = np.array([v for p in parts for v in p["latencies_ms"]])
    batch_sizes = [b for p in parts for b in p["batch_sizes"]]
    statuses: dict[str, int] = {}
    for p in parts:
        for k, v in p["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    return {
        "requests": count,
        "ok": len(lat),
        "statuses": statuses,
        "wall_s": wall,
        "requests_per_s": len(lat) / wall if wall > 0 else 0.0,
        "p50_ms": float(np.percentile(lat, 50)) if len(lat) else None,
        "p99_ms": float(np.percentile(lat, 99)) if len(lat) else None,
        "mean_ms": float(lat.mean()) if len(lat) else None,
        "mean_batch_size": float(np.mean(batch_sizes)) if batch_sizes else None,
        "client_cpu_s": sum(p["client_cpu_s"] for p in parts),
        "load_processes": len(parts),
    }


def drive_processes(url: str, args: argparse.Namespace, count: int) -> dict[str, Any]:
    """Run ``count`` requests from ``args.clients`` clients split over ``args.procs`` worker processes.

    Each worker is this script in ``--worker`` mode; it waits for a common start time (so that interpreter start-up
    is not measured) and writes its raw results as JSON to a file of its own, not to a pipe (a worker that ran
    uvloop's event loop was seen to deliver only the first 64 KiB of what it printed to its standard output).
    """
    procs = max(1, min(args.procs, args.clients))
    start_at = time.time() + 3.0 + 0.5 * procs
    parts = []
    with tempfile.TemporaryDirectory(prefix="deconv-load-") as tmp:
        files = [Path(tmp) / f"{i}.json" for i in range(procs)]
        children = []
        for i in range(procs):
            clients = args.clients // procs + (1 if i < args.clients % procs else 0)
            n = count // procs + (1 if i < count % procs else 0)
            cmd = [sys.executable, __file__, "--worker", "--url", url, "--clients", str(clients), "--requests", str(n),
                   "--layer", args.layer, "--repository", str(args.repository), "--batch", str(args.batch),
                   "--height", str(args.height), "--width", str(args.width), "--timeout", str(args.timeout),
                   "--client", args.client, "--start-at", repr(start_at), "--result-file", str(files[i])]
            children.append(subprocess.Popen(cmd))
        try:
            for child, path in zip(children, files, strict=True):
                if child.wait(timeout=args.timeout * 4 + count) != 0:
                    raise RuntimeError(f"load worker failed with exit code {child.returncode}")
                parts.append(json.loads(path.read_text()))
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
    wall = max(p["end"] for p in parts) - start_at
    return summarize(count, parts, wall)


def worker_main(args: argparse.Namespace) -> None:
    payload, _ = make_payload(args)
    time.sleep(max(0.0, args.start_at - time.time()))
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        result = runner.run(drive(args.url, args, payload, args.requests))
    result["end"] = time.time()
    result.pop("_sample")
    Path(args.result_file).write_text(json.dumps(result))


def device_name(devices: str) -> str:
    if devices != "cpu" and torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    return f"CPU: {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


TIMINGS = ("deconv_queue_time_seconds", "deconv_batch_seconds", "deconv_request_latency_seconds")


def server_timings(url: str, layer: str) -> dict[str, float]:
    """The server's histogram sums and counts of ``TIMINGS`` for ``layer`` (from /metrics; empty when absent)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        base, _, labels = name.partition("{")
        if base.endswith(("_sum", "_count")) and base.rsplit("_", 1)[0] in TIMINGS and f'layer="{layer}"' in labels:
            out[base] = float(value)
    return out


def timing_breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """Mean ms per request in the queue and per batch from start to outputs, and mean server-side latency,
    over the measured requests."""
    out = {}
    for metric, key in zip(TIMINGS, ("queue_ms", "batch_ms", "server_latency_ms"), strict=True):
        count = after.get(f"{metric}_count", 0.0) - before.get(f"{metric}_count", 0.0)
        if count > 0:
            out[key] = round(1e3 * (after[f"{metric}_sum"] - before.get(f"{metric}_sum", 0.0)) / count, 3)
    return out or None


@dataclass
class Target:
    """A scenario's server, started and warmed up, ready to be measured (``url`` only for ``external``)."""

    name: str
    url: str
    proc: subprocess.Popen[bytes] | None
    limits: dict[str, Any] | None
    sample: bytes


def start_scenario(name: str, args: argparse.Namespace, payload: bytes, workdir: Path) -> Target:
    """Start the scenario's server (none for ``external``), wait until it is ready and warm it up."""
    proc = None
    log_path = workdir / f"{name}.log"
    if name == "external":
        url = args.url
    else:
        proc, url = start_server(name, args, log_path)
    try:
        wait_ready(url, proc, args.startup_timeout, log_path if proc else None,
                   args.http_processes if name in ("batching", "no-batching") else 0)  # naive: no /metrics
        limits = None
        if name != "naive":  # the batching limits the server applied to the layer (defaults included)
            info = httpx.get(f"{url}/v1/layers/{args.layer}", timeout=5).json()
            limits = {k: info[k] for k in ("max_batch_size", "max_batch_bytes", "max_queue_delay_ms",
                                          "max_queue_size")}
        sample = asyncio.run(drive(url, args, payload, max(args.warmup, 1)))["_sample"]
    except BaseException:
        if proc is not None:
            stop_server(proc)
        raise
    return Target(name, url, proc, limits, sample)


def measure(target: Target, args: argparse.Namespace) -> dict[str, Any]:
    """One round: ``args.requests`` requests, with the server's own timings and CPU time over them."""
    proc, url = target.proc, target.url
    timings = server_timings(url, args.layer) if target.name != "naive" else {}
    before = process_tree_cpu(proc.pid) if proc is not None else {}
    before_main = process_tree_cpu(proc.pid, main_thread=True) if proc is not None else {}
    result = drive_processes(url, args, args.requests)
    after = process_tree_cpu(proc.pid) if proc is not None else {}
    after_main = process_tree_cpu(proc.pid, main_thread=True) if proc is not None else {}
    # Where a request's time went on the server: queue, batch (start to outputs), receipt to response.
    result["server_timings"] = timing_breakdown(timings, server_timings(url, args.layer)) if timings else None
    # Server CPU seconds during the measured requests, per process (supervisor, engine, HTTP processes), and
    # of each process's main thread (the event loop: at about wall_s, that loop is what limits throughput).
    result["server_cpu_s"] = {k: round(after[k] - before.get(k, 0.0), 2) for k in after}
    result["server_main_thread_cpu_s"] = {k: round(after_main[k] - before_main.get(k, 0.0), 2)
                                          for k in after_main}
    return result


ROUND_MEDIANS = ("requests_per_s", "p50_ms", "p99_ms", "mean_ms", "mean_batch_size")


def finish(target: Target, args: argparse.Namespace, x: np.ndarray, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The scenario's result: its one round, or with several the median of each figure over the rounds (the
    round closest to the median requests/s for everything else) and every round under ``rounds``."""
    if len(rounds) == 1:
        result = dict(rounds[0])
    else:
        middle = statistics.median(r["requests_per_s"] for r in rounds)
        result = dict(min(rounds, key=lambda r: abs(r["requests_per_s"] - middle)))
        for key in ROUND_MEDIANS:
            values = [r[key] for r in rounds if r.get(key) is not None]
            result[key] = statistics.median(values) if values else None
        result["rounds"] = rounds
    result["layer_limits"] = target.limits
    result["max_rel_err_vs_fp64"] = check_output(args, x, target.sample) if target.sample else None
    result["scenario"] = target.name
    return result


def run_scenarios(scenarios: list[str], args: argparse.Namespace, payload: bytes, x: np.ndarray,
                  workdir: Path) -> list[dict[str, Any]]:
    """Every scenario's result. One round: each server in turn, started and stopped. Several (``--rounds``):
    every server is started first and the rounds interleave the scenarios (batching, no-batching, ..., batching,
    no-batching, ...), so that a machine whose speed drifts during the run shifts them alike."""
    if args.rounds == 1:
        results = []
        for name in scenarios:
            print(f"== {name}: {args.requests} requests from {args.clients} clients", flush=True)
            target = start_scenario(name, args, payload, workdir)
            try:
                results.append(finish(target, args, x, [measure(target, args)]))
            finally:
                if target.proc is not None:
                    stop_server(target.proc)
        return results
    targets: list[Target] = []
    try:
        for name in scenarios:
            print(f"== starting {name}", flush=True)
            targets.append(start_scenario(name, args, payload, workdir))
        rounds: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
        for i in range(args.rounds):
            for target in targets:
                r = measure(target, args)
                rounds[target.name].append(r)
                print(f"== round {i + 1}/{args.rounds} {target.name}: {r['requests_per_s']:.0f} requests/s, "
                      f"p99 {r['p99_ms']:.2f} ms", flush=True)
        return [finish(t, args, x, rounds[t.name]) for t in targets]
    finally:
        for target in targets:
            if target.proc is not None:
                stop_server(target.proc)


def ratios(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Batching's requests/s over batching off's: of the medians, and round by round."""
    by_name = {r["scenario"]: r for r in results}
    on, off = by_name.get("batching"), by_name.get("no-batching")
    if on is None or off is None or not off["requests_per_s"]:
        return None
    out: dict[str, Any] = {"batching_over_no_batching": on["requests_per_s"] / off["requests_per_s"]}
    if "rounds" in on and "rounds" in off:
        out["per_round"] = [a["requests_per_s"] / b["requests_per_s"] for a, b in zip(on["rounds"], off["rounds"],
                                                                                       strict=True)]
    return out


def print_table(results: list[dict[str, Any]]) -> None:
    head = (f"{'scenario':<12} {'req/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'batch':>7} {'ok':>7} {'errors':>7} "
            f"{'srv us/req':>10} {'busiest loop':>12} {'queue/batch/server ms':>22}")
    print(head)
    print("-" * len(head))
    for r in results:
        errors = r["requests"] - r["ok"]

        def fmt(v: float | None, spec: str) -> str:
            return format(v, spec) if v is not None else "-"

        cpu = r.get("server_cpu_s")
        per_req = 1e6 * sum(cpu.values()) / r["requests"] if cpu else None  # server CPU per request, all processes
        loops = r.get("server_main_thread_cpu_s")
        busiest = 100 * max(loops.values()) / r["wall_s"] if loops else None  # % of one core, busiest event loop
        t = r.get("server_timings") or {}
        split = "/".join(fmt(t.get(k), ".2f") for k in ("queue_ms", "batch_ms", "server_latency_ms"))
        print(f"{r['scenario']:<12} {r['requests_per_s']:>9.1f} {fmt(r['p50_ms'], '>9.2f')} "
              f"{fmt(r['p99_ms'], '>9.2f')} {fmt(r['mean_batch_size'], '>7.2f')} {r['ok']:>7} {errors:>7} "
              f"{fmt(per_req, '>10.0f')} {f'{busiest:.0f}%' if busiest is not None else '-':>12} {split:>22}")


def main() -> None:
    p = argparse.ArgumentParser(description="Drive the deconv service with concurrent clients.")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list of {', '.join(SCENARIOS)}")
    p.add_argument("--url", help="drive this running server instead of starting any (scenario 'external')")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (connections)")
    p.add_argument("--requests", type=int, default=2000, help="requests per scenario (after the warm-up)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure each scenario this many times, interleaved, with every server started first; "
                        "figures are the medians over the rounds")
    p.add_argument("--warmup", type=int, default=200, help="warm-up requests per scenario (not measured)")
    p.add_argument("--layer", default="demo")
    p.add_argument("--repository", type=Path, default=ROOT / "layers")
    p.add_argument("--batch", type=int, default=1, help="samples per request")
    p.add_argument("--height", type=int, default=16)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--devices", default="auto", help="DECONV_DEVICES for the servers started here")
    p.add_argument("--http-processes", type=int, default=1,
                   help="DECONV_HTTP_PROCESSES of the batching and no-batching servers (1: single process)")
    p.add_argument("--max-queue-delay-ms", type=float, default=None, help="DECONV_MAX_QUEUE_DELAY_MS (batching)")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout (s)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                   help="load-generator processes (default: half the cores, at most 8)")
    p.add_argument("--client", choices=("httpx", "raw"), default="httpx",
                   help="load-generator HTTP client: httpx (default), or a minimal asyncio protocol (~20x less client "
                        "CPU per request; use it when client_cpu_s approaches procs x wall_s)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker_main(args)
        return
    if args.clients < 1 or args.requests < 1 or args.rounds < 1:
        raise SystemExit("--clients, --requests and --rounds must be positive")
    scenarios = ["external"] if args.url else [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(scenarios) - {*SCENARIOS, "external"}
    if unknown:
        raise SystemExit(f"unknown scenario(s): {sorted(unknown)}")

    payload, x = make_payload(args)
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"deconv-bench-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    results = run_scenarios(scenarios, args, payload, x, workdir)
    print()
    print_table(results)
    ratio = ratios(results)
    if ratio is not None:
        rounds = ratio.get("per_round")
        print(f"\nbatching / no-batching: {ratio['batching_over_no_batching']:.2f}x"
              + (f" (rounds: {', '.join(f'{v:.2f}x' for v in rounds)})" if rounds else ""))
    if args.out:
        report = {
            "benchmark": "service_load",
            "device": device_name(args.devices),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "host_cpus": os.cpu_count(),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": {"layer": args.layer, "input_shape": [args.batch, int(x.shape[1]), args.height, args.width],
                       "dtype": str(x.dtype), "clients": args.clients, "requests": args.requests,
                       "warmup": args.warmup, "devices": args.devices, "load_processes": args.procs,
                       "http_processes": args.http_processes,
                       "client": args.client, "client_loop": "uvloop" if event_loop_factory() else "asyncio",
                       "rounds": args.rounds,
                       "max_queue_delay_ms": args.max_queue_delay_ms,
                       # settings the started servers inherit from this environment (the API key left out)
                       "server_env": {k: v for k, v in sorted(os.environ.items())
                                      if k.startswith("DECONV_") and k != "DECONV_API_KEY"}},
            "results": results,
            "ratio": ratio,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
