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
- ``regions``, ``json``, ``drain_load``, ``refusals``: the attacks of ``regions.py`` and ``attacks.py`` beside this file
  (a region moved to another object while a request is held, a replaced object, long JSON integers, JSON bombs with
  /health/live probed, SIGTERM under a stream of new connections ``drain_runs`` times per mode, refusals before the
  body), in one and two HTTP processes.

    python -m bench.serving.reliability                      # bounded sizes (about a minute)
    python -m bench.serving.reliability --full --out docs/benchmarks/reliability-cpu.json

The tests in tests/reliability call the same functions with smaller sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.serving.reliability.attacks import (
    REFUSALS_ENV,
    REFUSALS_KEY,
    drain_connections,
    early_refusals,
    json_bombs,
    long_integers,
)
from bench.serving.reliability.limits import (
    budget_flood,
    budget_for,
    drain_keepalive,
    huge_header,
    json_output_flood,
    slow_heads,
    stalled_bodies,
)
from bench.serving.reliability.regions import SWAP_ENV, region_swap, replaced_object
from bench.serving.reliability.server import ROOT, Server, running
from bench.serving.reliability.under_load import (
    CANCELLATION_ENV,
    FAULTS,
    SIGTERM_ENV,
    cancellation,
    fault_run,
    overload,
    sigterm,
)

SCENARIOS = ("overload", "cancellation", "faults", "sigterm", "fuzz", "limits", "drain", "regions", "json",
             "drain_load", "refusals")
# Full-size runs (issue 7) and the bounded defaults.
FULL = {"overload_requests": 10_000, "cancellation_requests": 1_000, "sigterm_requests": 1_000, "fuzz_examples": 10_000,
        "slow_connections": 200, "stalled_bodies": 20, "header_bytes": 16 * 2**20, "drain_runs": 10,
        "region_trials": 5, "bombs": 8, "bomb_rounds": 20}
BOUNDED = {"overload_requests": 1_000, "cancellation_requests": 200, "sigterm_requests": 200, "fuzz_examples": 300,
           "slow_connections": 20, "stalled_bodies": 4, "header_bytes": 2**20, "drain_runs": 2,
           "region_trials": 1, "bombs": 4, "bomb_rounds": 2}


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


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"runs": runs, "ok": all(r["ok"] for r in runs), "checks": {str(i): r["ok"] for i, r in enumerate(runs)}}


def run_attacks(chosen: list[str], sizes: dict[str, int], base: dict[str, str], workdir: Path) -> dict[str, Any]:
    """Run the attacks (scenarios ``regions``, ``json``, ``drain_load``, ``refusals``) among ``chosen``, each on servers
    of its own; their results by name."""
    results: dict[str, Any] = {}

    def started(env: dict[str, str], log: str) -> Any:
        return Server.start({**base, **env}, workdir / log)

    def stopped(server: Any, coro: Any) -> dict[str, Any]:
        try:
            return asyncio.run(coro)  # type: ignore[no-any-return]
        finally:
            server.stop()

    if "regions" in chosen:
        out: dict[str, Any] = {}
        for processes in (1, 2):
            env = {"DECONV_HTTP_PROCESSES": str(processes)}
            out[f"swap_processes_{processes}"] = _summary([
                stopped(s := started({**SWAP_ENV, **env}, f"swap-{processes}-{i}.log"), region_swap(s))
                for i in range(sizes["region_trials"])])
            out[f"replaced_processes_{processes}"] = stopped(s := started(env, f"replaced-{processes}.log"),
                                                             replaced_object(s))
        results["regions"] = {**out, "ok": all(r["ok"] for r in out.values()),
                              "checks": {k: r["ok"] for k, r in out.items()}}
    if "json" in chosen:
        out = {}
        for processes, key in ((1, None), (2, None), (1, REFUSALS_KEY)):
            env = {"DECONV_HTTP_PROCESSES": str(processes), **({"DECONV_API_KEY": key} if key else {})}
            name = f"long_integers_processes_{processes}" + ("_api_key" if key else "")
            out[name] = stopped(s := started(env, f"{name}.log"), long_integers(s, api_key=key))
        out["bombs"] = stopped(s := started({}, "bombs.log"), json_bombs(s, bombs=sizes["bombs"],
                                                                         rounds=sizes["bomb_rounds"]))
        # The largest JSON the server parses (just under its 4 MiB limit), computed, answered as binary: what a
        # legitimate large JSON request costs the other connections.
        out["largest_json"] = stopped(s := started({}, "largest-json.log"), json_bombs(
            s, bombs=sizes["bombs"], shape=(15, 16, 64, 64), binary_output=True, expect=200))
        results["json"] = {**out, "ok": all(r["ok"] for r in out.values()),
                           "checks": {k: r["ok"] for k, r in out.items()}}
    if "drain_load" in chosen:
        out = {}
        for processes in (1, 2):
            runs = []
            for i in range(sizes["drain_runs"]):
                server = started({"DECONV_HTTP_PROCESSES": str(processes), "DECONV_LOG_LEVEL": "info"},
                                 f"drain-load-{processes}-{i}.log")
                try:
                    runs.append(asyncio.run(drain_connections(server)))
                finally:
                    server.stop()
            out[f"processes_{processes}"] = {
                "runs": len(runs), "accepted": sum(r["accepted"] for r in runs),
                "answered": sum(r["answered"] for r in runs),
                "after_signal": dict(sum((Counter(r["after_signal"]) for r in runs), Counter())),
                "refused": sum(r["outcomes"].get("refused", 0) for r in runs),
                "exit_statuses": [r["exit_status"] for r in runs],
                "exit_after_signal_s": sorted(r["exit_after_signal_s"] for r in runs),
                "ok": all(r["ok"] for r in runs), "failed": [r for r in runs if not r["ok"]][:2]}
        results["drain_load"] = {**out, "ok": all(r["ok"] for r in out.values()),
                                 "checks": {k: r["ok"] for k, r in out.items()}}
    if "refusals" in chosen:
        out = {f"processes_{p}": stopped(s := started({**REFUSALS_ENV, "DECONV_HTTP_PROCESSES": str(p)},
                                                      f"refusals-{p}.log"), early_refusals(s))
               for p in (1, 2)}
        results["refusals"] = {**out, "ok": all(r["ok"] for r in out.values()),
                               "checks": {k: r["ok"] for k, r in out.items()}}
    return results


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
        for name, result in run_attacks(chosen, sizes, base, args.workdir).items():
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
