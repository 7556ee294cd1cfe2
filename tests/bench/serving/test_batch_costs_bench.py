"""bench/serving/batch_costs.py's GIL-contention measurement (``--contend``) on the CPU worker: batches of slot requests
go through the worker thread with and without another thread that wants the GIL, each answered correctly, and the line
reports them (the figures themselves are a benchmark's, not checked)."""

from __future__ import annotations

import re

import torch

from bench.serving import batch_costs
from service.config import DEFAULT_LAYER_REPOSITORY
from service.engine.registry import BatchLimits, load_repository
from service.engine.worker import Worker


def test_contended_batches_run_beside_a_thread_that_wants_the_gil() -> None:
    layer = load_repository(DEFAULT_LAYER_REPOSITORY, BatchLimits(64, 1 << 28, 0.0, 256)).get("demo")
    assert layer is not None
    worker = Worker(torch.device("cpu"))
    worker.load(layer)
    try:
        memory = memoryview(bytearray(1 << 20))
        xs = batch_costs.slot_inputs(memory, False, layer, 3, 8, 8)
        for busy_us in (0, 200):
            line = batch_costs.contended(worker, layer, xs, busy_us, seconds=0.2)
            match = re.search(r"(\d+) batches/s", line)
            assert match is not None, line
            assert int(match.group(1)) > 0
            assert f"other thread {busy_us:>4} us on" in line
        expected = torch.nn.functional.conv_transpose2d(
            xs[0].tensor(), worker.weights["demo"][0], worker.weights["demo"][1], layer.args.stride,
            layer.args.padding, layer.args.output_padding, layer.args.groups, layer.args.dilation)
        torch.testing.assert_close(torch.frombuffer(xs[0].out, dtype=torch.float32).view(expected.shape), expected)
    finally:
        worker.shutdown()
