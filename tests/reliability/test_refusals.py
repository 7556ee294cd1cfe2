"""Refusals go at once, before the body: 401 without the key (also for ``Expect: 100-continue``), 429 over the
budget; duplicate Authorization headers are 400. One and two HTTP processes."""

from __future__ import annotations

import asyncio

import pytest

from bench.serving.reliability.attacks import REFUSALS_ENV, early_refusals

from .conftest import explain

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("processes", [1, 2])
def test_refusals_are_answered_before_the_body_and_duplicate_keys_are_400(start_server, processes):
    # Before: a 401 or a 429 was sent only once the whole body had come, so a stalled body got a 408 after the body
    # timeout instead; Expect: 100-continue without a key was told 100 Continue; of two Authorization headers the
    # first counted (right key, then wrong key: 200). The body timeout here is 600 s: an answer that waits for the
    # body never comes within the test's wait.
    server = start_server({**REFUSALS_ENV, "DECONV_HTTP_PROCESSES": str(processes)})
    result = asyncio.run(early_refusals(server, wait_s=30.0))
    assert result["ok"], explain(result)
