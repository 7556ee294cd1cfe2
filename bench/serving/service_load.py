"""Load generator for the service: requests/s, payload GB/s, p50/p99 latency, mean batch size and server CPU per
request, batching on vs off vs naive, over the native route or the KServe v2 protocol.

Scenarios (each server started here as a subprocess on 127.0.0.1, then stopped):

- ``batching``: ``python -m service`` with the bundled layers and its default batching limits;
- ``no-batching``: the same with ``DECONV_MAX_BATCH_SIZE`` set to the samples of one request (``--batch``), so that
  every kernel call holds exactly one request (a smaller limit would refuse multi-sample requests with 413);
  ``--http-processes N`` runs both as a multi-process server (N HTTP processes feeding one engine process);
- ``naive``: ``bench/serving/naive_server.py``, a FastAPI endpoint calling ``nn.ConvTranspose2d`` per request.

Each scenario runs a bounded number of requests from ``--clients`` concurrent clients (httpx.AsyncClient, one
connection each; ``--client raw``: a minimal asyncio protocol in a closed loop, ~20x cheaper per request) spread
over ``--procs`` load-generator processes (one Python process with httpx tops out near 1000 requests/s, less than
the server; they run uvloop's event loop when it is installed), after a warm-up, and checks one response against
PyTorch in float64. ``--max-seconds`` stops sending after that long, whatever requests remain.
``--url`` drives an already running server instead (scenario ``external``; ``--server-pid`` names its process, so
that its CPU time is sampled too). ``--rounds N`` starts every server
first and measures the scenarios N times in turn (batching, no-batching, batching, ...); the figures are the
medians over the rounds, and the ratio of batching to batching off is given for each round too. Machines drift
(the same server can lose or gain 20% within minutes), so compare only figures measured side by side.

    python -m bench.serving.service_load --clients 64 --requests 5000 --out docs/benchmarks/service_load.json

``--protocol`` (``--client raw`` only) picks what a request is:

- ``npy`` (default): ``POST /deconv?layer=NAME`` with a .npy body, answered with .npy;
- ``kserve``: ``POST /v2/models/NAME/infer`` with the KServe binary tensor extension (the JSON header, then the
  input's raw bytes; ``Inference-Header-Content-Length``), the output asked for as binary;
- ``shm``: KServe system shared memory: each client (connection) creates a POSIX shared-memory object of its own
  (the SDK's ``deconv_client._shm.Region``) for the input and, after it, the output, registers it once, writes the
  input once; each request is then a small KServe JSON request naming the region for both, and the answer carries
  no tensor bytes. Regions are unregistered and unlinked at the end, also after an error, SIGINT or SIGTERM (and
  a load process that died is swept after it by the process that started it).
- ``cuda-shm``: KServe CUDA shared memory (a GPU server on this machine): each client holds its input and output as
  torch CUDA tensors on one of ``--cuda-devices`` (GPU 0; the server's GPUs, in turn), whose allocations it
  registers once (the SDK's
  ``deconv_client._cuda_shm.CudaRegions``: IPC handles); each request is a small KServe JSON request naming them,
  the server's GPU worker reads and writes them in place, and no tensor byte crosses a socket or host memory. The
  load processes import torch (CUDA contexts of their own), so they start a few seconds earlier.

Every 200 answer's length is checked (a tensor's bytes, or none for ``shm``); one output is read and compared.
Payload bytes per request are the input's and the output's tensor bytes; payload GB/s is requests/s times that.
The mean batch size comes from the ``X-Deconv-Batch-Size`` response header (samples per kernel call).
The JSON records the load generators' CPU time (when it approaches procs x wall time, the clients, not the
server, are the limit) and the server's CPU time per process and per request in each kind of process
(``server_cpu_ms_per_request``: ``http`` is the HTTP processes' CPU over all requests divided by the requests,
``engine`` the engine process's, ``main`` that of ``python -m service`` itself: the supervisor of a multi-process
server, or the whole of a single-process one; ``naive`` the naive server's). With ``shm`` the window of those
samples also holds the registering and unregistering of the measured clients' regions (two small requests a
client: noise only in runs of a few requests). ``--gpu-util`` samples each GPU's utilisation with ``nvidia-smi``
every 200 ms during a measured round (``gpu_util_pct``, by GPU index: the mean share of time a kernel ran, over the
samples taken from 1 s after the common start to the end; nvidia-smi's figure covers the last sample period).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import math
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
from deconv_client import CodecError, LayerInfo, _shm

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ("batching", "no-batching", "naive")
PROTOCOLS = ("npy", "kserve", "shm", "cuda-shm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(scenario: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``scenario``'s server on ``port``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if scenario == "naive":
        cmd = [sys.executable, "-m", "bench.serving.naive_server", "--port", str(port), "--layer", args.layer,
               "--repository", str(args.repository), "--device", "auto" if args.devices in ("auto", "all") else
               ("cpu" if args.devices == "cpu" else f"cuda:{args.devices.split(',')[0]}")]
    else:
        cmd = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port)]
        env.update({"DECONV_LAYER_REPOSITORY": str(args.repository), "DECONV_DEVICES": args.devices,
                    "DECONV_LOG_LEVEL": "warning"})
        env["DECONV_HTTP_PROCESSES"] = str(args.http_processes)
        if scenario == "no-batching":  # one request a kernel call: the limit is a request's samples
            env["DECONV_MAX_BATCH_SIZE"] = str(args.batch)
        elif args.max_queue_delay_ms is not None:
            env["DECONV_MAX_QUEUE_DELAY_MS"] = str(args.max_queue_delay_ms)
        env["DECONV_MAX_QUEUE_SIZE"] = str(max(256, 2 * args.clients))
        if args.protocol == "shm":  # a region per client (the warm-up's are gone before the measured ones come)
            env["DECONV_SYSTEM_SHM_MAX_REGIONS"] = str(max(64, 2 * args.clients))
        if args.protocol == "cuda-shm":  # up to two allocations a client
            env["DECONV_CUDA_SHM_MAX_REGIONS"] = str(max(64, 4 * args.clients))
    return cmd, env


def start_server(scenario: str, args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd, env = server_command(scenario, args, port)
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


def layer_config(args: argparse.Namespace) -> dict[str, Any]:
    """The layer's config from the repository."""
    return json.loads((args.repository / f"{args.layer}.json").read_text())  # type: ignore[no-any-return]


def make_input(args: argparse.Namespace) -> np.ndarray:
    """The input every request sends: [--batch, C_in, --height, --width] of the layer's dtype, seeded."""
    cfg = layer_config(args)
    if cfg["dtype"] not in ("float32", "float16", "float64"):
        raise SystemExit(f"layer {args.layer} is {cfg['dtype']}; the load generator sends fp16/32/64")
    x = np.random.default_rng(0).standard_normal((args.batch, cfg["in_channels"], args.height, args.width))
    return x.astype(cfg["dtype"])


def npy_body(x: np.ndarray) -> bytes:
    """``x`` as a .npy body."""
    buf = io.BytesIO()
    np.save(buf, x, allow_pickle=False)
    return buf.getvalue()


def check_output(args: argparse.Namespace, x: np.ndarray, sample: bytes | np.ndarray) -> float:
    """Norm-wise relative error of one output (an array, or a .npy body) against PyTorch in float64."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file

    cfg = layer_config(args)
    t = load_file(str(args.repository / f"{args.layer}.safetensors"))
    bias = t["bias"].double() if cfg["bias"] else None
    ref = F.conv_transpose2d(torch.from_numpy(x).double(), t["weight"].double(), bias, cfg["stride"], cfg["padding"],
                             cfg["output_padding"], cfg["groups"], cfg["dilation"])
    y = sample if isinstance(sample, np.ndarray) else np.load(io.BytesIO(sample), allow_pickle=False)
    y = torch.from_numpy(np.asarray(y, dtype=np.float64))
    if y.shape != ref.shape:
        raise RuntimeError(f"the output has shape {list(y.shape)}, PyTorch's {list(ref.shape)}")
    return float((y - ref).norm() / ref.norm())


Decode = Callable[[int, bytes, bytes], Any]  # (client slot, lower-cased response head, body) -> the output


@dataclass
class Wire:
    """What ``--client raw`` sends for one protocol, and how it checks an answer.

    ``bodies`` holds one request body, or one a client slot (``shm``: each client names its own region);
    a 200 answer's body length must lie within ``answer_bytes``; ``decode`` reads one answer's output.
    """

    protocol: str
    path: str
    content_type: str
    headers: dict[str, str]
    bodies: list[bytes]
    in_bytes: int
    out_bytes: int
    answer_bytes: tuple[int, float]
    decode: Decode


RECV_BYTES = 1 << 20  # a raw client's socket reads, at most
MAX_HEAD = 2**16  # bytes of an answer beyond its tensor's: a .npy header, KServe's JSON


def output_shape(args: argparse.Namespace, x: np.ndarray) -> tuple[int, ...]:
    """The layer's output shape for ``x``."""
    return _shm.output_shape(LayerInfo.from_json(layer_config(args)), tuple(x.shape))


def npy_wire(args: argparse.Namespace, x: np.ndarray) -> Wire:
    """``POST /deconv`` with a .npy body."""
    out_bytes = math.prod(output_shape(args, x)) * x.itemsize

    def decode(_slot: int, _head: bytes, body: bytes) -> np.ndarray:
        return np.load(io.BytesIO(body), allow_pickle=False)  # type: ignore[no-any-return]

    return Wire("npy", f"/deconv?layer={args.layer}", "application/x-npy", {}, [npy_body(x)], x.nbytes, out_bytes,
                (out_bytes, out_bytes + MAX_HEAD), decode)


def kserve_wire(args: argparse.Namespace, x: np.ndarray) -> Wire:
    """``POST /v2/models/{layer}/infer`` with the binary tensor extension, the output asked for as binary."""
    t = _shm.prepare(x)
    shape = output_shape(args, x)
    out_bytes = math.prod(shape) * x.itemsize
    head = json.dumps({"inputs": [{"name": "input", "shape": list(t.shape), "datatype": t.datatype,
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()

    def decode(_slot: int, response_head: bytes, body: bytes) -> np.ndarray:
        n = int(header(response_head, b"inference-header-content-length") or b"-1")
        out = json.loads(body[:n])["outputs"][0]
        if out["parameters"]["binary_data_size"] != len(body) - n or tuple(out["shape"]) != shape:
            raise ValueError(f"the answer's output does not fit: {out}")
        return np.frombuffer(body[n:], dtype=x.dtype).reshape(shape)

    return Wire("kserve", f"/v2/models/{args.layer}/infer", "application/octet-stream",
                {"inference-header-content-length": str(len(head))}, [head + t.raw.tobytes()], x.nbytes, out_bytes,
                (out_bytes, out_bytes + MAX_HEAD), decode)


@contextlib.contextmanager
def shm_wire(url: str, args: argparse.Namespace, x: np.ndarray, clients: int) -> Iterator[Wire]:
    """KServe system shared memory: a region for each of ``clients`` clients, registered with the server at
    ``url`` and holding the input, for as long as the context lasts; then unregistered and unlinked."""
    t = _shm.prepare(x)
    shape = output_shape(args, x)
    size = _shm.region_bytes(t, shape, x.itemsize)
    free = shutil.disk_usage("/dev/shm").free
    if clients * size > free:
        raise SystemExit(f"{clients} regions of {size} bytes do not fit the {free} bytes free in /dev/shm")
    regions: list[_shm.Region] = []
    try:
        with httpx.Client(base_url=url, timeout=min(args.timeout, 30.0)) as http:
            for _ in range(clients):
                region = _shm.Region(size)
                regions.append(region)
                region.shm.buf[:x.nbytes] = t.raw
                http.post(_shm.register_path(region), json=region.register_body()).raise_for_status()
                region.registered = True

        def decode(slot: int, _head: bytes, body: bytes) -> Any:
            return _shm.read_output(t, regions[slot], json.loads(body))

        bodies = [json.dumps(_shm.infer_request(t, r, shape, x.itemsize)).encode() for r in regions]
        yield Wire("shm", f"/v2/models/{args.layer}/infer", "application/json", {}, bodies, x.nbytes,
                   math.prod(shape) * x.itemsize, (1, MAX_HEAD), decode)
    finally:
        unregister(url, [r.name for r in regions if r.registered])
        for region in regions:
            region.destroy()


@contextlib.contextmanager
def cuda_shm_wire(url: str, args: argparse.Namespace, x: np.ndarray, clients: int) -> Iterator[Wire]:
    """KServe CUDA shared memory: an input (holding ``x``) and an output tensor for each of ``clients`` clients,
    client i's on the i-th of ``args.cuda_devices`` in turn, made and registered with the server at ``url`` as the
    SDK does for a call (``deconv_client._cuda_shm.CudaCall``), for as long as the context lasts."""
    import torch
    from deconv_client import _cuda_shm

    devices = (list(range(torch.cuda.device_count())) if args.cuda_devices == "all"
               else [int(d) for d in args.cuda_devices.split(",")])
    info = LayerInfo.from_json(layer_config(args))
    regions = _cuda_shm.CudaRegions(max_regions=4 * clients + 4)  # none retired while the clients run
    calls: list[_cuda_shm.CudaCall] = []
    try:
        with httpx.Client(base_url=url, timeout=min(args.timeout, 30.0)) as http:
            for i in range(clients):
                call = _cuda_shm.CudaCall(torch.from_numpy(x).to(f"cuda:{devices[i % len(devices)]}"), info)
                calls.append(call)
                call.attach(regions)
                for region in call.unregistered():
                    http.post(_cuda_shm.register_path(region), json=region.register_body()).raise_for_status()
                    region.registered = True

        def decode(slot: int, _head: bytes, body: bytes) -> Any:
            return calls[slot].result(json.loads(body)).cpu().numpy()  # the server wrote it before answering

        bodies = [json.dumps(call.request()).encode() for call in calls]
        yield Wire("cuda-shm", f"/v2/models/{args.layer}/infer", "application/json", {}, bodies, x.nbytes,
                   math.prod(output_shape(args, x)) * x.itemsize, (1, MAX_HEAD), decode)
    finally:
        unregister(url, [r.name for r in regions.close() if r.registered], kind="cudasharedmemory")


def unregister(url: str, names: list[str], kind: str = "systemsharedmemory") -> None:
    """Unregister these regions (``kind``: the extension) from the server at ``url`` (bounded: a few seconds each
    at most)."""
    if not names:
        return
    with httpx.Client(base_url=url, timeout=5.0) as http:
        for name in names:
            with contextlib.suppress(httpx.HTTPError):
                http.post(f"/v2/{kind}/region/{quote(name, safe='')}/unregister")


def sweep_regions(url: str, pids: list[int]) -> list[str]:
    """Unregister and unlink what processes ``pids`` (load workers that may have died) left of their regions
    (the SDK names its objects ``deconv-client-<pid>-...``); the names swept."""
    prefixes = tuple(f"deconv-client-{pid}-" for pid in pids)
    try:
        status = httpx.get(f"{url}/v2/systemsharedmemory/status", timeout=5.0).json()
        names = [r["name"] for r in status if r["name"].startswith(prefixes)]
    except (httpx.HTTPError, ValueError, TypeError, KeyError):
        names = []
    unregister(url, names)
    left = [p for p in Path("/dev/shm").glob("deconv-client-*") if p.name.startswith(prefixes)]
    for path in left:
        path.unlink(missing_ok=True)
    return sorted({*names, *(p.name for p in left)})


class RawClient(asyncio.BufferedProtocol):
    """One client of ``--client raw``: a keep-alive HTTP/1.1 connection in a closed loop, speaking just enough HTTP
    for this benchmark.

    httpx costs about 1 ms of client CPU per request, several times what the server spends on one: above a few
    thousand requests/s the load generators, not the server, become the limit. Here a response is parsed as it
    arrives and the next request leaves from there (``RawLoad.send_next``): no task, coroutine, future or timer per
    request (a quarter to a third less CPU a request than a coroutine per request; docs/operations.md, "The load
    generator in a closed loop"). The socket is read into one reused buffer (``asyncio.BufferedProtocol``) and a
    body's bytes are only counted, unless a sample is wanted: with megabyte answers, copying each one out of the
    socket's chunks (into a ``bytes`` a chunk, then into the response's buffer) made the load generators the limit
    (bench/NOTES.md, "Megabyte answers: the load generator's own copies").
    """

    def __init__(self, load: RawLoad, slot: int = 0) -> None:
        self.load = load
        self.slot = slot  # which client this connection serves (its request body; shm: its region)
        self.transport: asyncio.Transport | None = None
        self.sent_at = 0.0  # perf_counter() when the request in flight left; 0.0: none in flight
        self.finished = False  # no more requests for this client
        self._chunk = memoryview(bytearray(RECV_BYTES))  # what the socket is read into
        self._buf = bytearray()  # the response's head until complete; then its body, when kept
        self._head: bytes | None = None  # the response's head, lower-cased, once complete
        self._length = 0  # the response body's length
        self._need = 0  # body bytes still to come
        self._keep = False  # whether this body is kept (a sample is wanted)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (asyncio's or uvloop's)
        self.load.send(self)  # the request this connection was opened for (RawLoad._connect)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._chunk

    def buffer_updated(self, nbytes: int) -> None:
        data = self._chunk[:nbytes]
        while data and self.transport is not None:
            if self._head is None:
                data = self._head_part(data)  # what follows the head, once complete
                if self._head is None:
                    return  # more of the head to come, or a bad one
            else:
                take = min(len(data), self._need)
                if self._keep:
                    self._buf += data[:take]
                self._need -= take
                data = data[take:]
            if not self._need:  # the response is complete
                head, body = self._head, bytes(self._buf) if self._keep else b""
                self._head = None
                self._buf.clear()
                self.load.answered(self, head, body, self._length)

    def _head_part(self, data: memoryview) -> memoryview:
        """Take ``data`` into the response's head; once it is complete (``_head`` set), what follows it."""
        buf = self._buf
        seen = len(buf)
        buf += data
        end = buf.find(b"\r\n\r\n", max(0, seen - 3))
        if end < 0:
            return data[len(data):]
        head = bytes(buf[:end + 2]).lower()  # each header line ends with \r\n
        rest = data[end + 4 - seen:]
        buf.clear()
        length = header(head, b"content-length")
        if not head.startswith(b"http/1.1 ") or not length or not length.isdigit():
            self.fail(ValueError(f"bad response head {head[:80]!r}"))
            return data[len(data):]
        self._head, self._length, self._need = head, int(length), int(length)
        self._keep = self.load.want_sample
        return rest

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
    connection, as long as requests remain (and, with ``max_seconds``, until that long after ``run`` began).

    ``wire`` (a protocol's requests, one body a client slot or one for all) replaces ``path``, ``payload`` and
    ``content_type``; a 200 answer whose length lies outside its ``answer_bytes`` counts as ``wrong_size``, and
    ``sample`` is the first 200 answer's output as its ``decode`` reads it (the body itself without a wire).
    """

    def __init__(self, url: str, path: str, payload: bytes, content_type: str, count: int, timeout: float,
                 wire: Wire | None = None, max_seconds: float | None = None) -> None:
        u = httpx.URL(url)
        self.host, self.port, self.timeout = u.host, u.port or 80, timeout
        extra = ""
        if wire is not None:
            path, content_type, bodies = wire.path, wire.content_type, wire.bodies
            extra = "".join(f"{k}: {v}\r\n" for k, v in wire.headers.items())
        else:
            bodies = [payload]
        self.requests = [(f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: {content_type}\r\n{extra}"
                          f"content-length: {len(body)}\r\n\r\n").encode() + body for body in bodies]
        self.answer_bytes = wire.answer_bytes if wire is not None else (0, math.inf)
        self.decode = wire.decode if wire is not None else None
        self.max_seconds = max_seconds
        self.stop_at = math.inf  # perf_counter() after which no request leaves (set by run)
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
        if self.max_seconds is not None:
            self.stop_at = time.perf_counter() + self.max_seconds
        for slot in range(clients):
            self._connect(loop, slot)
        self._watchdog = loop.call_later(min(1.0, self.timeout / 4), self._watch, loop)
        try:
            await self._finished
        finally:
            self._watchdog.cancel()
            for client in list(self.clients):
                client.close()

    def send_next(self, client: RawClient) -> None:
        """Send ``client``'s next request, or finish it when none remain (or time is up)."""
        if self.remaining <= 0 or time.perf_counter() >= self.stop_at:
            self._finish(client)
            return
        self.remaining -= 1
        self.send(client)

    def send(self, client: RawClient) -> None:
        """Send a request (already counted off ``remaining``) on ``client``'s connection."""
        assert client.transport is not None
        client.sent_at = time.perf_counter()
        client.transport.write(self.requests[client.slot % len(self.requests)])

    def answered(self, client: RawClient, head: bytes, body: bytes, length: int) -> None:
        """A complete response to ``client``'s request, of ``length`` body bytes (``body``: them, while a sample
        is wanted)."""
        if not client.sent_at:  # nothing was asked on this connection
            client.fail(ValueError("a response without a request"))
            return
        dt = time.perf_counter() - client.sent_at
        client.sent_at = 0.0
        status = head[9:12].decode("latin-1")
        if status == "200" and not self.answer_bytes[0] <= length <= self.answer_bytes[1]:
            status = "wrong_size"
        if status == "200" and self.want_sample:
            try:
                self.sample = body if self.decode is None else self.decode(client.slot, head, body)
                self.want_sample = False
            except (ValueError, KeyError, IndexError, TypeError, CodecError) as exc:
                status = f"bad_answer {type(exc).__name__}"
        self.statuses[status] += 1
        if status == "200":
            self.latencies.append(dt)
            batch = header(head, b"x-deconv-batch-size")
            self.batch_sizes.append(int(batch) if batch else 1)
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
            self._connect(asyncio.get_running_loop(), client.slot)

    def _finish(self, client: RawClient) -> None:
        if not client.finished:
            client.finished = True
            client.close()
            self._client_done()

    def _client_done(self) -> None:
        self._running -= 1
        if self._running == 0 and self._finished is not None and not self._finished.done():
            self._finished.set_result(None)

    def _connect(self, loop: asyncio.AbstractEventLoop, slot: int) -> None:
        """Open a connection for client ``slot``'s next request (counted off ``remaining`` now), or finish the
        client."""
        if self.remaining <= 0 or time.perf_counter() >= self.stop_at:
            self._client_done()
            return
        self.remaining -= 1
        task = loop.create_task(self._open(loop, slot))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open(self, loop: asyncio.AbstractEventLoop, slot: int) -> None:
        try:
            _, client = await asyncio.wait_for(
                loop.create_connection(lambda: RawClient(self, slot), self.host, self.port), self.timeout)
        except (OSError, asyncio.TimeoutError) as exc:  # the request it was for fails; the client tries again
            self.statuses[type(exc).__name__] += 1
            self._connect(loop, slot)
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


def make_wire(args: argparse.Namespace, x: np.ndarray) -> Wire:
    """The requests of ``args.protocol`` (``npy`` or ``kserve``; ``shm`` needs the server: ``shm_wire``)."""
    return kserve_wire(args, x) if args.protocol == "kserve" else npy_wire(args, x)


async def drive(url: str, args: argparse.Namespace, x: np.ndarray, count: int,
                start_at: float = 0.0) -> dict[str, Any]:
    """Send ``count`` requests of input ``x`` from ``args.clients`` concurrent clients, from wall-clock time
    ``start_at`` on (once ``shm``'s regions are registered); collect latencies, batch sizes and one output."""
    with contextlib.ExitStack() as stack:
        if args.protocol == "shm":
            wire = stack.enter_context(shm_wire(url, args, x, args.clients))
        elif args.protocol == "cuda-shm":
            wire = stack.enter_context(cuda_shm_wire(url, args, x, args.clients))
        else:
            wire = make_wire(args, x)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        if args.client == "raw":
            load = RawLoad(url, wire.path, b"", wire.content_type, count, args.timeout, wire=wire,
                           max_seconds=args.max_seconds)
            await load.run(args.clients)
            latencies, batch_sizes, statuses, sample = load.latencies, load.batch_sizes, load.statuses, load.sample
        else:
            latencies, batch_sizes, statuses, sample = await drive_httpx(url, args, wire.path, wire.bodies[0],
                                                                         wire.content_type, count)
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
    """The figures of ``parts`` (the load processes' results) over ``wall`` seconds; ``requests`` counts those
    made (each answered or failed: ``count``, unless ``--max-seconds`` ended the run first)."""
    lat = np.array([v for p in parts for v in p["latencies_ms"]])
    batch_sizes = [b for p in parts for b in p["batch_sizes"]]
    statuses: dict[str, int] = {}
    for p in parts:
        for k, v in p["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    return {
        "requests": sum(statuses.values()),
        "requests_asked": count,
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


def load_process_env() -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH``, so that a load process started as
    ``python -m bench.serving...`` finds the package from any working directory."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def drive_processes(url: str, args: argparse.Namespace, count: int) -> dict[str, Any]:
    """Run ``count`` requests from ``args.clients`` clients split over ``args.procs`` worker processes.

    Each worker is this module in ``--worker`` mode; it waits for a common start time (so that interpreter start-up
    is not measured) and writes its raw results as JSON to a file of its own, not to a pipe (a worker that ran
    uvloop's event loop was seen to deliver only the first 64 KiB of what it printed to its standard output).
    """
    procs = max(1, min(args.procs, args.clients))
    # The workers import neither torch nor the service, but for cuda-shm torch and a CUDA context each.
    start_at = time.time() + 1.0 + 0.25 * procs + (10.0 if args.protocol == "cuda-shm" else 0.0)
    parts = []
    with tempfile.TemporaryDirectory(prefix="deconv-load-") as tmp:
        files = [Path(tmp) / f"{i}.json" for i in range(procs)]
        children = []
        for i in range(procs):
            clients = args.clients // procs + (1 if i < args.clients % procs else 0)
            n = count // procs + (1 if i < count % procs else 0)
            cmd = [sys.executable, "-m", "bench.serving.service_load", "--worker", "--url", url, "--clients",
                   str(clients), "--requests", str(n), "--layer", args.layer, "--repository", str(args.repository),
                   "--batch", str(args.batch), "--height", str(args.height), "--width", str(args.width),
                   "--timeout", str(args.timeout), "--client", args.client, "--protocol", args.protocol,
                   "--cuda-devices", args.cuda_devices, "--start-at", repr(start_at), "--result-file", str(files[i])]
            if args.max_seconds is not None:
                cmd += ["--max-seconds", str(args.max_seconds)]
            children.append(subprocess.Popen(cmd, env=load_process_env()))
        try:
            for child, path in zip(children, files, strict=True):
                if child.wait(timeout=args.timeout * 4 + count) != 0:
                    raise RuntimeError(f"load worker failed with exit code {child.returncode}")
                parts.append(json.loads(path.read_text()))
        finally:
            stop_workers(children)
            if args.protocol == "shm":  # (a dead process's CUDA allocations go with it; the server's leases too)
                swept = sweep_regions(url, [child.pid for child in children])
                if swept:
                    print(f"swept {len(swept)} shared-memory region(s) the load processes left", flush=True)
    end = max(p["end"] for p in parts)
    result = summarize(count, parts, end - start_at)
    result["window"] = (start_at, end)
    return result


class GpuSampler:
    """``nvidia-smi`` printing each GPU's utilisation every ``period_ms``, every line stamped when it arrives;
    ``mean(start, end)``: the mean by GPU index of the samples stamped between those times (``time.time()``)."""

    def __init__(self, period_ms: int = 200) -> None:
        self.samples: list[tuple[float, int, float]] = []
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits", f"-lms={period_ms}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            index, _, util = line.partition(",")
            with contextlib.suppress(ValueError):
                self.samples.append((time.time(), int(index), float(util)))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.reader.join(10)

    def mean(self, start: float, end: float) -> dict[str, float] | None:
        by_gpu: dict[int, list[float]] = {}
        for stamp, index, util in self.samples:
            if start <= stamp <= end:
                by_gpu.setdefault(index, []).append(util)
        return {str(i): round(statistics.fmean(v), 1) for i, v in sorted(by_gpu.items())} or None


def stop_workers(children: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to the load processes still running (they unregister and unlink their regions), SIGKILL to those
    not gone 10 s later."""
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(10)


def sigterm_as_sigint() -> None:
    """Take SIGTERM like SIGINT (KeyboardInterrupt, or asyncio's cancellation of the main task), so that a
    terminated run cleans up like an interrupted one: servers stopped, regions unregistered and unlinked. SIGINT
    gets Python's own handler back, also where the shell that started this process ignores it (a background job)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))


def worker_main(args: argparse.Namespace) -> None:
    sigterm_as_sigint()
    x = make_input(args)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        result = runner.run(drive(args.url, args, x, args.requests, start_at=args.start_at))
    result["end"] = time.time()
    result.pop("_sample")
    Path(args.result_file).write_text(json.dumps(result))


def device_name(devices: str) -> str:
    import torch

    if devices != "cpu" and torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    return f"CPU: {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def torch_version() -> str:
    import torch

    return str(torch.__version__)


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
    sample: bytes | np.ndarray
    pid: int | None = None  # the server's process, whose tree's CPU time is sampled (None: not sampled)


def start_scenario(name: str, args: argparse.Namespace, x: np.ndarray, workdir: Path) -> Target:
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
        r = httpx.get(f"{url}/v1/layers/{args.layer}", timeout=5) if name != "naive" else None
        if r is not None and r.status_code == 200:  # the batching limits the server applied (defaults included)
            info = r.json()
            limits = {k: info[k] for k in ("max_batch_size", "max_batch_bytes", "max_queue_delay_ms",
                                          "max_queue_size")}
        sample = asyncio.run(drive(url, args, x, max(args.warmup, 1)))["_sample"]
    except BaseException:
        if proc is not None:
            stop_server(proc)
        raise
    return Target(name, url, proc, limits, sample, proc.pid if proc is not None else args.server_pid)


def measure(target: Target, args: argparse.Namespace) -> dict[str, Any]:
    """One round: ``args.requests`` requests, with the server's own timings and CPU time over them."""
    pid, url = target.pid, target.url
    timings = server_timings(url, args.layer) if target.name != "naive" else {}
    before = process_tree_cpu(pid) if pid is not None else {}
    before_main = process_tree_cpu(pid, main_thread=True) if pid is not None else {}
    sampler = GpuSampler() if args.gpu_util else None
    try:
        result = drive_processes(url, args, args.requests)
    finally:
        if sampler is not None:
            sampler.stop()
    start, end = result.pop("window")
    result["gpu_util_pct"] = sampler.mean(start + 1.0, end) if sampler is not None else None
    after = process_tree_cpu(pid) if pid is not None else {}
    after_main = process_tree_cpu(pid, main_thread=True) if pid is not None else {}
    # Where a request's time went on the server: queue, batch (start to outputs), receipt to response.
    result["server_timings"] = timing_breakdown(timings, server_timings(url, args.layer)) if timings else None
    # Server CPU seconds during the measured requests, per process (supervisor, engine, HTTP processes), and
    # of each process's main thread (the event loop: at about wall_s, that loop is what limits throughput).
    result["server_cpu_s"] = {k: round(after[k] - before.get(k, 0.0), 2) for k in after}
    result["server_main_thread_cpu_s"] = {k: round(after_main[k] - before_main.get(k, 0.0), 2)
                                          for k in after_main}
    result["server_cpu_ms_per_request"] = cpu_per_request(
        {k: after[k] - before.get(k, 0.0) for k in after}, result["ok"])
    return result


ROLES = {"service.http.frontend": "http", "service.engine.process": "engine", "service": "main",
         "naive_server": "naive"}


def cpu_per_request(cpu_s: dict[str, float], requests: int) -> dict[str, float] | None:
    """Server CPU milliseconds per request in each kind of process (``ROLES``), from CPU seconds keyed as
    ``process_tree_cpu`` keys them: the sum over a kind's processes divided by ``requests``, so that ``http`` is
    what a request costs in the HTTP process that served it. None without requests or samples."""
    if not requests or not cpu_s:
        return None
    out: dict[str, float] = {}
    for key, seconds in cpu_s.items():
        role = ROLES.get(key.partition(" ")[2], "main")
        out[role] = out.get(role, 0.0) + seconds
    return {role: round(1e3 * seconds / requests, 4) for role, seconds in sorted(out.items())}


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
    result["max_rel_err_vs_fp64"] = (check_output(args, x, target.sample)
                                     if isinstance(target.sample, np.ndarray) or target.sample else None)
    result["scenario"] = target.name
    result["protocol"] = args.protocol
    out_bytes = math.prod(output_shape(args, x)) * x.itemsize
    result["payload_bytes"] = {"input": x.nbytes, "output": out_bytes, "request": x.nbytes + out_bytes}
    result["payload_gb_per_s"] = result["requests_per_s"] * (x.nbytes + out_bytes) / 1e9
    return result


def run_scenarios(scenarios: list[str], args: argparse.Namespace, x: np.ndarray,
                  workdir: Path) -> list[dict[str, Any]]:
    """Every scenario's result. One round: each server in turn, started and stopped. Several (``--rounds``):
    every server is started first and the rounds interleave the scenarios (batching, no-batching, ..., batching,
    no-batching, ...), so that a machine whose speed drifts during the run shifts them alike."""
    if args.rounds == 1:
        results = []
        for name in scenarios:
            print(f"== {name}: {args.requests} requests from {args.clients} clients", flush=True)
            target = start_scenario(name, args, x, workdir)
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
            targets.append(start_scenario(name, args, x, workdir))
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
    head = (f"{'scenario':<12} {'proto':<6} {'req/s':>9} {'GB/s':>7} {'p50 ms':>9} {'p99 ms':>9} {'batch':>7} "
            f"{'ok':>7} {'errors':>7} {'srv us/req':>10} {'http/engine ms/req':>18} {'busiest loop':>12} "
            f"{'queue/batch/server ms':>22}")
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
        roles = r.get("server_cpu_ms_per_request") or {}
        by_role = "/".join(fmt(roles.get(k), ".3f") for k in ("http", "engine")) if "http" in roles else (
            fmt(roles.get("main", roles.get("naive")), ".3f"))  # one process: all of it
        print(f"{r['scenario']:<12} {r.get('protocol', 'npy'):<6} {r['requests_per_s']:>9.1f} "
              f"{fmt(r.get('payload_gb_per_s'), '>7.3f')} {fmt(r['p50_ms'], '>9.2f')} "
              f"{fmt(r['p99_ms'], '>9.2f')} {fmt(r['mean_batch_size'], '>7.2f')} {r['ok']:>7} {errors:>7} "
              f"{fmt(per_req, '>10.0f')} {by_role:>18} {f'{busiest:.0f}%' if busiest is not None else '-':>12} "
              f"{split:>22}")


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
    p.add_argument("--protocol", choices=PROTOCOLS, default="npy",
                   help="with --client raw: npy (POST /deconv, .npy), kserve (KServe v2 binary tensor extension), "
                        "shm (KServe system shared memory, a region per client; the server must run on this host) "
                        "or cuda-shm (KServe CUDA shared memory, tensors on this host's GPUs)")
    p.add_argument("--cuda-devices", default="0",
                   help="cuda-shm: the GPUs the clients' tensors are on, in turn (comma-separated indices, or all); "
                        "a server computes on a region's GPU, so these must be GPUs it computes on")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop sending after this many seconds of a measured run (or warm-up), requests left or not")
    p.add_argument("--server-pid", type=int, default=None,
                   help="with --url: the server's process (python -m service, or the naive server), whose CPU time "
                        "and its children's is sampled")
    p.add_argument("--gpu-util", action="store_true",
                   help="sample each GPU's utilisation with nvidia-smi during the measured rounds (gpu_util_pct)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker_main(args)
        return
    if args.clients < 1 or args.requests < 1 or args.rounds < 1:
        raise SystemExit("--clients, --requests and --rounds must be positive")
    if args.protocol != "npy" and args.client != "raw":
        raise SystemExit(f"--protocol {args.protocol} needs --client raw")
    sigterm_as_sigint()
    scenarios = ["external"] if args.url else [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(scenarios) - {*SCENARIOS, "external"}
    if unknown:
        raise SystemExit(f"unknown scenario(s): {sorted(unknown)}")

    x = make_input(args)
    if args.protocol != "npy" and "naive" in scenarios:
        raise SystemExit("the naive server speaks .npy only (--protocol npy)")
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"deconv-bench-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    results = run_scenarios(scenarios, args, x, workdir)
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
            "torch": torch_version(),
            "python": platform.python_version(),
            "host_cpus": os.cpu_count(),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": {"layer": args.layer, "input_shape": [args.batch, int(x.shape[1]), args.height, args.width],
                       "dtype": str(x.dtype), "clients": args.clients, "requests": args.requests,
                       "warmup": args.warmup, "devices": args.devices, "load_processes": args.procs,
                       "http_processes": args.http_processes,
                       "client": args.client, "client_loop": "uvloop" if event_loop_factory() else "asyncio",
                       "protocol": args.protocol, "max_seconds": args.max_seconds,
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
