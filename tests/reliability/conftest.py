"""Reliability tests: the scenario drivers of bench/serving/reliability/ at bounded sizes, and the fuzzers' settings.

``DECONV_FUZZ_EXAMPLES`` sets the cases each fuzzer runs (default 300 here; ``python -m bench.serving.reliability
--full`` asks for 10,000); ``DECONV_FUZZ_REPORT`` names a JSON file that receives each fuzzer's count of cases run.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from bench.serving.reliability.server import Server

REPO_ROOT = Path(__file__).resolve().parents[2]
FUZZ_EXAMPLES = int(os.environ.get("DECONV_FUZZ_EXAMPLES", "300"))
FUZZ_REPORT = os.environ.get("DECONV_FUZZ_REPORT")

# Bounded runs are derandomized (the same cases every time, so CI does not flake on a new find); full runs
# explore with fresh randomness.
settings.register_profile(
    "deconv-fuzz", max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=FUZZ_EXAMPLES <= 1000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                           HealthCheck.function_scoped_fixture],
)

CASES: Counter[str] = Counter()


def count_case(fuzzer: str) -> None:
    """Count one case run by ``fuzzer`` (reported to ``DECONV_FUZZ_REPORT``)."""
    CASES[fuzzer] += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if FUZZ_REPORT and CASES:
        path = Path(FUZZ_REPORT)
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**old, **CASES}, indent=1, sort_keys=True) + "\n")


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[object]:
    """``start_server(env)``: a ready ``python -m service`` on 127.0.0.1 (``ready=False``: just started); every one is
    stopped after the test."""
    started = []

    def start(env: dict[str, str], ready: bool = True) -> object:
        server = Server.start(env, tmp_path / f"server-{len(started)}.log", 120.0 if ready else None)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def server_error(status: int, text: str) -> bool:
    """Whether an answer is a server error: any 5xx but 504 ``deadline_exceeded`` (a request whose own deadline,
    ``X-Deadline-Ms`` or KServe's ``timeout``, passed while it was queued)."""
    if status == 504:
        try:
            body = json.loads(text)
        except ValueError:
            return True
        error = body.get("error")
        kind = error.get("type") if isinstance(error, dict) else body.get("type")
        return kind != "deadline_exceeded"
    return status >= 500


LEAK_MARKS = ("Traceback", 'File "', str(REPO_ROOT), sys.prefix, "site-packages")


def leaks_internals(text: str, echoed: Iterable[object] = ()) -> bool:
    """Whether a response body shows a traceback or a path of the server's own (its code, its Python).

    ``echoed``: what the request itself carried (path parameters, query values...), which an error message may
    quote back (``no layer named 'Traceback'``): those quotes are no leak, so they are cut out first, as written
    and as Python's repr and JSON would escape them.
    """
    for value in echoed:
        if not isinstance(value, str) or not value:
            continue
        for form in {value, repr(value)[1:-1], json.dumps(value)[1:-1], json.dumps(repr(value)[1:-1])[1:-1]}:
            if form:
                text = text.replace(form, "")
    return any(mark in text for mark in LEAK_MARKS)


def explain(result: dict[str, object]) -> str:
    """A scenario's failed checks and figures, for an assertion message."""
    failed = [k for k, ok in result["checks"].items() if not ok]  # type: ignore[union-attr]
    return f"failed checks {failed}: {json.dumps(result, default=str)[:3000]}"
