"""``deconv-client``: list layers, run one tensor file through a layer, or load-test a layer.

    deconv-client layers
    deconv-client infer --layer demo in.npy -o out.npy
    deconv-client bench --layer demo --batch 8 --requests 500 --concurrency 32
    deconv-client ready --wait 120

Global options (before or after the command): ``--url`` (default ``$DECONV_URL`` or http://127.0.0.1:8000),
``--api-key`` (default ``$DECONV_API_KEY``), ``--timeout`` seconds, ``--no-retry``, ``-v``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, TextIO

import httpx
import numpy as np

from ._tensor import EncodedInput, encode_input, media_type_for
from ._version import __version__
from .client import DEFAULT_TIMEOUT, DEFAULT_URL, Client
from .codec import (
    NPY_MEDIA_TYPE,
    Payload,
    RawTensor,
    decode_npy,
    decode_safetensors,
    encode_npy,
    encode_safetensors,
    media_type_of,
)
from .errors import CodecError, DeconvError
from .layers import LayerInfo
from .retry import Retry

__all__ = ["build_parser", "main"]

_NUMPY_DTYPES = {"float16", "float32", "float64"}


def _add_global_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    # The sub-commands repeat the global options with SUPPRESS defaults, so that they may come after the
    # command too without resetting a value given before it.
    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    group = parser.add_argument_group("server options")
    group.add_argument(
        "--url",
        default=default(os.environ.get("DECONV_URL", DEFAULT_URL)),
        help=f"server base URL (default: $DECONV_URL or {DEFAULT_URL})",
    )
    group.add_argument(
        "--api-key",
        default=default(os.environ.get("DECONV_API_KEY")),
        help="API key, sent as 'Authorization: Bearer KEY' (default: $DECONV_API_KEY)",
    )
    group.add_argument(
        "--timeout",
        type=float,
        default=default(DEFAULT_TIMEOUT),
        help=f"seconds for connecting, sending and receiving (default: {DEFAULT_TIMEOUT:g})",
    )
    group.add_argument(
        "--no-retry",
        action="store_true",
        default=default(False),
        help="do not retry on 429/503 or connection errors",
    )
    group.add_argument(
        "-v", "--verbose", action="count", default=default(0), help="log retries (-v) and every request (-vv)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``deconv-client`` (global options read ``DECONV_URL``/``DECONV_API_KEY`` now)."""
    parser = argparse.ArgumentParser(
        prog="deconv-client", description="Client of the deconv transposed-convolution service."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_global_options(parser, suppress=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("layers", help="list the served layers")
    p.add_argument("--json", action="store_true", help="print the server's JSON")
    _add_global_options(p, suppress=True)

    p = commands.add_parser("infer", help="run a layer on one tensor file (.npy or .safetensors)")
    p.add_argument("--layer", required=True, help="layer name")
    p.add_argument("input", type=Path, help="input tensor, [N, C_in, H, W] or [C_in, H, W]")
    p.add_argument(
        "-o", "--output", type=Path, required=True, help="output file; .safetensors or .npy picks the format"
    )
    p.add_argument("--deadline-ms", type=float, help="fail if not started within this many ms")
    _add_global_options(p, suppress=True)

    p = commands.add_parser("bench", help="concurrent requests against one layer: throughput and latency")
    p.add_argument("--layer", required=True, help="layer name")
    p.add_argument("--input", type=Path, help="a .npy/.safetensors tensor to send (default: random data)")
    p.add_argument("--batch", type=int, default=1, help="N of the random input (default: 1)")
    p.add_argument("--height", type=int, default=32, help="H of the random input (default: 32)")
    p.add_argument("--width", type=int, default=32, help="W of the random input (default: 32)")
    p.add_argument("-n", "--requests", type=int, default=200, help="requests to time (default: 200)")
    p.add_argument("-c", "--concurrency", type=int, default=16, help="requests in flight (default: 16)")
    p.add_argument("--warmup", type=int, default=5, help="untimed requests first (default: 5)")
    p.add_argument("--deadline-ms", type=float, help="X-Deadline-Ms sent with every request")
    p.add_argument("--seed", type=int, default=0, help="seed of the random input (default: 0)")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress line on stderr (default: when stderr is a terminal)",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    _add_global_options(p, suppress=True)

    p = commands.add_parser("ready", help="exit 0 if the server is ready, 1 if not")
    p.add_argument("--wait", type=float, default=0.0, help="poll up to this many seconds (default: 0)")
    _add_global_options(p, suppress=True)
    return parser


def _pair(values: tuple[int, int]) -> str:
    return f"{values[0]}x{values[1]}" if values[0] != values[1] else str(values[0])


def _print_table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip(), file=out)


def _cmd_layers(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    layers = client.layers()
    if args.json:
        print(json.dumps({"layers": [dict(layer.raw) for layer in layers]}, indent=2), file=out)
        return 0
    rows = [["name", "in", "out", "kernel", "stride", "padding", "out_pad", "dilation", "groups", "dtype", "prec"]]
    for layer in layers:
        rows.append(
            [
                layer.name,
                str(layer.in_channels),
                str(layer.out_channels),
                _pair(layer.kernel_size),
                _pair(layer.stride),
                _pair(layer.padding),
                _pair(layer.output_padding),
                _pair(layer.dilation),
                str(layer.groups),
                layer.dtype,
                layer.precision or "-",
            ]
        )
    _print_table(rows, out)
    return 0


def _tensor_file_bytes(path: Path) -> bytes:
    """The bytes of a file that starts like a .npy or safetensors file; else a ``CodecError`` that says what it is."""
    data = path.read_bytes()
    if not data:
        raise CodecError(f"{path} is empty: expected a tensor file (.npy or safetensors)")
    if data.startswith(b"\x93NUMPY") or (len(data) > 8 and data[8:9] == b"{"):
        return data
    raise CodecError(f"{path} is not a tensor file: expected .npy or safetensors, it starts with {data[:8]!r}")


def _read_tensor_file(path: Path) -> tuple[Payload, str, tuple[int, ...]]:
    """A tensor file as a request payload (re-encoded only if it is Fortran-ordered), its dtype and shape."""
    data = _tensor_file_bytes(path)
    if media_type_of(None, data) == NPY_MEDIA_TYPE:
        array = decode_npy(data)
        return encode_npy(array), str(array.dtype), tuple(array.shape)
    try:
        tensor = decode_safetensors(data)
    except CodecError as exc:
        raise CodecError(f"{path}: neither .npy nor a one-tensor safetensors file ({exc})") from None
    payload = encode_safetensors(RawTensor(tensor.dtype, tensor.shape, tensor.data, "input"))
    return payload, tensor.dtype, tensor.shape


def _describe_body(body: bytes | bytearray, content_type: str | None) -> str:
    if media_type_of(content_type, body) == NPY_MEDIA_TYPE:
        array = decode_npy(body)
        return f"{array.dtype} {list(array.shape)}"
    tensor = decode_safetensors(body)
    return f"{tensor.dtype} {list(tensor.shape)}"


def _cmd_infer(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    payload, dtype, shape = _read_tensor_file(args.input)
    accept = media_type_for("safetensors" if args.output.suffix == ".safetensors" else "npy")
    body, headers = client._post_deconv(args.layer, payload, accept=accept, deadline_ms=args.deadline_ms)
    described = _describe_body(body, headers.get("content-type"))  # validates before writing
    args.output.write_bytes(body)
    batch, queue = headers.get("x-deconv-batch-size"), headers.get("x-deconv-queue-ms")
    server = f" (server batch size {batch}, queued {queue} ms)" if batch is not None else ""
    print(f"{args.input} {dtype} {list(shape)} -> {args.output} {described}{server}", file=out)
    return 0


def _cmd_ready(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    end = time.monotonic() + max(0.0, args.wait)
    while True:
        try:
            if client.ready():
                print("ready", file=out)
                return 0
            reason = "not ready"
        except DeconvError as exc:  # unreachable yet: keep polling while --wait lasts
            reason = str(exc)
        if time.monotonic() >= end:
            print(f"not ready: {reason}", file=out)
            return 1
        time.sleep(min(0.5, max(0.0, end - time.monotonic())))


def _bench_input(layer: LayerInfo, args: argparse.Namespace) -> Any:
    if args.input is not None:
        data = _tensor_file_bytes(args.input)
        if media_type_of(None, data) == NPY_MEDIA_TYPE:
            return decode_npy(data)
        tensor = decode_safetensors(data)
        if tensor.dtype != "BF16":
            return tensor.to_numpy()
        import torch

        return torch.frombuffer(bytearray(tensor.data), dtype=torch.bfloat16).reshape(tensor.shape)
    shape = (args.batch, layer.in_channels, args.height, args.width)
    rng = np.random.default_rng(args.seed)
    if layer.dtype in _NUMPY_DTYPES:
        return rng.standard_normal(shape, dtype=np.float32).astype(layer.dtype)
    try:
        import torch
    except ImportError:
        raise CodecError(f"layer {layer.name} takes {layer.dtype}: install torch to benchmark it") from None
    generator = torch.Generator().manual_seed(args.seed)
    return torch.randn(shape, generator=generator).to(getattr(torch, layer.dtype))


class _Progress:
    """A one-line progress bar on a terminal stream, redrawn at most ten times a second."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total, self.stream = total, stream
        self.start = time.perf_counter()
        self.last = 0.0

    def update(self, done: int, failed: int, *, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < 0.1:
            return
        self.last = now
        width = 30
        filled = width * done // max(1, self.total)
        rate = done / max(now - self.start, 1e-9)
        errors = f", {failed} failed" if failed else ""
        bar = "#" * filled + "-" * (width - filled)
        self.stream.write(f"\r[{bar}] {done}/{self.total} {rate:7.1f} req/s{errors}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def _percentiles(latencies_s: list[float]) -> dict[str, float]:
    if not latencies_s:
        return {}
    ms = np.asarray(latencies_s) * 1000
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "mean": float(ms.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(ms.max()),
    }


def run_bench(
    client: Client,
    layer: str,
    encoded: EncodedInput,
    *,
    requests: int,
    concurrency: int,
    deadline_ms: float | None = None,
    progress: _Progress | None = None,
) -> dict[str, Any]:
    """Send ``requests`` copies of one encoded input, ``concurrency`` at a time; return the measurements."""
    lock = threading.Lock()
    latencies: list[float] = []
    batch_sizes: list[float] = []
    queue_ms: list[float] = []
    errors: Counter[str] = Counter()

    def one() -> None:
        t0 = time.perf_counter()
        try:
            body, headers = client._post_deconv(layer, encoded.payload, deadline_ms=deadline_ms)
            encoded.restore(body, headers.get("content-type"))
        except DeconvError as exc:
            with lock:
                errors[type(exc).__name__] += 1
            return
        elapsed = time.perf_counter() - t0
        with lock:
            latencies.append(elapsed)
            for name, values in (("x-deconv-batch-size", batch_sizes), ("x-deconv-queue-ms", queue_ms)):
                with contextlib.suppress(KeyError, ValueError):  # a server without these headers
                    values.append(float(headers[name]))

    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="deconv-bench") as pool:
        pending = {pool.submit(one) for _ in range(requests)}
        try:
            while pending:
                done, pending = wait(pending, timeout=0.1, return_when=FIRST_EXCEPTION)
                for future in done:
                    future.result()  # a bug (not a DeconvError) stops the run
                if progress is not None:
                    with lock:
                        finished, failed = len(latencies) + sum(errors.values()), sum(errors.values())
                    progress.update(finished, failed)
        except BaseException:  # Ctrl-C or a bug: do not send what has not started
            for future in pending:
                future.cancel()
            raise
    elapsed = time.perf_counter() - start
    if progress is not None:
        progress.update(requests, sum(errors.values()), force=True)
        progress.close()
    samples = encoded.shape[0] if len(encoded.shape) == 4 else 1
    return {
        "requests": requests,
        "ok": len(latencies),
        "failed": sum(errors.values()),
        "errors": dict(errors),
        "elapsed_s": elapsed,
        "throughput_rps": len(latencies) / elapsed if elapsed > 0 else 0.0,
        "throughput_samples_per_s": len(latencies) * samples / elapsed if elapsed > 0 else 0.0,
        "latency_ms": _percentiles(latencies),
        "server_batch_size_mean": float(np.mean(batch_sizes)) if batch_sizes else None,
        "server_queue_ms_mean": float(np.mean(queue_ms)) if queue_ms else None,
    }


def _cmd_bench(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.requests < 1 or args.concurrency < 1 or args.warmup < 0:
        raise ValueError("--requests and --concurrency must be at least 1, --warmup at least 0")
    info = client.layer(args.layer)
    x = _bench_input(info, args)
    encoded = encode_input(x)
    for _ in range(args.warmup):
        client.deconv(args.layer, x, deadline_ms=args.deadline_ms)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    result = run_bench(
        client,
        args.layer,
        encoded,
        requests=args.requests,
        concurrency=args.concurrency,
        deadline_ms=args.deadline_ms,
        progress=_Progress(args.requests, sys.stderr) if show else None,
    )
    result.update(
        layer=args.layer,
        input_shape=list(encoded.shape),
        input_dtype=str(x.dtype).removeprefix("torch."),
        concurrency=args.concurrency,
        url=str(client.base_url),
    )
    if args.json:
        print(json.dumps(result, indent=2), file=out)
    else:
        lat = result["latency_ms"]
        size_mib = encoded.payload.nbytes / 2**20
        print(
            f"layer {args.layer}: {result['input_dtype']} {result['input_shape']} ({size_mib:.2f} MiB/request), "
            f"{args.requests} requests, concurrency {args.concurrency}",
            file=out,
        )
        print(f"ok {result['ok']}, failed {result['failed']} {result['errors'] or ''}".rstrip(), file=out)
        print(
            f"elapsed {result['elapsed_s']:.3f} s: {result['throughput_rps']:.1f} req/s, "
            f"{result['throughput_samples_per_s']:.1f} samples/s",
            file=out,
        )
        if lat:
            print(
                "latency ms: " + "  ".join(f"{k} {lat[k]:.2f}" for k in ("mean", "p50", "p90", "p99", "max")),
                file=out,
            )
        if result["server_batch_size_mean"] is not None:
            queue = result["server_queue_ms_mean"]
            print(
                f"server: mean batch size {result['server_batch_size_mean']:.2f}"
                + (f", mean queue {queue:.2f} ms" if queue is not None else ""),
                file=out,
            )
    return 0 if result["failed"] == 0 else 1


_COMMANDS = {"layers": _cmd_layers, "infer": _cmd_infer, "bench": _cmd_bench, "ready": _cmd_ready}


def main(argv: Sequence[str] | None = None, *, transport: httpx.BaseTransport | None = None) -> int:
    """Run ``deconv-client`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    ``transport`` replaces the network (tests).
    """
    args = build_parser().parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.INFO if args.verbose >= 2 else logging.WARNING)
    retry: Retry | bool = not args.no_retry
    try:
        with Client(args.url, api_key=args.api_key, timeout=args.timeout, retry=retry, transport=transport) as client:
            return _COMMANDS[args.command](client, args, sys.stdout)
    except (DeconvError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
