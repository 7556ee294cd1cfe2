"""Injected faults (DECONV_FAULTS, test mode only): kernel errors, out of memory, a worker thread dying or hanging.

Each fault fails only the requests of the batches it hits (500, no internals in the message); the service stays
ready and later requests succeed.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from bench.serving.reliability.under_load import FAULTS, fault_run
from service.config import Settings
from service.faults import Faults, parse

from .conftest import REPO_ROOT, explain


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["kernel_error", "oom_split", "oom_one_sample", "worker_dies", "worker_hangs"])
def test_fault_fails_only_its_batch_and_the_service_stays_ready(start_server, kind):
    spec, extra, _ = FAULTS[kind]
    server = start_server({"DECONV_TEST_MODE": "1", "DECONV_FAULTS": spec, "DECONV_MAX_QUEUE_DELAY_MS": "50",
                           "DECONV_LOG_LEVEL": "info", **extra})
    result = asyncio.run(fault_run(server.url, kind))
    assert result["ok"], explain(result)
    log = server.log()
    assert "TEST MODE: injecting faults once ready" in log
    assert "FAULT INJECTION ARMED" in log
    assert server.stop() == 0, log[-2000:]  # a hung thread does not keep the process from draining and exiting


def test_faults_are_refused_without_test_mode(tmp_path):
    env = {**os.environ, "DECONV_DEVICES": "cpu", "DECONV_PORT": "0", "DECONV_FAULTS": "error"}
    env.pop("DECONV_TEST_MODE", None)
    done = subprocess.run([sys.executable, "-m", "service"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=90, check=False)
    assert done.returncode != 0
    assert "DECONV_FAULTS injects failures and is for tests only" in done.stderr


def test_fault_spec_parsing():
    faults = parse("error:layer=demo:times=1, oom:above=2:every=3,delay:ms=2.5")
    assert [(f.kind, f.layer, f.times, f.above, f.every, f.ms) for f in faults] == [
        ("error", "demo", 1, 0, 1, 0.0), ("oom", None, None, 2, 3, 0.0), ("delay", None, None, 0, 1, 2.5)]
    assert Faults(faults).describe() == "error:layer=demo:times=1,oom:every=3:above=2,delay:ms=2.5"
    for bad in ("boom", "error:times=-1", "oom:above=x", "error:every=0", "error:colour=red"):
        with pytest.raises(ValueError, match="fault"):
            parse(bad)
    assert Settings(faults="oom", test_mode=True).faults == "oom"


def test_faults_fire_only_once_armed_and_as_often_as_asked():
    faults = Faults(parse("error:layer=a:every=2:times=2,oom:above=3"))
    faults.before_batch("a", 1)  # not armed yet: the start-up self-tests run clean
    faults.before_forward("a", 8)
    faults.arm()
    fired = 0
    for _ in range(10):
        try:
            faults.before_batch("a", 1)
        except RuntimeError:
            fired += 1
    assert fired == 2  # every second call, twice in all
    faults.before_batch("b", 1)  # another layer
    faults.before_forward("a", 3)  # not above 3 samples
    with pytest.raises(Exception, match="out of memory"):
        faults.before_forward("a", 4)
