"""The reliability scenarios on the server's limits, over raw connections: slow request heads (slowloris), a huge
header, bodies declared large that never arrive, large bodies against the bytes-in-flight budget, KServe JSON answers
too large to encode, many requests on one connection, and SIGTERM with kept-alive connections open."""

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

import httpx
import numpy as np

from bench.serving.reliability.server import (
    NPY,
    RssSampler,
    Server,
    closed_by_server,
    head,
    host_port,
    load,
    metric_sum,
    npy,
    read_answer,
    rss_bytes,
    scrape,
    wait_metric,
)


async def slow_heads(server: Server, *, connections: int, header_timeout_s: float) -> dict[str, Any]:
    """Slowloris: ``connections`` connections that send part of a request head (half of them nothing at all) and
    then wait. Each must get a 408 (or, having sent nothing, at least be closed) within twice the header timeout
    plus a margin for a busy machine."""
    host, port = host_port(server.url)
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
    host, port = host_port(server.url)
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
    host, port = host_port(server.url)
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
    host, port = host_port(server.url)
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
    host, port = host_port(server.url)
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
    host, port = host_port(server.url)
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
