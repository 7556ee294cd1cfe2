"""The servers a load benchmark drives, from outside: started here as subprocesses on 127.0.0.1 (``python -m
service`` with a scenario's settings, or the naive server), waited for and stopped; their processes' CPU time, their
/metrics timings and the GPUs' utilisation while they serve."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
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


def http_processes_arg(text: str) -> int | str:
    """``--http-processes``: a count from 1, or "auto" (the server sizes it: service.config.auto_http_processes)."""
    if text.strip().lower() == "auto":
        return "auto"
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"--http-processes must be a count from 1 or 'auto', got {text!r}")
    return n


def expected_http_processes(value: int | str, devices: str) -> int:
    """How many HTTP processes a server started with ``value`` runs on this machine ("auto": the server's rule)."""
    if value == "auto":
        from service.config import auto_http_processes

        return auto_http_processes(devices)[0]
    return int(value)


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
