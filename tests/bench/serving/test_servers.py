"""bench/serving/servers.py: the --http-processes argument ("auto" or a count) and the count a server runs."""

from __future__ import annotations

import argparse

import pytest

from bench.serving.servers import expected_http_processes, http_processes_arg
from service.config import auto_http_processes


@pytest.mark.parametrize(("text", "value"), [("1", 1), ("8", 8), ("auto", "auto"), (" AUTO ", "auto")])
def test_http_processes_arg_takes_a_count_or_auto(text: str, value: int | str) -> None:
    assert http_processes_arg(text) == value


@pytest.mark.parametrize("text", ["0", "-2", "many", "1.5"])
def test_http_processes_arg_refuses_anything_else(text: str) -> None:
    with pytest.raises((argparse.ArgumentTypeError, ValueError)):
        http_processes_arg(text)


def test_expected_http_processes_follows_the_servers_rule() -> None:
    assert expected_http_processes(4, "cpu") == 4
    assert expected_http_processes("auto", "cpu") == auto_http_processes("cpu")[0] == 1  # no GPU: one process
