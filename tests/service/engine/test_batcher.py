"""Dynamic batching, admission control, drops and deadlines, with a fake executor (no kernels, no HTTP)."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from service.codec import CudaJob, DeviceTensor, RawTensor, SlotTensor
from service.engine import batcher as batcher_module
from service.engine.batcher import Batcher
from service.engine.interface import Result
from service.engine.kinds import Kind
from service.engine.registry import BatchLimits, Layer, LayerConfig
from service.errors import DeadlineExceededError, InternalError, NotReadyError, OverloadedError
from service.metrics import Metrics

from ..conftest import REPO_ROOT, metric_value, run


def make_layer(max_batch_size: int = 8, max_batch_bytes: int = 1 << 30, delay_ms: float = 50.0,
               queue: int = 16) -> Layer:
    cfg = LayerConfig(name="t", in_channels=2, out_channels=3, kernel_size=1, bias=False, dtype="float32")
    return Layer(cfg, torch.ones(2, 3, 1, 1), None, BatchLimits(max_batch_size, max_batch_bytes, delay_ms, queue))


class FakeExecutor:
    """Records batches; output i of a batch is input i summed over channels, repeated to 3 channels."""

    def __init__(self, slots: int = 1, fail: int = 0) -> None:
        self.slots = slots
        self.parallelism = slots
        self.devices = slots  # one worker a device, unless a test says otherwise
        self.free = asyncio.Event()
        self.batches: list[list[int]] = []
        self.times: list[float] = []
        self.fail = fail  # fail this many batches first
        self.hold: asyncio.Event | None = None  # set: batches wait for it before finishing
        self.started = asyncio.Event()  # set whenever a batch starts
        self.kinds: list[Kind] = []  # each batch's kind, as handed to run

    async def acquire(self, device: int | None = None) -> str:
        while self.slots == 0:
            self.free.clear()
            await self.free.wait()
        self.slots -= 1
        return "fake"

    def release(self, slot: Any) -> None:
        self.slots += 1
        self.free.set()

    async def run(self, slot: Any, layer: Layer, inputs: list[torch.Tensor], kind: Kind) -> list[torch.Tensor]:
        self.kinds.append(kind)
        try:
            self.batches.append([int(x.shape[0]) for x in inputs])
            self.times.append(time.monotonic())
            self.started.set()
            if self.hold is not None:
                await self.hold.wait()
            if self.fail:
                self.fail -= 1
                raise InternalError("kernel failed")
            return [x.sum(1, keepdim=True).expand(-1, 3, -1, -1).clone() if isinstance(x, torch.Tensor) else x
                    for x in inputs]
        finally:
            self.release(slot)

    async def wait_batches(self, n: int) -> None:
        """Until ``n`` batches have started."""
        while len(self.batches) < n:
            self.started.clear()
            await self.started.wait()


def x(n: int = 1, h: int = 4, w: int = 4, value: float = 1.0) -> torch.Tensor:
    return torch.full((n, 2, h, w), value)


async def settle() -> None:
    """Let every task that can run, run (the batcher's loop reacts within a few event-loop iterations)."""
    for _ in range(50):
        await asyncio.sleep(0)


def test_requests_with_the_same_shape_share_a_batch():
    async def main() -> None:
        ex = FakeExecutor()
        b = Batcher(make_layer(), ex)
        b.start()
        items = [b.submit(x(value=i)) for i in range(3)]
        other = b.submit(x(h=5))  # different H: its own batch
        results = await asyncio.gather(*(i.future for i in [*items, other]))
        assert sorted(ex.batches) == [[1], [1, 1, 1]]
        for i, r in enumerate(results[:3]):
            assert r.batch_samples == 3
            assert r.batch_requests == 3
            assert torch.equal(r.output, torch.full((1, 3, 4, 4), 2.0 * i))  # each gets its own output back
        assert results[3].batch_samples == 1
        await b.drain()

    run(main(), 120)


def test_max_batch_size_and_bytes_cut_batches():
    async def main() -> None:
        ex = FakeExecutor()
        b = Batcher(make_layer(max_batch_size=4), ex)
        b.start()
        items = [b.submit(x(n)) for n in (2, 1, 2, 3, 1)]
        await asyncio.gather(*(i.future for i in items))
        assert ex.batches == [[2, 1], [2], [3, 1]]  # first come, first served, never over 4 samples
        await b.drain()

        ex = FakeExecutor()
        one_sample = 3 * 4 * 4 * 4  # output bytes of one sample
        b = Batcher(make_layer(max_batch_bytes=2 * one_sample), ex)
        b.start()
        items = [b.submit(x()) for _ in range(5)]
        await asyncio.gather(*(i.future for i in items))
        assert ex.batches == [[1, 1], [1, 1], [1]]
        await b.drain()

    run(main(), 120)


def test_a_full_group_goes_at_once_and_a_lone_request_waits_the_delay():
    async def main() -> None:
        ex = FakeExecutor()
        b = Batcher(make_layer(max_batch_size=2, delay_ms=3_600_000), ex)
        b.start()
        items = [b.submit(x()), b.submit(x())]
        # Guards a full group waiting for the delay: an hour here, so that the bound (which only limits how long a
        # broken batcher is waited for) cannot be reached by a slow machine and the answer is an event.
        await asyncio.wait_for(asyncio.gather(*(i.future for i in items)), 60)
        assert ex.batches == [[1, 1]]
        await b.close()

        ex = FakeExecutor()
        b = Batcher(make_layer(delay_ms=200), ex)
        b.start()
        t0 = time.monotonic()
        await b.submit(x()).future
        assert ex.times[0] - t0 >= 0.19  # a lower bound: a slow machine only makes the wait longer
        await b.drain()

    run(main(), 120)


def test_batches_grow_while_the_workers_are_busy():
    async def main() -> None:
        ex = FakeExecutor(slots=1)
        ex.hold = asyncio.Event()
        b = Batcher(make_layer(delay_ms=0), ex)
        b.start()
        first = b.submit(x())
        await ex.wait_batches(1)  # the first batch holds the only slot
        rest = [b.submit(x()) for _ in range(5)]
        await settle()
        assert b.depth == 5
        ex.hold.set()
        await asyncio.gather(first.future, *(i.future for i in rest))
        assert ex.batches == [[1], [1, 1, 1, 1, 1]]
        await b.drain()

    run(main(), 120)


@pytest.mark.parametrize("max_batch_size", [8, 1])
def test_batches_are_packed_late_unless_they_hold_one_sample(max_batch_size: int):
    """One worker with room for a second batch in its queue: a layer whose batches can grow leaves that room
    empty while its batch runs, so that everything arriving meanwhile rides in the next batch; a layer of
    one-sample batches fills it."""
    async def main() -> None:
        ex = FakeExecutor(slots=2)
        ex.parallelism = ex.devices = 1
        ex.hold = asyncio.Event()
        b = Batcher(make_layer(max_batch_size=max_batch_size, delay_ms=0), ex)
        b.start()
        first = b.submit(x())
        await ex.wait_batches(1)  # the first batch runs (held)
        rest = [b.submit(x()) for _ in range(3)]
        if max_batch_size > 1:
            await settle()
            assert ex.batches == [[1]]  # a slot is free, but the next batch waits to be packed
            assert b.depth == 3
        else:
            await ex.wait_batches(2)  # the free slot took the next one-sample batch
            await settle()
            assert ex.batches == [[1], [1]]  # and no other: both slots are taken
            assert b.depth == 2
        ex.hold.set()
        await asyncio.gather(first.future, *(i.future for i in rest))
        assert ex.batches == ([[1], [1, 1, 1]] if max_batch_size > 1 else [[1], [1], [1], [1]])
        await b.drain()

    run(main(), 120)


def held_batcher(workers: int, devices: int, max_batch_size: int = 4,
                 max_batch_bytes: int = 1 << 30) -> tuple[FakeExecutor, Batcher]:
    """A started batcher (batches of up to 4 samples, no delay) on ``workers`` fake workers over ``devices`` devices,
    whose batches run until ``ex.hold`` is set. Call it on the running event loop."""
    ex = FakeExecutor(slots=workers)
    ex.devices = devices
    ex.hold = asyncio.Event()
    b = Batcher(make_layer(max_batch_size=max_batch_size, max_batch_bytes=max_batch_bytes, delay_ms=0), ex)
    b.start()
    return ex, b


@pytest.mark.parametrize("where", ["host", "system region", "cuda region"])
def test_only_a_full_batch_through_host_memory_goes_to_a_second_worker_of_a_device(where: str):
    """Two workers on one device: while a batch of the layer runs, the next one is packed at once only when it is
    full already (waiting could not make it larger) and its tensors cross host memory (its transfers overlap the
    running batch's kernel); a partial one, or one in a GPU's CUDA shared memory, waits for the running batch."""
    def request() -> torch.Tensor | CudaJob:
        if where == "host":
            return x()
        return CudaJob(DeviceTensor("region", 0 if where == "cuda region" else -1, 0, torch.float32, (1, 2, 4, 4)),
                       None)

    async def main() -> None:
        ex, b = held_batcher(workers=2, devices=1)
        first = b.submit(request())
        await settle()
        assert ex.batches == [[1]]  # runs (held)
        rest = [b.submit(request()) for _ in range(3)]
        await settle()
        assert ex.batches == [[1]]  # three of four samples: waits although the second worker is free
        assert b.depth == 3
        rest.append(b.submit(request()))  # the group is full now
        await settle()
        if where == "cuda region":
            assert ex.batches == [[1]]  # nothing to overlap: still one batch at a time
        else:
            assert ex.batches == [[1], [1, 1, 1, 1]]  # onto the second worker at once
            rest += [b.submit(request()) for _ in range(2)]
            await settle()
            assert len(ex.batches) == 2  # both workers busy
        ex.hold.set()
        await asyncio.gather(first.future, *(i.future for i in rest))
        assert ex.batches == [[1], [1, 1, 1, 1]] + ([] if where == "cuda region" else [[1, 1]])
        await b.drain()

    run(main(), 120)


def test_a_group_full_by_its_bytes_goes_to_a_second_worker_at_once():
    """As above through host memory, with the group filled by its outputs' bytes (``max_batch_bytes``: four outputs
    of 192 bytes) rather than by its samples: the request that fills it starts a batch on the second worker."""
    async def main() -> None:
        ex, b = held_batcher(workers=2, devices=1, max_batch_size=64, max_batch_bytes=4 * 3 * 4 * 4 * 4)
        first = b.submit(x())
        await settle()
        rest = [b.submit(x()) for _ in range(3)]
        await settle()
        assert ex.batches == [[1]]  # 576 of 768 bytes: waits for the running batch
        rest.append(b.submit(x()))
        await settle()
        assert ex.batches == [[1], [1, 1, 1, 1]]
        ex.hold.set()
        await asyncio.gather(first.future, *(i.future for i in rest))
        await b.drain()

    run(main(), 120)


@pytest.mark.parametrize("long_batches", [True, False], ids=["long-batches", "short-batches"])
def test_a_full_batch_in_cuda_shared_memory_goes_to_a_second_worker_only_after_long_batches(
        long_batches: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers on one GPU, requests in its CUDA shared memory: a full batch goes to the second worker while one
    runs only once the lane's last batch took ``LONG_GPU_BATCH_S`` or more (here a nanosecond: any batch, or never),
    never before a batch of the lane was measured."""
    monkeypatch.setattr(batcher_module, "LONG_GPU_BATCH_S", 1e-9 if long_batches else math.inf)

    def job() -> CudaJob:
        return CudaJob(DeviceTensor("region", 0, 0, torch.float32, (1, 2, 4, 4)), None)

    async def main() -> None:
        ex, b = held_batcher(workers=2, devices=1)
        for phase in (1, 2):
            ex.hold = asyncio.Event()
            first = b.submit(job())
            await settle()
            rest = [b.submit(job()) for _ in range(4)]  # a full group
            await settle()
            if phase == 2 and long_batches:  # (phase 1: no batch of the lane measured yet)
                assert ex.batches[-2:] == [[1], [1, 1, 1, 1]]  # onto the second worker at once
            else:
                assert ex.batches[-1] == [1]  # the full group waits for the running batch
            ex.hold.set()
            await asyncio.gather(first.future, *(i.future for i in rest))
            await settle()
        assert len(ex.batches) == 4
        await b.drain()

    run(main(), 120)


def test_a_free_gpu_does_not_wait_behind_requests_for_a_busy_one():
    """Two GPUs, requests in their CUDA shared memory: while GPU 0 runs a batch of the layer, a request for GPU 1 that
    came after more requests for GPU 0 starts at once on GPU 1; those for GPU 0 wait for its batch (one at a time)."""
    def job(gpu: int) -> CudaJob:
        return CudaJob(DeviceTensor(f"region-{gpu}", gpu, 0, torch.float32, (1, 2, 4, 4)), None)

    async def main() -> None:
        ex, b = held_batcher(workers=4, devices=2)
        first = b.submit(job(0))
        await settle()
        assert ex.batches == [[1]]  # on GPU 0 (held)
        later = [b.submit(job(0)), b.submit(job(0))]
        await settle()  # the batcher waits for room on GPU 0
        assert ex.batches == [[1]]
        later.append(b.submit(job(1)))  # wakes it: GPU 1 has room
        await settle()
        assert ex.batches == [[1], [1]]  # GPU 1's request went past GPU 0's
        assert b.depth == 2
        ex.hold.set()
        await asyncio.gather(first.future, *(i.future for i in later))
        assert ex.batches == [[1], [1], [1, 1]]
        await b.drain()

    run(main(), 120)


def test_each_batch_goes_with_the_kind_of_its_requests():
    """The batcher sorts each request once, when queued: a batch of requests in page-locked slots is of kind SLOTS,
    one that mixes them with other host memory HOST, one in shared memory the engine maps REGIONS."""
    def slot(pinned: bool) -> SlotTensor:
        t = x(h=5)
        raw = RawTensor(memoryview(bytearray(t.numpy().tobytes())), t.dtype, tuple(t.shape))
        return SlotTensor.of(raw, memoryview(bytearray(3 * 5 * 4 * 4)), pinned=pinned)

    async def main() -> None:
        ex = FakeExecutor()
        b = Batcher(make_layer(delay_ms=0.0), ex)
        ex.hold = asyncio.Event()
        b.start()
        first = b.submit(x())  # on the one worker, held: the rest queue and batch by key
        await ex.wait_batches(1)
        pinned = [b.submit(slot(True)), b.submit(slot(True))]
        ex.hold.set()
        await asyncio.gather(first.future, *(i.future for i in pinned))
        mixed = [b.submit(slot(True)), b.submit(slot(False))]
        await asyncio.gather(*(i.future for i in mixed))
        job = b.submit(CudaJob(DeviceTensor("region", 0, 0, torch.float32, (1, 2, 4, 4)), None))
        await job.future
        assert ex.batches == [[1], [1, 1], [1, 1], [1]]
        assert ex.kinds == [Kind.HOST, Kind.SLOTS, Kind.HOST, Kind.REGIONS]
        await b.drain()

    run(main(), 120)


def test_the_next_batch_starts_before_the_results_go_out():
    """When a batch leaves its worker, the worker gets the next batch before the finished batch's requests are
    answered (answering a large batch takes a while; the worker would wait for it)."""
    async def main() -> None:
        ex = FakeExecutor(slots=1)
        ex.hold = asyncio.Event()
        b = Batcher(make_layer(delay_ms=0), ex)
        b.start()
        first = [b.submit(x()) for _ in range(2)]
        await ex.wait_batches(1)  # the first batch runs (held)
        rest = [b.submit(x()) for _ in range(3)]
        started_when_answered: list[int] = []
        for item in first:
            item.future.add_done_callback(lambda _: started_when_answered.append(len(ex.batches)))
        ex.hold.set()
        await asyncio.gather(*(i.future for i in first + rest))
        assert ex.batches == [[1, 1], [1, 1, 1]]
        assert started_when_answered == [2, 2]
        await b.drain()

    run(main(), 120)


def test_full_queue_is_refused_at_once():
    async def main() -> None:
        m = Metrics()
        b = Batcher(make_layer(delay_ms=5000, queue=2), FakeExecutor(), m)
        b.start()
        b.submit(x())
        b.submit(x())
        await asyncio.sleep(0)  # the gauge follows within one event-loop iteration
        assert metric_value(m.render().decode(), "deconv_queue_depth", layer="t") == 2
        # "At once": submit is a plain function, so it refuses without waiting for room (no timing needed).
        assert not asyncio.iscoroutinefunction(b.submit)
        with pytest.raises(OverloadedError) as info:
            b.submit(x())
        assert info.value.status == 429
        assert int(info.value.headers["Retry-After"]) >= 1
        await b.close()

    run(main(), 120)


def test_dropped_requests_are_not_executed():
    async def main() -> None:
        m = Metrics()
        ex = FakeExecutor()
        b = Batcher(make_layer(delay_ms=100), ex, m)
        b.start()
        keep, gone = b.submit(x(value=1)), b.submit(x(value=2))
        assert b.drop(gone, "disconnected")
        assert gone.future.done()
        result = await keep.future
        assert ex.batches == [[1]]
        assert result.batch_samples == 1
        assert not b.drop(keep, "disconnected")  # already ran: nothing to drop
        text = m.render().decode()
        assert metric_value(text, "deconv_requests_dropped_total", layer="t", reason="disconnected") == 1
        await b.drain()

    run(main(), 120)


def test_deadline_passed_in_the_queue_fails_before_execution():
    async def main() -> None:
        ex = FakeExecutor()
        b = Batcher(make_layer(delay_ms=100), ex)
        b.start()
        received = time.monotonic()
        late = b.submit(x(), received=received, deadline=received + 0.01)
        fine = b.submit(x(), deadline=time.monotonic() + 30)
        # The same answer as when the route's own timer notices the deadline first (X-Deadline-Ms: 10).
        with pytest.raises(DeadlineExceededError, match=r"^X-Deadline-Ms of 10 ms passed before execution$"):
            await late.future
        await fine.future
        assert ex.batches == [[1]]
        await b.drain()

    run(main(), 120)


def test_a_failed_batch_fails_only_its_requests():
    async def main() -> None:
        ex = FakeExecutor(fail=1)
        b = Batcher(make_layer(delay_ms=20), ex)
        b.start()
        failed = [b.submit(x()), b.submit(x())]
        for item in failed:
            with pytest.raises(InternalError):
                await item.future
        later = b.submit(x())
        assert (await later.future).output.shape == (1, 3, 4, 4)
        await b.drain()

    run(main(), 120)


def test_requests_with_on_done_are_answered_through_it_once_each():
    """The engine's way (``on_done`` instead of a future): results and errors at once, in the batch's order; a
    cancellation one loop iteration after the drop; an exception in one answer stops none of the others."""

    async def main() -> None:
        ex = FakeExecutor(fail=1)
        b = Batcher(make_layer(delay_ms=20), ex)
        b.start()
        got: list[tuple[str, object]] = []
        answered = asyncio.Event()

        def on_done(key: str, outcome: object) -> None:
            got.append((key, outcome))
            answered.set()
            if key == "boom":
                raise RuntimeError("a broken answer")

        async def answers(n: int) -> None:
            while len(got) < n:
                answered.clear()
                await answered.wait()

        failed = [b.submit(x(), on_done=on_done, key=k) for k in ("f1", "f2")]
        await answers(2)
        assert [k for k, _ in got] == ["f1", "f2"]
        assert all(isinstance(o, InternalError) for _, o in got)
        assert all(i.future.done() for i in failed)
        got.clear()
        items = [b.submit(x(value=v), on_done=on_done, key=k) for v, k in ((1, "a"), (2, "boom"), (3, "c"))]
        gone = b.submit(x(), on_done=on_done, key="gone")
        assert b.drop(gone, "disconnected")
        assert gone.future.done()
        assert got == []  # the cancellation comes one iteration later
        await asyncio.sleep(0)
        assert got == [("gone", None)]
        assert not gone.future.cancel()  # once
        await answers(4)
        assert [k for k, _ in got] == ["gone", "a", "boom", "c"]  # "boom" raised; "c" was still answered
        for (_, outcome), v in zip(got[1:], (1, 2, 3), strict=True):
            assert isinstance(outcome, Result)
            assert outcome.batch_requests == 3
            assert torch.equal(outcome.output, torch.full((1, 3, 4, 4), 2.0 * v))
        with pytest.raises(asyncio.InvalidStateError):
            items[0].future.set_result(got[1][1])  # type: ignore[arg-type]
        assert len(got) == 4
        await b.drain()

    run(main(), 120)


def test_drain_runs_the_queue_now_and_refuses_new_work():
    async def main() -> None:
        ex = FakeExecutor()
        b = Batcher(make_layer(delay_ms=3_600_000), ex)
        b.start()
        items = [b.submit(x()) for _ in range(3)]
        # Guards a drain that waits for the delay (an hour): the bound only limits how long that is waited for.
        await asyncio.wait_for(b.drain(), 60)
        assert all(i.future.done() and not i.future.cancelled() for i in items)
        with pytest.raises(NotReadyError):
            b.submit(x())

    run(main(), 120)


def test_batcher_and_worker_import_nothing_from_fastapi():
    code = ("import sys, service.engine.batcher, service.engine.worker, service.engine.pool; "
            "sys.exit(1 if any(m.split('.')[0] in ('fastapi', 'starlette') for m in sys.modules) else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, timeout=60, capture_output=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
