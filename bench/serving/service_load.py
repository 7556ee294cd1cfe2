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
import json
import math
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.serving.raw_client import RawLoad, event_loop_factory
from bench.serving.servers import (
    GpuSampler,
    cpu_per_request,
    expected_http_processes,
    http_processes_arg,
    process_tree_cpu,
    server_timings,
    start_server,
    stop_server,
    timing_breakdown,
    wait_ready,
)
from bench.serving.wire import (
    check_output,
    cuda_shm_wire,
    make_input,
    make_wire,
    output_shape,
    shm_wire,
    sweep_regions,
)

ROOT = Path(__file__).resolve().parents[2]


SCENARIOS = ("batching", "no-batching", "naive")


PROTOCOLS = ("npy", "kserve", "shm", "cuda-shm")


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


def start_load_processes(module: str, worker_args: Callable[[int, int, Path], list[str]], procs: int, clients: int,
                         count: int, tmp: str) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    """``procs`` load processes, ``python -m module --worker`` with ``worker_args(clients, requests, result_file)``,
    ``clients`` and ``count`` shared out evenly; their result files are in ``tmp``."""
    files = [Path(tmp) / f"{i}.json" for i in range(procs)]
    children = []
    for i, path in enumerate(files):
        share = (clients // procs + (1 if i < clients % procs else 0), count // procs + (1 if i < count % procs else 0))
        cmd = [sys.executable, "-m", module, "--worker", *worker_args(*share, path)]
        children.append(subprocess.Popen(cmd, env=load_process_env()))
    return children, files


def add_load_process_args(p: argparse.ArgumentParser) -> None:
    """The hidden arguments ``start_load_processes`` gives a load process (``--worker``, ``--start-at``,
    ``--result-file``), for the parser of the module it starts."""
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)


def wait_load_processes(children: list[subprocess.Popen[bytes]], files: list[Path], timeout: float) -> list[dict]:
    """Each load process's result document, once it exited with 0 (``RuntimeError`` otherwise)."""
    parts = []
    for child, path in zip(children, files, strict=True):
        if child.wait(timeout=timeout) != 0:
            raise RuntimeError(f"load process failed with exit code {child.returncode}")
        parts.append(json.loads(path.read_text()))
    return parts


def drive_processes(url: str, args: argparse.Namespace, count: int) -> dict[str, Any]:
    """Run ``count`` requests from ``args.clients`` clients split over ``args.procs`` worker processes.

    Each worker is this module in ``--worker`` mode; it waits for a common start time (so that interpreter start-up
    is not measured) and writes its raw results as JSON to a file of its own, not to a pipe (a worker that ran
    uvloop's event loop was seen to deliver only the first 64 KiB of what it printed to its standard output).
    """
    procs = max(1, min(args.procs, args.clients))
    # The workers import neither torch nor the service, but for cuda-shm torch and a CUDA context each.
    start_at = time.time() + 1.0 + 0.25 * procs + (10.0 if args.protocol == "cuda-shm" else 0.0)

    def worker_args(clients: int, n: int, result_file: Path) -> list[str]:
        extra = [] if args.max_seconds is None else ["--max-seconds", str(args.max_seconds)]
        return ["--url", url, "--clients", str(clients), "--requests", str(n), "--layer", args.layer,
                "--repository", str(args.repository), "--batch", str(args.batch), "--height", str(args.height),
                "--width", str(args.width), "--timeout", str(args.timeout), "--client", args.client, "--protocol",
                args.protocol, "--cuda-devices", args.cuda_devices, "--start-at", repr(start_at), "--result-file",
                str(result_file), *extra]

    with tempfile.TemporaryDirectory(prefix="deconv-load-") as tmp:
        children, files = start_load_processes("bench.serving.service_load", worker_args, procs, args.clients, count,
                                               tmp)
        try:
            parts = wait_load_processes(children, files, args.timeout * 4 + count)
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
                   expected_http_processes(args.http_processes, args.devices)
                   if name in ("batching", "no-batching") else 0)  # naive: no /metrics
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
    p.add_argument("--http-processes", type=http_processes_arg, default=1,
                   help="DECONV_HTTP_PROCESSES of the batching and no-batching servers (1: single process; auto: "
                        "the server's default, sized from the cores and GPUs)")
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
    add_load_process_args(p)
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
