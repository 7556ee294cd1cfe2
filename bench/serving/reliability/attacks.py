"""Attacks on JSON parsing, the drain and early refusals: raw sockets against ``python -m service`` on 127.0.0.1, each
returning its figures and checks (``ok``).

- ``long_integers``: JSON numbers of thousands of digits in every JSON body (KServe infer, gzip or not, the
  register bodies): a 400/422 or a value, never a 500, and the connection stays usable.
- ``json_bombs``: concurrent gzip bodies whose JSON would be tens of megabytes: 413 before it is parsed, while
  /health/live keeps answering (its latency measured) and the server's RSS stays flat.
- ``drain_connections``: SIGTERM while clients keep connecting and sending: every connection the server accepted
  gets an answer (200 before the drain, 503 with ``Connection: close`` after), later ones are refused.
- ``early_refusals``: a 401 (no key), a 429 (budget) and ``Expect: 100-continue`` without a key are answered before
  the body is sent; duplicate ``Authorization`` headers are 400.

The scenarios ``json``, ``drain_load`` and ``refusals`` of ``python -m bench.serving.reliability`` run them; the tests
in tests/reliability call them at bounded sizes."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import signal
import subprocess
import time
from collections import Counter
from typing import Any

import numpy as np

from bench.serving.reliability.server import (
    JSON,
    NPY,
    RssSampler,
    closed_by_server,
    head,
    host_port,
    npy,
    read_answer,
    request,
)

LONG = "9" * 5000  # past Python's 4,300 digits for int <-> str


def long_integer_bodies() -> dict[str, tuple[str, bytes, dict[str, str]]]:
    """Requests with a 5,000-digit integer somewhere in their JSON: name -> (path, body, headers)."""
    def infer(request: str) -> bytes:
        return request.replace("LONG", LONG).encode()

    x = '{"name": "input", "shape": [1, 16, 2, 2], "datatype": "FP32", "data": [' + ",".join(["0.5"] * 64) + "]}"
    kserve = {
        "ignored_id": infer('{"id": LONG, "inputs": [' + x + "]}"),
        "shape": infer('{"inputs": [{"name": "input", "shape": [1, LONG, 2, 2], "datatype": "FP32", "data": []}]}'),
        "data": infer('{"inputs": [{"name": "input", "shape": [1, 16, 2, 2], "datatype": "FP32", "data": [LONG'
                      + ", 0.5" * 63 + "]}]}"),
        "timeout": infer('{"parameters": {"timeout": LONG}, "inputs": [' + x + "]}"),
        "negative_in_outputs": infer('{"inputs": [' + x + '], "outputs": [{"name": "output", "parameters": '
                                     '{"binary_data": true, "shared_memory_offset": -LONG}}]}'),
    }
    infer_path = "/v2/models/demo/infer"
    out: dict[str, tuple[str, bytes, dict[str, str]]] = {}
    for name, body in kserve.items():
        out[f"kserve_{name}"] = (infer_path, body, {"Content-Type": JSON})
        out[f"kserve_{name}_gzip"] = (infer_path, gzip.compress(body), {"Content-Type": JSON,
                                                                        "Content-Encoding": "gzip"})
    head = infer('{"id": LONG, "inputs": [{"name": "input", "shape": [1, 16, 2, 2], "datatype": "FP32", '
                 '"parameters": {"binary_data_size": 256}}]}')
    out["kserve_binary_header"] = (infer_path, head + bytes(256), {
        "Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))})
    out["system_register_byte_size"] = ("/v2/systemsharedmemory/region/long/register",
                                        infer('{"key": "/deconv-none", "offset": 0, "byte_size": LONG}'),
                                        {"Content-Type": JSON})
    out["system_register_offset"] = ("/v2/systemsharedmemory/region/long/register",
                                     infer('{"key": "/deconv-none", "offset": LONG, "byte_size": 8}'),
                                     {"Content-Type": JSON})
    out["cuda_register_device"] = ("/v2/cudasharedmemory/region/long/register",
                                   infer('{"raw_handle": {"b64": ""}, "device_id": LONG, "byte_size": 8}'),
                                   {"Content-Type": JSON})
    out["float_literal"] = (infer_path, infer('{"inputs": [{"name": "input", "shape": [1, 16, 2, 2], "datatype": '
                                              '"FP32", "data": [LONG.5e-99999' + ", 0.5" * 63 + "]}]}"),
                            {"Content-Type": JSON})
    return out


async def long_integers(server: Any, *, api_key: str | None = None) -> dict[str, Any]:
    """Every body of ``long_integer_bodies`` on one kept-alive connection, then a valid request on it: each a 4xx
    (never a 500, never a traceback) and the connection still serving (no close, no reset)."""
    host, port = host_port(server.url)
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reader, writer = await asyncio.open_connection(host, port)
    answers: dict[str, Any] = {}
    reconnects = 0

    async def send(path: str, body: bytes, headers: dict[str, str]) -> tuple[int | str, dict[str, str], bytes]:
        nonlocal reader, writer, reconnects
        extra = "".join(f"{k}: {v}\r\n" for k, v in {**headers, **auth}.items())
        writer.write(f"POST {path} HTTP/1.1\r\nHost: deconv\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
                     + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        answer = await read_answer(reader, 60)
        if not isinstance(answer[0], int) or answer[1].get("connection", "").lower() == "close":
            reconnects += 1
            writer.close()
            reader, writer = await asyncio.open_connection(host, port)
        return answer

    for name, (path, body, headers) in long_integer_bodies().items():
        status, _, text = await send(path, body, headers)
        answers[name] = {"status": status, "error": text.decode(errors="replace")[:160]}
    x = '{"inputs": [{"name": "input", "shape": [1, 16, 2, 2], "datatype": "FP32", "data": [' + ",".join(
        ["0.5"] * 64) + "]}]}"
    final = (await send("/v2/models/demo/infer", x.encode(), {"Content-Type": JSON}))[0]
    writer.close()
    statuses = dict(Counter(str(a["status"]) for a in answers.values()))
    # A float literal of any length is a float (here 0.0): the request is valid.
    checks = {"float_literal_200": answers["float_literal"]["status"] == 200,
              "every_other_answer_4xx": all(isinstance(a["status"], int) and 400 <= a["status"] < 500
                                            for n, a in answers.items() if n != "float_literal"),
              "no_traceback": not any("Traceback" in a["error"] for a in answers.values()),
              "connection_kept": reconnects == 0, "valid_request_after_200": final == 200,
              "no_traceback_in_log": "Traceback" not in server.log()}
    return {"statuses": statuses, "answers": answers, "reconnects": reconnects, "final_status": final,
            "checks": checks, "ok": all(checks.values())}


def json_bomb(shape: tuple[int, ...], value: str = "0.5") -> bytes:
    """A gzip KServe JSON request of ``shape`` whose data is ``value`` repeated: tens of kilobytes that decompress
    to tens of megabytes of JSON."""
    count = int(np.prod(shape))
    head = json.dumps({"inputs": [{"name": "input", "shape": list(shape), "datatype": "FP32", "data": []}]})
    before, _, after = head.partition('"data": []')
    compressor = gzip.GzipFile(fileobj=(buf := __import__("io").BytesIO()), mode="wb", compresslevel=9)
    compressor.write(f'{before}"data": ['.encode())
    piece = (value + ",").encode() * 65536
    left = count
    while left > 65536:
        compressor.write(piece)
        left -= 65536
    compressor.write((value + ",").encode() * (left - 1) + value.encode() + b"]" + after.encode())
    compressor.close()
    return buf.getvalue()


async def _probe_live(url: str, stop: asyncio.Event, latencies: list[float]) -> None:
    """GET /health/live on one kept-alive connection, one after the other, until ``stop``: each latency (s)."""
    host, port = host_port(url)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            writer.write(b"GET /health/live HTTP/1.1\r\nHost: deconv\r\n\r\n")
            await writer.drain()
            status, _, _ = await read_answer(reader, 60)
            latencies.append(time.perf_counter() - t0)
            if status != 200:
                latencies.append(float("inf"))
                return
            await asyncio.sleep(0.005)
    finally:
        writer.close()


async def json_bombs(server: Any, *, bombs: int = 8, rounds: int = 1, shape: tuple[int, ...] = (14, 16, 256, 256),
                     value: str = "0.5", gzipped: bool = True, binary_output: bool = False,
                     expect: int = 413) -> dict[str, Any]:
    """``rounds`` waves of ``bombs`` gzip KServe JSON requests at once, each tens of kilobytes decompressing to
    about ``prod(shape)`` x 4 bytes of JSON: every one 413 without being parsed (the server's RSS grows far less than
    the parse would take, ~16 bytes a byte of JSON), while /health/live is probed on a kept-alive connection (its
    latencies reported). With ``expect=200`` and a shape whose JSON fits the limit (``binary_output``: the answer as
    binary), the same figures for requests the server parses and computes."""
    body = json_bomb(shape, value)
    headers = {"Content-Type": JSON, "Content-Encoding": "gzip"}
    if binary_output or not gzipped:
        request_json = gzip.decompress(body)
        if binary_output:
            request_json = request_json[:-1] + b', "parameters": {"binary_data_output": true}}'
        body = gzip.compress(request_json) if gzipped else request_json
        headers = {"Content-Type": JSON, **({"Content-Encoding": "gzip"} if gzipped else {})}
    rss = RssSampler(server.pid)
    stop = asyncio.Event()
    latencies: list[float] = []
    probe = asyncio.create_task(_probe_live(server.url, stop, latencies))
    while not latencies:  # the probe connection serves before the bombs come
        await asyncio.sleep(0.005)
    idle = len(latencies)
    t0 = time.perf_counter()
    answers = []
    for _ in range(rounds):
        answers += await asyncio.gather(*(request(server.url, "POST", "/v2/models/demo/infer", body, headers, 120)
                                          for _ in range(bombs)))
    wall = time.perf_counter() - t0
    stop.set()
    await probe
    figures = rss.stop()
    during = latencies[idle:] or latencies
    counted = dict(Counter(str(a[0]) for a in answers))
    growth = figures["rss_peak_mib"] - figures["rss_before_mib"]
    checks = {f"every_answer_{expect}": counted == {str(expect): bombs * rounds},
              "message_says_binary": expect != 413 or all(b"binary" in a[2] for a in answers),
              "rss_growth_under_256_mib": expect != 413 or growth < 256,
              "live_answered_200": all(t != float("inf") for t in latencies)}
    return {"bombs": bombs, "rounds": rounds, "request_bytes": len(body), "gzip": gzipped,
            "json_bytes_each": int(np.prod(shape)) * (len(value) + 1), "statuses": counted,
            "message": answers[0][2].decode(errors="replace")[:240] if expect == 413 else "", "wall_s": round(wall, 2),
            "live_probes": len(during), "live_p50_ms": round(1000 * float(np.median(during)), 1),
            "live_p99_ms": round(1000 * float(np.percentile(during, 99)), 1),
            "live_max_ms": round(1000 * max(during), 1), "rss_growth_mib": round(growth, 1), **figures,
            "checks": checks, "ok": all(checks.values())}


async def drain_connections(server: Any, *, clients: int = 32, before: int = 200,
                            layer: str = "demo") -> dict[str, Any]:
    """``clients`` clients each connect, send one request, read the answer and start again; SIGTERM once ``before``
    answers came. Every connection the server accepted (the client's connect succeeded) must get an answer: 200
    before the drain, 503 with ``Connection: close`` during it; never a close or reset after sending. Each client
    stops at its first refused connection after the signal (the port closed); a handshake the closing listener
    resets before the client sent anything counts as refused (nothing was sent: the client may retry); the server
    exits 0."""
    host, port = host_port(server.url)
    body = npy(np.zeros((1, 16, 8, 8), np.float32))
    message = head(f"/deconv?layer={layer}", len(body)) + body
    outcomes: Counter[str] = Counter()
    after_signal: Counter[str] = Counter()
    signalled = asyncio.Event()
    enough = asyncio.Event()
    answers = 0

    async def client() -> None:
        nonlocal answers
        while True:
            late = signalled.is_set()
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except ConnectionRefusedError:
                outcomes["refused"] += 1
                if late:
                    return
                continue
            except ConnectionResetError:
                if not signalled.is_set():
                    outcomes["connect ConnectionResetError"] += 1
                    return
                # The listener closed while this handshake was in its queue: the client sent nothing and may retry,
                # as after a refusal.
                outcomes["reset before sending"] += 1
                return
            except OSError as exc:
                outcomes[f"connect {type(exc).__name__}"] += 1
                return
            outcomes["accepted"] += 1
            try:
                writer.write(message)
                with contextlib.suppress(ConnectionError):
                    await writer.drain()
                status, headers, _ = await read_answer(reader, 60)
            finally:
                writer.close()
            key = str(status) + (" close" if headers.get("connection", "").lower() == "close" else "")
            outcomes[key] += 1
            if late or signalled.is_set():
                after_signal[key] += 1
            if isinstance(status, int):
                answers += 1
                if answers >= before:
                    enough.set()
            if not isinstance(status, int) and signalled.is_set():
                return  # this connection's answer was lost: counted; the next ones would only repeat it

    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    await enough.wait()
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    signalled.set()
    await asyncio.gather(*tasks)
    try:
        code: int | None = await asyncio.to_thread(server.proc.wait, 60)
    except subprocess.TimeoutExpired:
        code = None
    exit_s = time.monotonic() - t0
    answered = sum(n for k, n in outcomes.items() if k.split(" ")[0].isdigit())
    not_connected = ("accepted", "refused", "reset before sending")
    unanswered = {k: n for k, n in outcomes.items() if k not in not_connected and not k[0].isdigit()}
    log = server.log()
    checks = {"every_accepted_connection_answered": answered == outcomes["accepted"] and not unanswered,
              "only_200_or_503_close": all(k in ("200", "200 close", "503 close") for k in outcomes
                                           if k.split(" ")[0].isdigit()),
              "later_clients_refused": outcomes["refused"] + outcomes["reset before sending"] >= clients,
              "exit_status_0": code == 0,
              "nothing_closed_unanswered_in_log": "closed" not in "".join(
                  line for line in log.splitlines() if "no HTTP process took" in line),
              "no_traceback_in_log": "Traceback" not in log}
    return {"clients": clients, "accepted": outcomes["accepted"], "answered": answered,
            "outcomes": dict(outcomes), "after_signal": dict(after_signal), "unanswered": unanswered,
            "exit_status": code, "exit_after_signal_s": round(exit_s, 2), "checks": checks, "ok": all(checks.values())}


REFUSALS_KEY = "refusals-key"


# A budget of 2 MiB (a 4 MiB body does not fit) and a body timeout far beyond any wait here.
REFUSALS_ENV = {"DECONV_API_KEY": REFUSALS_KEY, "DECONV_MAX_INFLIGHT_BYTES": str(2 * 2**20),
                "DECONV_BODY_TIMEOUT_S": "600"}


async def _refused(url: str, head: bytes, sent: bytes, timeout_s: float) -> dict[str, Any]:
    """Send ``head`` and the first bytes ``sent`` of a body it declares larger, then wait for the answer."""
    host, port = host_port(url)
    reader, writer = await asyncio.open_connection(host, port)
    t0 = time.perf_counter()
    try:
        writer.write(head + sent)
        await writer.drain()
        status, headers, body = await read_answer(reader, timeout_s)
        after_s = time.perf_counter() - t0
        closed = await closed_by_server(reader, timeout_s) if isinstance(status, int) else False
    finally:
        writer.close()
    return {"status": status, "after_ms": round(1000 * after_s, 1), "connection": headers.get("connection"),
            "retry_after": headers.get("retry-after"), "closed": closed, "type": body[:200].decode(errors="replace")}


async def early_refusals(server: Any, *, wait_s: float = 60.0) -> dict[str, Any]:
    """Against a server with ``REFUSALS_ENV``: a request without the key, one asking ``Expect: 100-continue``
    without the key, and one whose declared body does not fit the budget, each sending only part of its body (or
    none): each answered at once (401, 401 rather than ``100 Continue``, 429 with Retry-After), with ``Connection:
    close``, then closed. Then duplicate Authorization headers, right key first or wrong key first: 400."""
    auth = f"Authorization: Bearer {REFUSALS_KEY}\r\n"
    infer = "/v2/models/demo/infer"
    declared = 4 * 2**20
    out = {
        "no_key": await _refused(server.url, head("/deconv?layer=demo", declared, content_type=NPY),
                                 b"\x93NUMPY", wait_s),
        "no_key_kserve": await _refused(server.url, head(infer, declared, extra="Inference-Header-Content-"
                                                         "Length: 100\r\n", content_type=JSON), b"{", wait_s),
        "expect_100_no_key": await _refused(server.url, head("/deconv?layer=demo", declared, content_type=NPY,
                                                             extra="Expect: 100-continue\r\n"), b"", wait_s),
        "over_budget": await _refused(server.url, head("/deconv?layer=demo", declared, content_type=NPY,
                                                       extra=auth), b"\x93NUMPY", wait_s),
    }
    x = npy(np.zeros((1, 16, 8, 8), np.float32))
    dup = {}
    for name, keys in (("right_then_wrong", (REFUSALS_KEY, "wrong")), ("wrong_then_right", ("wrong", REFUSALS_KEY))):
        extra = "".join(f"Authorization: Bearer {k}\r\n" for k in keys)
        dup[name] = await _refused(server.url, head("/deconv?layer=demo", len(x), extra=extra,
                                                    content_type=NPY), x, wait_s)
    checks = {"no_key_401_at_once": out["no_key"]["status"] == 401 and out["no_key_kserve"]["status"] == 401,
              "expect_100_answered_401": out["expect_100_no_key"]["status"] == 401,
              "over_budget_429_with_retry_after": out["over_budget"]["status"] == 429
              and out["over_budget"]["retry_after"] is not None,
              "refusals_close_the_connection": all(r["connection"] == "close" and r["closed"] for r in out.values()),
              "duplicate_authorization_400": all(r["status"] == 400 for r in dup.values())}
    return {**out, "duplicate_authorization": dup, "checks": checks, "ok": all(checks.values())}
