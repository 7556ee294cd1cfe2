"""The engine event loop's own Python per request, without sockets, threads or a GPU.

An ``EngineConnection`` (service.engine.process) gets ``SUBMIT`` frames with slots in bursts, as an HTTP process's link
delivers them; its layer's batcher packs them and hands each batch to an executor that answers at once (the outputs
are views of the slots); the ``RESULT`` frames go to a transport that only counts bytes. What is left is the loop's
work per request: parsing the frame, queueing, packing, answering, the metrics. Under load on the GPU machines the
engine's event loop holds the GIL that its GPU worker thread needs between batches, so this is time a batch waits.

    PROMETHEUS_MULTIPROC_DIR=$(mktemp -d) python -m bench.serving.engine_loop [--burst 32] [--rounds 800] [--repeat 4]
    ... --profile    # then a cProfile of one more measurement, by own time

Prints microseconds of CPU per request for each repetition and their median.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from service.codec import AnyTensor, RawTensor, SlotTensor
from service.engine.batcher import Batcher
from service.engine.process import EngineConnection
from service.engine.registry import BatchLimits, Layer, load_repository
from service.ipc import frames
from service.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]


class InstantExecutor:
    """One reservation; a batch's outputs are its requests' slots, answered after one loop iteration."""

    parallelism = 1
    devices = 1

    def __init__(self) -> None:
        self.busy = False
        self.free = asyncio.Event()

    async def acquire(self) -> str:
        while self.busy:
            self.free.clear()
            await self.free.wait()
        self.busy = True
        return "instant"

    def release(self, reservation: Any) -> None:
        self.busy = False
        self.free.set()

    async def run(self, reservation: Any, layer: Layer, inputs: list[Any], kind: Any = None) -> list[AnyTensor]:
        try:
            await asyncio.sleep(0)
            outputs: list[AnyTensor] = []
            for x in inputs:
                assert isinstance(x, SlotTensor)
                n, _, h, w = x.shape
                outputs.append(RawTensor(x.out, x.dtype, (n, layer.config.out_channels, *layer.output_hw(h, w))))
            return outputs
        finally:
            self.release(reservation)


class CountingTransport:
    """Where the engine's frames go: counted, not sent."""

    def __init__(self) -> None:
        self.bytes = 0

    def writelines(self, parts: list[bytes | memoryview]) -> None:
        self.bytes += sum(len(p) for p in parts)

    def write(self, data: bytes) -> None:
        self.bytes += len(data)

    def is_closing(self) -> bool:
        return False


async def measure(burst: int, rounds: int, repeat: int, profile: bool) -> list[float]:
    reg = load_repository(ROOT / "layers", BatchLimits(64, 1 << 24, 0.0, 1024), weights=False)
    layer = reg.get("demo")
    metrics = Metrics()
    batcher = Batcher(layer, InstantExecutor(), metrics, observe_queue_time=False)  # as in the engine process
    batcher.start()
    names = reg.names()
    # The parts of an EngineServer and its LocalEngine that a connection uses.
    engine = SimpleNamespace(metrics=metrics, batchers={"demo": batcher},
                             readiness=SimpleNamespace(check_ready=lambda: None))
    server = SimpleNamespace(engine=engine, layers=names, connections=set(), calls=set(), state_frame=lambda: [b""])
    x = torch.zeros(1, layer.config.in_channels, 16, 16)
    in_bytes = x.numel() * 4
    slot = in_bytes + layer.output_bytes(1, 16, 16)
    arena = memoryview(bytearray(burst * slot))
    conn = EngineConnection(server, arena)  # type: ignore[arg-type]
    transport = CountingTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    index = names.index("demo")
    request_id = 0

    def burst_bytes() -> bytes:
        nonlocal request_id
        data = bytearray()
        for i in range(burst):
            request_id += 1
            span = (i * slot, i * slot + in_bytes)
            for part in frames.submit_frame(request_id, index, x, time.monotonic(), None, span):
                data += part
        return bytes(data)

    data = burst_bytes()  # the same ids every round: each round's requests are answered before the next

    async def one_round() -> None:
        conn.data_received(data)
        while conn.pending:
            await asyncio.sleep(0)

    for _ in range(50):  # warm-up
        await one_round()
    results = []
    for _ in range(repeat):
        c0 = time.process_time()
        for _ in range(rounds):
            await one_round()
        results.append(1e6 * (time.process_time() - c0) / (rounds * burst))
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(rounds):
            await one_round()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    await batcher.close()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--burst", type=int, default=32, help="SUBMIT frames delivered together")
    p.add_argument("--rounds", type=int, default=800, help="bursts per measurement")
    p.add_argument("--repeat", type=int, default=4, help="measurements")
    p.add_argument("--profile", action="store_true", help="then print a cProfile of one more measurement")
    args = p.parse_args()
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        p.error("set PROMETHEUS_MULTIPROC_DIR to an empty directory (the engine's metrics are multi-process)")
    us = asyncio.run(measure(args.burst, args.rounds, args.repeat, args.profile))
    print(f"Python {sys.version.split()[0]}, bursts of {args.burst}: engine event loop "
          f"{', '.join(f'{u:.1f}' for u in us)} us CPU per request (median {statistics.median(us):.1f})")


if __name__ == "__main__":
    main()
