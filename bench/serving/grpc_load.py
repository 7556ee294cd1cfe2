"""KServe v2 over gRPC against KServe v2 over HTTP, side by side in one run: requests/s, payload MB/s, p50/p99
latency, mean batch size and server CPU per request, for tiny and 4 MiB requests.

One server (``python -m service`` with ``DECONV_GRPC_PORT``, started here on 127.0.0.1 and stopped at the end; or
``--url`` and ``--grpc`` of a running one) serves both protocols from the same engine. For each round, each size
(``--sizes``: name=HxW, default ``tiny=16x16`` and ``4mib=256x256``, which for the bundled ``demo`` layer are a
16 KiB and a 4 MiB float32 input) and each protocol in turn, ``--clients`` concurrent clients spread over
``--procs`` load processes send ``--requests`` requests (or until ``--max-seconds``) in a closed loop, after a
warm-up in the first round:

- ``http``: ``POST /v2/models/{layer}/infer`` with the binary tensor extension, output as binary, from the raw
  asyncio client of ``bench/serving/raw_client.py`` (``RawLoad``, ``wire.kserve_wire``; one connection a client);
- ``grpc``: ``inference.GRPCInferenceService/ModelInfer`` with the input as ``raw_input_contents``, from grpcio's
  asyncio client: one channel (one HTTP/2 connection: a local subchannel pool) a client, the request message
  serialized once and sent as bytes, every answer parsed (tritonclient's ``ModelInferResponse``) and its
  ``raw_output_contents`` size checked; the batch size from the answer's ``deconv_batch_size`` parameter.

One output of each protocol and size is compared with PyTorch in float64 (``rel_err``). Server CPU per request is
the CPU time of the server's processes over the measured window, divided by the requests answered. Compare only
figures from the same run; ``--rounds N`` repeats the whole sequence and reports the median of each figure.

    python -m bench.serving.grpc_load --clients 64 --requests 20000 --max-seconds 20 --rounds 3 --http-processes 8 \\
        --out docs/benchmarks/grpc_load.json
    python -m bench.serving.grpc_load --devices cpu --clients 4 --requests 200 --max-seconds 2 --warmup 20  # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from bench.serving import service_load as sl
from bench.serving.raw_client import RawLoad, event_loop_factory
from bench.serving.servers import (
    expected_http_processes,
    free_port,
    http_processes_arg,
    process_tree_cpu,
    stop_server,
    wait_ready,
)
from bench.serving.wire import check_output, kserve_wire, make_input, output_shape

ROOT = Path(__file__).resolve().parents[2]
PROTOCOLS = ("http", "grpc")
METHOD = "/inference.GRPCInferenceService/ModelInfer"
DEFAULT_SIZES = "tiny=16x16,4mib=256x256"


def parse_sizes(text: str) -> list[tuple[str, int, int]]:
    """``name=HxW,...`` as (name, H, W)."""
    sizes = []
    for item in text.split(","):
        name, _, hw = item.strip().partition("=")
        h, _, w = hw.partition("x")
        if not (name and h.isdigit() and w.isdigit()):
            raise SystemExit(f"--sizes: expected name=HxW, got {item!r}")
        sizes.append((name, int(h), int(w)))
    return sizes


def grpc_request(layer: str, x: np.ndarray) -> bytes:
    """The serialized ``ModelInferRequest`` of input ``x`` (raw contents), the output asked for by name."""
    from tritonclient.grpc import service_pb2

    datatype = {"float32": "FP32", "float16": "FP16", "float64": "FP64"}[str(x.dtype)]
    request = service_pb2.ModelInferRequest(model_name=layer)
    request.inputs.add(name="input", datatype=datatype, shape=list(x.shape))
    request.outputs.add(name="output")
    request.raw_input_contents.append(np.ascontiguousarray(x).tobytes())
    return request.SerializeToString()


class GrpcLoad:
    """``count`` ModelInfer calls from ``clients`` channels, each in a closed loop; failures counted under their
    status code's name, wrong-sized answers as ``wrong_size``; ``sample``: the first answer's output."""

    def __init__(self, target: str, request: bytes, out_shape: tuple[int, ...], dtype: np.dtype, count: int,
                 timeout: float, max_seconds: float | None, api_key: str | None) -> None:
        self.target, self.request, self.timeout = target, request, timeout
        self.out_shape, self.dtype = out_shape, dtype
        self.out_bytes = math.prod(out_shape) * dtype.itemsize
        self.remaining = count
        self.stop_at = math.inf if max_seconds is None else time.perf_counter() + max_seconds
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.latencies: list[float] = []
        self.batch_sizes: list[int] = []
        self.statuses: Counter[str] = Counter()
        self.sample: np.ndarray | None = None

    async def run(self, clients: int) -> None:
        import grpc
        from tritonclient.grpc import service_pb2

        answer = service_pb2.ModelInferResponse
        options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", -1),
                   ("grpc.max_send_message_length", -1)]
        channels = [grpc.aio.insecure_channel(self.target, options=options) for _ in range(clients)]

        async def client(channel: Any) -> None:
            call = channel.unary_unary(METHOD)  # bytes in, bytes out: the request is serialized once
            while self.remaining > 0 and time.perf_counter() < self.stop_at:
                self.remaining -= 1
                t0 = time.perf_counter()
                try:
                    data = await call(self.request, timeout=self.timeout, metadata=self.metadata)
                except grpc.aio.AioRpcError as exc:
                    self.statuses[exc.code().name] += 1
                    continue
                dt = time.perf_counter() - t0
                response = answer.FromString(data)
                raw = response.raw_output_contents
                if len(raw) != 1 or len(raw[0]) != self.out_bytes:
                    self.statuses["wrong_size"] += 1
                    continue
                self.statuses["OK"] += 1
                self.latencies.append(dt)
                self.batch_sizes.append(response.parameters["deconv_batch_size"].int64_param)
                if self.sample is None:
                    self.sample = np.frombuffer(raw[0], dtype=self.dtype).reshape(self.out_shape).copy()

        try:
            await asyncio.gather(*(client(c) for c in channels))
        finally:
            for channel in channels:
                await channel.close()


async def drive(args: argparse.Namespace, x: np.ndarray) -> tuple[dict[str, Any], np.ndarray | None]:
    """One load process: ``args.requests`` requests of ``args.protocol`` from ``args.clients`` clients."""
    await asyncio.sleep(max(0.0, args.start_at - time.time()))
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    if args.protocol == "grpc":
        load = GrpcLoad(args.grpc, grpc_request(args.layer, x), output_shape(args, x), x.dtype, args.requests,
                        args.timeout, args.max_seconds, args.api_key)
        await load.run(args.clients)
        sample = load.sample
    else:
        wire = kserve_wire(args, x)
        if args.api_key:
            wire.headers["authorization"] = f"Bearer {args.api_key}"
        load = RawLoad(args.url, wire.path, b"", wire.content_type, args.requests, args.timeout, wire=wire,
                          max_seconds=args.max_seconds)
        await load.run(args.clients)
        sample = load.sample if isinstance(load.sample, np.ndarray) else None
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"latencies_ms": [v * 1e3 for v in load.latencies], "batch_sizes": load.batch_sizes,
            "statuses": dict(load.statuses), "wall_s": wall,
            "client_cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)}, sample


def worker_main(args: argparse.Namespace) -> None:
    sl.sigterm_as_sigint()
    x = make_input(args)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        result, sample = runner.run(drive(args, x))
    result["end"] = time.time()
    if sample is not None:
        np.save(args.result_file + ".npy", sample, allow_pickle=False)
    Path(args.result_file).write_text(json.dumps(result))


def drive_processes(args: argparse.Namespace, protocol: str, height: int, width: int, count: int,
                    max_seconds: float | None) -> tuple[dict[str, Any], np.ndarray | None]:
    """``count`` requests from ``args.clients`` clients over ``args.procs`` load processes (this module with
    ``--worker``), from a common start time; the summed figures and one output."""
    procs = max(1, min(args.procs, args.clients))
    start_at = time.time() + 1.0 + 0.25 * procs

    def worker_args(clients: int, n: int, result_file: Path) -> list[str]:
        extra = [] if max_seconds is None else ["--max-seconds", str(max_seconds)]
        extra += ["--api-key", args.api_key] if args.api_key else []
        return ["--protocol", protocol, "--url", args.url, "--grpc", args.grpc, "--clients", str(clients),
                "--requests", str(n), "--layer", args.layer, "--repository", str(args.repository), "--batch",
                str(args.batch), "--height", str(height), "--width", str(width), "--timeout", str(args.timeout),
                "--start-at", repr(start_at), "--result-file", str(result_file), *extra]

    with tempfile.TemporaryDirectory(prefix="deconv-grpc-load-") as tmp:
        children, files = sl.start_load_processes("bench.serving.grpc_load", worker_args, procs, args.clients,
                                                  count, tmp)
        try:
            parts = sl.wait_load_processes(children, files, args.timeout * 4 + count)
        finally:
            sl.stop_workers(children)
        sample = next((np.load(f"{f}.npy", allow_pickle=False) for f in files if Path(f"{f}.npy").exists()), None)
    end = max(p["end"] for p in parts)
    return sl.summarize(count, parts, end - start_at), sample


def start_server(args: argparse.Namespace, workdir: Path) -> subprocess.Popen[bytes]:
    """``python -m service`` on free HTTP and gRPC ports of 127.0.0.1 (sets ``args.url`` and ``args.grpc``)."""
    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DECONV_LAYER_REPOSITORY": str(args.repository),
           "DECONV_DEVICES": args.devices, "DECONV_LOG_LEVEL": "warning",
           "DECONV_HTTP_PROCESSES": str(args.http_processes), "DECONV_GRPC_PORT": str(grpc_port),
           "DECONV_MAX_QUEUE_SIZE": str(max(256, 2 * args.clients))}
    log = open(workdir / "server.log", "wb")  # noqa: SIM115  (the child keeps writing to it)
    proc = subprocess.Popen([sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port)], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    args.url, args.grpc = f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
    wait_ready(args.url, proc, args.startup_timeout, workdir / "server.log",
               expected_http_processes(args.http_processes, args.devices))
    return proc


def measure(args: argparse.Namespace, server_pid: int | None, size: tuple[str, int, int], protocol: str,
            warm: bool) -> dict[str, Any]:
    """One protocol at one size: a warm-up (``warm``), then the measured requests."""
    name, height, width = size
    if warm and args.warmup:
        drive_processes(args, protocol, height, width, args.warmup, None)
    cpu0 = process_tree_cpu(server_pid) if server_pid else {}
    result, sample = drive_processes(args, protocol, height, width, args.requests, args.max_seconds)
    cpu1 = process_tree_cpu(server_pid) if server_pid else {}
    sized = argparse.Namespace(**{**vars(args), "height": height, "width": width})
    x = make_input(sized)
    out_bytes = math.prod(output_shape(sized, x)) * x.itemsize
    cpu_s = sum(cpu1.get(k, 0.0) - v for k, v in cpu0.items())
    result.update(size=name, protocol=protocol, input_bytes=x.nbytes, output_bytes=out_bytes,
                  payload_mb_per_s=result["requests_per_s"] * (x.nbytes + out_bytes) / 1e6,
                  server_cpu_ms_per_request=1e3 * cpu_s / result["ok"] if server_pid and result["ok"] else None,
                  rel_err=check_output(sized, x, sample) if sample is not None else None)
    return result


def medians(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (size, protocol): the median of each figure over the rounds (the first round's other fields)."""
    figures = ("requests_per_s", "payload_mb_per_s", "p50_ms", "p99_ms", "mean_batch_size",
               "server_cpu_ms_per_request", "client_cpu_s")
    out = []
    for i, first in enumerate(rounds[0]):
        row = dict(first)
        for key in figures:
            values = [r[i][key] for r in rounds if r[i][key] is not None]
            row[key] = statistics.median(values) if values else None
        row["errors"] = sum(v for r in rounds for k, v in r[i]["statuses"].items() if k not in ("OK", "200"))
        row["rel_err"] = max((r[i]["rel_err"] for r in rounds if r[i]["rel_err"] is not None), default=None)
        out.append(row)
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print(f"{'size':>6} {'protocol':>8} {'req/s':>9} {'MB/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'batch':>6} "
          f"{'srv CPU ms/req':>14} {'errors':>6} {'rel err':>8}")
    for r in rows:
        print(f"{r['size']:>6} {r['protocol']:>8} {fmt(r['requests_per_s'], '9.1f')} "
              f"{fmt(r['payload_mb_per_s'], '8.1f')} {fmt(r['p50_ms'], '8.2f')} {fmt(r['p99_ms'], '8.2f')} "
              f"{fmt(r['mean_batch_size'], '6.2f')} {fmt(r['server_cpu_ms_per_request'], '14.3f')} "
              f"{r['errors']:>6} {fmt(r['rel_err'], '8.1e')}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="HTTP URL of a running server (with --grpc); default: start one here")
    p.add_argument("--grpc", help="host:port of the running server's gRPC API (DECONV_GRPC_PORT)")
    p.add_argument("--api-key", help="the running server's DECONV_API_KEY, sent by both protocols")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"name=HxW of the input, comma list ({DEFAULT_SIZES})")
    p.add_argument("--protocols", default=",".join(PROTOCOLS), help="comma list of http, grpc (measured in turn)")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (connections) per protocol")
    p.add_argument("--requests", type=int, default=5000, help="requests per size and protocol and round")
    p.add_argument("--max-seconds", type=float, default=None, help="stop sending after this long (per measurement)")
    p.add_argument("--warmup", type=int, default=200, help="warm-up requests per size and protocol (first round)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the whole sequence; report medians")
    p.add_argument("--layer", default="demo")
    p.add_argument("--repository", type=Path, default=ROOT / "layers")
    p.add_argument("--batch", type=int, default=1, help="samples per request")
    p.add_argument("--devices", default="auto", help="DECONV_DEVICES of the server started here")
    p.add_argument("--http-processes", type=http_processes_arg, default=1,
                   help="DECONV_HTTP_PROCESSES of the server started here (a count, or auto: the server's default)")
    p.add_argument("--procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                   help="load-generator processes")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout (s)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--protocol", default="grpc", help=argparse.SUPPRESS)
    p.add_argument("--height", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=16, help=argparse.SUPPRESS)
    sl.add_load_process_args(p)
    args = p.parse_args()
    if args.worker:
        worker_main(args)
        return
    if (args.url is None) != (args.grpc is None):
        p.error("--url and --grpc go together (a running server), or neither (one is started here)")
    sizes = parse_sizes(args.sizes)
    protocols = [s.strip() for s in args.protocols.split(",") if s.strip()]
    if not set(protocols) <= set(PROTOCOLS):
        p.error(f"--protocols: {', '.join(PROTOCOLS)}")
    sl.sigterm_as_sigint()
    with tempfile.TemporaryDirectory(prefix="deconv-grpc-bench-") as tmp:
        server = start_server(args, Path(tmp)) if args.url is None else None
        try:
            rounds = []
            for i in range(args.rounds):
                rounds.append([measure(args, server.pid if server else None, size, protocol, warm=i == 0)
                               for size in sizes for protocol in protocols])
        finally:
            if server is not None:
                stop_server(server)
    rows = medians(rounds)
    print(f"layer {args.layer}, {args.clients} clients over {max(1, min(args.procs, args.clients))} load "
          f"process(es), {args.rounds} round(s), server: {args.url} and gRPC {args.grpc}"
          f"{f', {args.http_processes} HTTP process(es), devices {args.devices}' if server else ''}")
    print_table(rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "results": rows,
                                        "rounds": rounds}, indent=1))
    if any(r["rel_err"] is None or r["rel_err"] > 2e-2 or r["ok"] == 0 for r in rows):
        sys.exit("an output did not match PyTorch in float64, or a measurement had no answer")


if __name__ == "__main__":
    main()
