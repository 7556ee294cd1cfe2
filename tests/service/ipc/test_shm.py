"""The shared-memory engine link (service/ipc/shm.py): the arena's slots, the HELLO that passes it, the frames that
name slots, the worker writing outputs into slots, and the HTTP process's slot lifetime. The multi-process server
tests (tests/service/test_server.py, test_multiprocess.py) run requests through it end to end."""

from __future__ import annotations

import asyncio
import gc
import math
import socket
import struct
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from service import codec
from service.codec import RawTensor, SlotTensor, tensor_bytes
from service.config import DEFAULT_LAYER_REPOSITORY, Settings
from service.engine.interface import Result
from service.engine.kinds import Kind, batch_kind, kind_of
from service.engine.paths import direct_batch, forward_span, host_batch, paths_for
from service.engine.registry import BatchLimits, Layer, load_repository
from service.engine.remote import EngineClient, RemoteEngine, RemoteQueue
from service.engine.worker import Worker
from service.errors import InternalError, OverloadedError
from service.ipc import frames, shm
from service.metrics import Metrics

from ..conftest import run

# --- the arena's slots ----------------------------------------------------------------------------------------


def test_slots_are_aligned_first_fit_and_merge_when_given_back() -> None:
    arena = shm.Arena(16 * shm.ALIGN)
    a = arena.alloc(1)
    b = arena.alloc(shm.ALIGN + 1)  # two lines
    c = arena.alloc(3 * shm.ALIGN)
    assert (a, b, c) == (0, shm.ALIGN, 3 * shm.ALIGN)
    assert arena.used_bytes == 6 * shm.ALIGN
    assert arena.slots == 3
    arena.free(b)
    assert arena.alloc(3 * shm.ALIGN) == 6 * shm.ALIGN  # b's two lines are too few: the next free range
    assert arena.alloc(2 * shm.ALIGN) == shm.ALIGN  # the lowest range that fits
    assert arena.alloc(8 * shm.ALIGN) is None  # 7 lines left
    assert arena.alloc(7 * shm.ALIGN) == 9 * shm.ALIGN
    for start in (0, shm.ALIGN, 3 * shm.ALIGN, 6 * shm.ALIGN, 9 * shm.ALIGN):
        arena.free(start)
    assert arena.slots == 0
    assert arena.used_bytes == 0
    assert arena.alloc(16 * shm.ALIGN) == 0  # everything merged back into one range


def test_a_slot_given_back_twice_is_an_error() -> None:
    arena = shm.Arena(4 * shm.ALIGN)
    start = arena.alloc(10)
    assert start is not None
    arena.free(start)
    with pytest.raises(KeyError):
        arena.free(start)


def test_random_slots_never_overlap_and_all_merge_back() -> None:
    g = torch.Generator().manual_seed(0)
    arena = shm.Arena(256 * shm.ALIGN)
    held: dict[int, int] = {}
    for _ in range(2000):
        if held and int(torch.randint(0, 2, (), generator=g)):
            start = list(held)[int(torch.randint(0, len(held), (), generator=g))]
            arena.free(start)
            del held[start]
        else:
            size = int(torch.randint(1, 20 * shm.ALIGN, (), generator=g))
            start = arena.alloc(size)
            if start is None:
                assert arena.size - arena.used_bytes < shm.aligned(size) or len(held) > 1  # full or fragmented
                continue
            assert start % shm.ALIGN == 0
            assert start + size <= arena.size
            for other, other_size in held.items():
                assert start + size <= other or other + other_size <= start
            held[start] = size
    for start in held:
        arena.free(start)
    assert arena.alloc(arena.size) == 0


@pytest.mark.parametrize("size", [0, -64, 100])
def test_arena_size_must_be_a_positive_multiple_of_the_alignment(size: int) -> None:
    with pytest.raises(ValueError, match="multiple"):
        shm.Arena(size)


def test_offset_of_finds_the_bytes_of_memory_lent_from_the_arena_only() -> None:
    async def main() -> None:
        arena = shm.Arena(4 * shm.ALIGN)
        start = arena.alloc(256)
        assert start is not None
        assert arena.offset_of(arena.view[start + 4:start + 8]) is None  # in the arena, but nothing is lent
        lent = arena.lend(start, start + 16, 64)
        assert arena.offset_of(lent[8:12]) == start + 24
        assert arena.offset_of(arena.view[start:start + 4]) == start  # while a slot is lent, found by address
        assert arena.offset_of(memoryview(bytearray(16))) is None  # memory elsewhere
        assert arena.offset_of(arena.view[arena.size - 8:]) == arena.size - 8
        del lent
        gc.collect()
        assert arena.slots == 0  # the lent slot given back with its last view
        assert arena.offset_of(arena.view[start:start + 4]) is None

    run(main())


# --- the HELLO ------------------------------------------------------------------------------------------------


def test_hello_passes_the_arena_and_both_sides_see_the_same_memory() -> None:
    arena = shm.Arena(1 << 16)
    left, right = socket.socketpair()
    try:
        shm.send_hello(left, arena)
        view = shm.recv_hello(right)
        assert view is not None
        assert view.nbytes == 1 << 16
        assert not view.readonly
        arena.view[100:104] = b"abcd"
        assert bytes(view[100:104]) == b"abcd"
        view[5000:5003] = b"xyz"  # the engine writes an output
        assert bytes(arena.view[5000:5003]) == b"xyz"
    finally:
        left.close()
        right.close()


def test_hello_without_an_arena() -> None:
    left, right = socket.socketpair()
    try:
        shm.send_hello(left, None)
        assert shm.recv_hello(right) is None
    finally:
        left.close()
        right.close()


@pytest.mark.parametrize("message", [b"", b"DCNV", b"HTTP/1.1 GET /" + b"\0" * 10,
                                     struct.pack("<4sHQ", b"DCNV", 99, 0), struct.pack("<4sHQ", b"DCNV", 1, 4096)])
def test_a_bad_hello_is_refused(message: bytes) -> None:
    left, right = socket.socketpair()
    try:
        if message:
            left.sendall(message)
        left.close()
        with pytest.raises(shm.HandshakeError):
            shm.recv_hello(right)
    finally:
        right.close()


# --- frames that name slots -----------------------------------------------------------------------------------


def test_submit_with_a_slot_reads_the_input_from_the_arena() -> None:
    arena = bytearray(4096)
    view = memoryview(arena)
    x = torch.randn(2, 3, 4, 5)
    view[128:128 + x.numel() * 4] = tensor_bytes(x)
    frame = b"".join(bytes(p) for p in frames.submit_frame(7, 1, x, 1.5, None, (128, 1024)))
    assert len(frame) == 5 + frames._SUBMIT.size + 16  # no tensor bytes in the frame
    req = frames.parse_submit(bytearray(frame[5:]), view)
    assert (req.request_id, req.layer, req.out_offset, req.deadline) == (7, 1, 1024, None)
    assert torch.equal(req.x.tensor(), x)
    arena[128:132] = b"\0\0\0\0"  # a view of the arena, not a copy
    assert req.x.tensor().flatten()[0] == 0


def test_submit_slots_outside_the_arena_or_without_one_are_protocol_errors() -> None:
    x = torch.randn(1, 2, 4, 4)  # 128 bytes
    body = bytearray(b"".join(bytes(p) for p in frames.submit_frame(1, 0, x, 0.0, None, (0, 128)))[5:])
    with pytest.raises(frames.ProtocolError, match="no arena"):
        frames.parse_submit(body)
    with pytest.raises(frames.ProtocolError, match="outside"):
        frames.parse_submit(bytearray(b"".join(bytes(p) for p in frames.submit_frame(1, 0, x, 0.0, None, (64, 0)))[5:]),
                         memoryview(bytearray(128)))
    with pytest.raises(frames.ProtocolError, match="with a slot is"):
        frames.parse_submit(body + b"\0", memoryview(bytearray(4096)))


def test_result_in_a_slot_carries_no_bytes_and_reads_the_slot() -> None:
    y = torch.randn(2, 3, 4, 4)
    frame = b"".join(bytes(p) for p in frames.result_frame(9, y, 5, 3, 0.25, "cuda:0", shared=True))
    inline = b"".join(bytes(p) for p in frames.result_frame(9, y, 5, 3, 0.25, "cuda:0"))
    assert len(inline) - len(frame) == y.numel() * 4
    slot = memoryview(bytearray(tensor_bytes(y)) + b"\0" * 64)  # a slot may be longer than the output
    out = frames.parse_result(bytearray(frame[5:]), torch.float32, slot)
    assert out.shared
    assert (out.request_id, out.batch_samples, out.batch_requests, out.worker) == (9, 5, 3, "cuda:0")
    assert torch.equal(out.y.tensor(), y)
    with pytest.raises(frames.ProtocolError, match="no slot"):
        frames.parse_result(bytearray(frame[5:]), torch.float32)
    with pytest.raises(frames.ProtocolError, match="a 64-byte slot"):
        frames.parse_result(bytearray(frame[5:]), torch.float32, memoryview(bytearray(64)))
    plain = frames.parse_result(bytearray(inline[5:]), torch.float32, slot)  # inline bytes win over a slot
    assert not plain.shared
    assert torch.equal(plain.y.tensor(), y)


def test_done_frame_names_its_request() -> None:
    frame = b"".join(bytes(p) for p in frames.done_frame(12345678901))
    assert frame[4] == frames.DONE
    assert frames.result_id(bytearray(frame[5:])) == 12345678901


# --- the worker writes outputs into slots ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo() -> Layer:
    layer = load_repository(DEFAULT_LAYER_REPOSITORY, BatchLimits(64, 1 << 28, 2.0, 256)).get("demo")
    assert layer is not None
    return layer


def _slot_input(layer: Layer, x: torch.Tensor) -> tuple[SlotTensor, memoryview]:
    n, _, h, w = x.shape
    h_out, w_out = layer.output_hw(h, w)
    out = memoryview(bytearray(n * layer.config.out_channels * h_out * w_out * 4))
    return SlotTensor(memoryview(bytearray(tensor_bytes(x))), x.dtype, tuple(x.shape), out), out


def _expected(layer: Layer, x: torch.Tensor) -> torch.Tensor:
    c = layer.config
    return torch.nn.functional.conv_transpose2d(x, layer.weight, layer.bias, c.stride, c.padding,
                                                c.output_padding, c.groups, c.dilation)


def test_worker_writes_slot_outputs_into_their_slots(demo: Layer) -> None:
    worker = Worker(torch.device("cpu"))
    try:
        worker.load(demo)
        xs = [torch.randn(n, 16, 6, 5) for n in (1, 3, 2)]
        a, a_out = _slot_input(demo, xs[0])
        c, c_out = _slot_input(demo, xs[2])
        inline = RawTensor(memoryview(bytearray(tensor_bytes(xs[1]))), torch.float32, tuple(xs[1].shape))
        outputs = worker.submit(demo, [a, inline, c]).result(timeout=30)
        assert outputs[0].data is a_out
        assert outputs[2].data is c_out
        assert outputs[1].data.obj is not a_out.obj  # the inline request's output is the batch's own memory
        for x, y in zip(xs, outputs, strict=True):
            torch.testing.assert_close(y.tensor(), _expected(demo, x), rtol=1e-5, atol=1e-5)
    finally:
        worker.shutdown()


def test_a_replaced_worker_thread_never_writes_into_slots(demo: Layer) -> None:
    worker = Worker(torch.device("cpu"))
    try:
        worker.load(demo)
        x = torch.randn(1, 16, 4, 4)
        a, a_out = _slot_input(demo, x)
        stale = worker._generation
        y = forward_span(worker, demo, [a], None)
        assert worker.restart("stalled")  # the batch's requests were answered 500; their slots may serve others
        a_out[:] = b"\x07" * a_out.nbytes
        late = worker._deliver([a], y, stale)
        assert late[0].data is not a_out  # a view of the batch's own output
        assert bytes(a_out) == b"\x07" * a_out.nbytes
        fresh = worker._deliver([a], y, worker._generation)
        assert fresh[0].data is a_out
        torch.testing.assert_close(fresh[0].tensor(), _expected(demo, x), rtol=1e-5, atol=1e-5)
    finally:
        worker.shutdown()


# --- megabyte batches straight between page-locked slots and the GPU -------------------------------------------


def _pinned_slot(layer: Layer, x: torch.Tensor) -> tuple[SlotTensor, memoryview]:
    slot, out = _slot_input(layer, x)
    return SlotTensor.of(slot, out, pinned=True), out


def _direct_by_reference(started: threading.Event | None = None, go: threading.Event | None = None):
    """A stand-in for the extension's direct call: each request's output written into its slot."""
    calls: list[int] = []

    def direct(inputs: list[SlotTensor], weight: torch.Tensor, bias: torch.Tensor | None, layer: Layer,
               packs: Any) -> None:
        calls.append(len(inputs))
        if started is not None and go is not None:
            started.set()
            assert go.wait(30)
        for x in inputs:
            y = _expected(layer, x.tensor())
            x.out[:] = tensor_bytes(y)

    return direct, calls


def test_which_batches_go_straight_between_slots_and_the_gpu(demo: Layer) -> None:
    big = torch.zeros(1, 16, 128, 128)  # 1 MiB of input
    small = torch.zeros(1, 16, 8, 8)
    pinned, _ = _pinned_slot(demo, big)
    unpinned, _ = _slot_input(demo, big)
    tiny, _ = _pinned_slot(demo, small)
    inline = RawTensor(memoryview(bytearray(tensor_bytes(big))), torch.float32, tuple(big.shape))

    def kind(*xs: RawTensor) -> Kind:
        return batch_kind(kind_of(x) for x in xs)

    assert kind(pinned, pinned) is Kind.SLOTS
    assert kind(pinned, tiny) is Kind.SLOTS
    assert kind(tiny) is Kind.SLOTS  # whatever their size: the extension stages small ones
    assert kind(pinned, unpinned) is Kind.HOST
    assert kind(unpinned) is Kind.HOST
    assert kind(pinned, inline) is Kind.HOST
    assert paths_for(torch.device("cuda", 0)).slots is direct_batch  # a GPU takes such batches straight
    assert paths_for(torch.device("cpu")).slots is host_batch  # the CPU computes them as any other


def _direct_worker(layer: Layer, direct: Any, metrics: Metrics | None = None) -> Worker:
    # A CPU worker that takes the direct path for page-locked slots, as a GPU worker does.
    cpu = paths_for(torch.device("cpu"))
    worker = Worker(torch.device("cpu"), metrics, direct=direct, paths=replace(cpu, slots=direct_batch))
    worker.load(layer)
    return worker


def test_a_direct_batch_answers_with_views_of_the_slots_it_wrote(demo: Layer) -> None:
    direct, calls = _direct_by_reference()
    m = Metrics()
    worker = _direct_worker(demo, direct, m)
    try:
        xs = [torch.randn(n, 16, 6, 5) for n in (2, 1)]
        slots = [_pinned_slot(demo, x) for x in xs]
        outputs = worker.submit(demo, [s for s, _ in slots], Kind.SLOTS).result(timeout=30)
        assert calls == [2]
        for x, (_, out), y in zip(xs, slots, outputs, strict=True):
            assert y.data is out
            assert y.shape == (x.shape[0], 8, *demo.output_hw(6, 5))
            torch.testing.assert_close(y.tensor(), _expected(demo, x), rtol=1e-5, atol=1e-5)
        assert m.worker_direct_batches.labels("cpu")._value.get() == 1
    finally:
        worker.shutdown()


def test_a_direct_batch_out_of_memory_is_staged_and_halved(demo: Layer) -> None:
    def short_of_memory(*args: Any) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    m = Metrics()
    worker = _direct_worker(demo, short_of_memory, m)
    try:
        x = torch.randn(3, 16, 4, 4)
        slot, out = _pinned_slot(demo, x)
        (y,) = worker.submit(demo, [slot], Kind.SLOTS).result(timeout=30)
        assert y.data is out  # written into the slot by the staged path
        torch.testing.assert_close(y.tensor(), _expected(demo, x), rtol=1e-5, atol=1e-5)
        assert m.worker_failures.labels("cpu", "oom_retry")._value.get() == 1
        assert m.worker_direct_batches.labels("cpu")._value.get() == 0
    finally:
        worker.shutdown()


def test_a_replacement_leaves_the_batch_being_written_into_slots_to_the_old_thread(demo: Layer) -> None:
    """Its slots must stay its requests' until the GPU's writes are over: not failed by the replacement (which
    would free them for others), answered by the old thread once written; the batch queued behind it fails."""
    started, go = threading.Event(), threading.Event()
    direct, _ = _direct_by_reference(started, go)
    worker = _direct_worker(demo, direct)
    try:
        x = torch.randn(1, 16, 4, 4)
        slot, out = _pinned_slot(demo, x)
        writing = worker.submit(demo, [slot], Kind.SLOTS)
        assert started.wait(30)
        queued = worker.submit(demo, [_pinned_slot(demo, x)[0]], Kind.SLOTS)
        assert worker.restart("stalled")
        with pytest.raises(InternalError, match="stalled"):
            queued.result(timeout=30)
        assert not writing.done()
        go.set()
        (y,) = writing.result(timeout=30)
        assert y.data is out
        torch.testing.assert_close(y.tensor(), _expected(demo, x), rtol=1e-5, atol=1e-5)
        again = worker.submit(demo, [_pinned_slot(demo, x)[0]], Kind.SLOTS).result(timeout=30)  # the new thread serves
        torch.testing.assert_close(again[0].tensor(), _expected(demo, x), rtol=1e-5, atol=1e-5)
    finally:
        go.set()
        worker.shutdown()


# --- the HTTP process's slots ---------------------------------------------------------------------------------


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.frames: list[bytes] = []

    def writelines(self, data: Any) -> None:
        self.frames.append(b"".join(bytes(p) for p in data))

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def _client(arena: shm.Arena | None) -> tuple[EngineClient, _Transport, SimpleNamespace]:
    engine = SimpleNamespace(metrics=Metrics(), lost=[], engine_lost=lambda exc: engine.lost.append(exc))
    client = EngineClient(engine, arena)  # type: ignore[arg-type]
    transport = _Transport()
    client.connection_made(transport)
    return client, transport, engine


def _sent(client: EngineClient, transport: _Transport) -> list[tuple[int, bytearray]]:
    client._flush()
    frames = []
    for data in transport.frames:
        while data:
            size, kind = struct.unpack_from("<IB", data)
            frames.append((kind, bytearray(data[5:4 + size])))
            data = data[4 + size:]
    transport.frames.clear()
    return frames


def _answer(client: EngineClient, request_id: int, y: torch.Tensor, slot_view: memoryview | None) -> None:
    if slot_view is None:
        frame = frames.result_frame(request_id, y, 1, 1, 0.0, "cpu")
    else:
        slot_view[:y.numel() * 4] = tensor_bytes(y)  # the engine's worker writes the slot, then answers
        frame = frames.result_frame(request_id, y, 1, 1, 0.0, "cpu", shared=True)
    data = b"".join(bytes(p) for p in frame)
    client.frame_received(data[4], bytearray(data[5:]))


def test_http_process_sends_through_slots_and_frees_them_on_the_engine_s_answers(demo: Layer) -> None:
    async def main() -> None:
        arena = shm.Arena(1 << 20)
        client, transport, engine = _client(arena)
        batcher = RemoteQueue(demo, 3, client)
        x = torch.randn(2, 16, 5, 5)
        items = [batcher.submit(x) for _ in range(4)]
        sent = _sent(client, transport)
        assert [k for k, _ in sent] == [frames.SUBMIT] * 4
        assert arena.slots == 4
        engine_view = memoryview(arena._map)  # the engine's mapping sees the same bytes
        reqs = [frames.parse_submit(body, engine_view) for _, body in sent]
        for req in reqs:
            assert torch.equal(req.x.tensor(), x)
            assert req.out_offset is not None
        y = _expected(demo, x)
        out_bytes = y.numel() * 4

        # A result in the slot: answered from there, so the slot stays taken while the answer can be read.
        _answer(client, reqs[0].request_id, y, engine_view[reqs[0].out_offset:reqs[0].out_offset + out_bytes])
        result: Result = items[0].future.result()
        assert torch.equal(result.output.tensor(), y)
        assert arena.slots == 4
        del result
        items[0] = None  # its future held the result: the last view of the slot is gone
        assert arena.slots == 3

        # An error frees the slot too.
        data = b"".join(bytes(p) for p in frames.error_frame(reqs[1].request_id, OverloadedError("full")))
        client.frame_received(data[4], bytearray(data[5:]))
        assert isinstance(items[1].future.exception(), OverloadedError)
        assert arena.slots == 2

        # A request given up on keeps its slot until the engine's last word on it (here DONE).
        assert batcher.drop(items[2], "disconnected")
        assert [k for k, _ in _sent(client, transport)] == [frames.DROP]
        assert arena.slots == 2
        data = b"".join(bytes(p) for p in frames.done_frame(reqs[2].request_id))
        client.frame_received(data[4], bytearray(data[5:]))
        assert arena.slots == 1

        # Dropped after its batch started: the result still comes, frees the slot, and nobody sees it.
        assert batcher.drop(items[3], "cancelled")
        _answer(client, reqs[3].request_id, y, engine_view[reqs[3].out_offset:reqs[3].out_offset + out_bytes])
        assert arena.slots == 0
        assert arena.alloc(arena.size) == 0
        text = engine.metrics.render().decode()
        assert 'deconv_ipc_requests_total{path="shared"} 4.0' in text

    run(main())


def test_an_answer_in_a_slot_holds_it_until_its_last_view_is_gone(demo: Layer) -> None:
    """A result the engine wrote into a slot is answered from the slot (no copy): the slot is not given back, so no
    other request's input or output can be written there, while anything (the result, a slice, a tensor over
    it) can still read it; its last view gone, the slot serves the next request."""
    async def main() -> None:
        x = torch.randn(1, 16, 4, 4)
        y = _expected(demo, x)
        out_bytes = y.numel() * 4
        arena = shm.Arena(shm.aligned(x.numel() * 4) + out_bytes)  # room for one request
        client, transport, _ = _client(arena)
        batcher = RemoteQueue(demo, 0, client)
        engine_view = memoryview(arena._map)

        def answer_in_slot(item: Any) -> Result:
            ((_, body),) = _sent(client, transport)
            req = frames.parse_submit(body, engine_view)
            assert req.out_offset is not None
            _answer(client, req.request_id, _expected(demo, req.x.tensor().clone()),
                    engine_view[req.out_offset:req.out_offset + out_bytes])
            return item.future.result()  # type: ignore[no-any-return]

        item = batcher.submit(x)
        first = answer_in_slot(item)
        del item  # (its future holds the result too)
        assert first.output.data.obj is not arena._map  # a view of the slot, made to hold it
        assert torch.equal(first.output.tensor(), y)
        assert arena.slots == 1
        part = first.output.data[out_bytes // 2:]
        tensor = first.output.tensor()
        del first
        assert arena.slots == 1  # a slice and a tensor still read it

        other = torch.randn(1, 16, 4, 4)
        inline = batcher.submit(other)  # the arena is full: this one travels inline and cannot touch the slot
        ((_, body),) = _sent(client, transport)
        assert frames._SUBMIT.unpack_from(body)[3] == 0
        _answer(client, frames.parse_submit(body).request_id, _expected(demo, other), None)
        assert torch.equal(inline.future.result().output.tensor(), _expected(demo, other))
        assert torch.equal(tensor, y)
        assert bytes(part) == bytes(tensor_bytes(y))[out_bytes // 2:]

        del part
        assert arena.slots == 1
        del tensor  # the last view: the slot is given back at once
        assert arena.slots == 0
        item = batcher.submit(other)  # and serves the next request, whose answer is its own
        second = answer_in_slot(item)
        assert torch.equal(second.output.tensor(), _expected(demo, other))
        assert arena.slots == 1

        # The last view dropped in another thread: the slot is given back on the event loop's thread.
        holder = [second]
        del second, item
        await asyncio.to_thread(holder.clear)
        assert arena.slots == 0

    run(main())


def test_a_body_read_into_the_arena_goes_to_the_engine_where_it_is(demo: Layer, tmp_path: Path) -> None:
    """A body in memory the engine lent (``RemoteEngine.body_buffer``: a slot of the arena) is decoded in place and
    its input named where it lies, with a slot for the output only: no copy. The body's slot is held until the
    engine's last word on the request (RESULT, ERROR or DONE), whatever the route still holds; without room for
    the output the input travels inline."""
    async def main() -> None:
        x = torch.randn(2, 16, 5, 5)
        y = _expected(demo, x)
        body_bytes = codec.encode(x, codec.NPY)
        out_bytes = y.numel() * 4
        arena = shm.Arena(2 * shm.aligned(len(body_bytes)) + shm.aligned(out_bytes) - shm.ALIGN)
        client, transport, _ = _client(arena)
        engine = RemoteEngine(Settings(layer_repository=tmp_path), str(tmp_path / "engine.sock"))
        engine.client = client
        batcher = RemoteQueue(demo, 0, client)
        engine_view = memoryview(arena._map)

        def submitted() -> frames.Submit:
            ((_, frame),) = _sent(client, transport)
            return frames.parse_submit(frame, engine_view)

        body = engine.body_buffer(len(body_bytes))
        assert body is not None
        assert arena.slots == 1
        body[:] = body_bytes
        x_in = codec.decode_raw(body, codec.NPY)
        del body
        item = batcher.submit(x_in)
        req = submitted()
        assert req.out_offset is not None
        header = len(body_bytes) - x.numel() * 4
        assert arena.offset_of(req.x.data) == arena.offset_of(x_in.data) == header  # the body's own bytes
        assert arena.slots == 2  # the body's slot and the output's
        assert torch.equal(req.x.tensor(), x)
        del x_in  # the route lets go of the body: the engine may still read it
        assert arena.slots == 2
        _answer(client, req.request_id, y, engine_view[req.out_offset:req.out_offset + out_bytes])
        assert arena.slots == 1  # the engine's last word: the body's slot is given back; the answer holds its own
        result = item.future.result()
        assert torch.equal(result.output.tensor(), y)
        del result, item
        assert arena.slots == 0

        # Dropped: the body's slot is held until DONE.
        body = engine.body_buffer(len(body_bytes))
        assert body is not None
        body[:] = body_bytes
        item = batcher.submit(codec.decode_raw(body, codec.NPY))
        del body
        req = submitted()
        assert batcher.drop(item, "disconnected")
        _sent(client, transport)
        assert arena.slots == 2
        data = b"".join(bytes(p) for p in frames.done_frame(req.request_id))
        client.frame_received(data[4], bytearray(data[5:]))
        assert arena.slots == 0

        # No room for the output next to two bodies: the input goes inline.
        bodies = [engine.body_buffer(len(body_bytes)) for _ in range(2)]
        assert all(b is not None for b in bodies)
        assert arena.slots == 2
        bodies[0][:] = body_bytes  # type: ignore[index]
        item = batcher.submit(codec.decode_raw(bodies[0], codec.NPY))  # type: ignore[arg-type]
        req = submitted()
        assert req.out_offset is None
        assert torch.equal(req.x.tensor(), x)
        del bodies
        assert arena.slots == 0  # an inline request holds no slot

    run(main())


def test_http_process_sends_inline_what_does_not_fit(demo: Layer) -> None:
    async def main() -> None:
        small = torch.randn(1, 16, 4, 4)  # 1 KiB in, 8x8x8 x 4 = 2 KiB out
        arena = shm.Arena(shm.aligned(small.numel() * 4) + 2048)  # room for one of them
        client, transport, engine = _client(arena)
        batcher = RemoteQueue(demo, 0, client)
        first, second = batcher.submit(small), batcher.submit(small)
        big = batcher.submit(torch.randn(1, 16, 8, 8))
        sent = _sent(client, transport)
        flags = [frames._SUBMIT.unpack_from(body)[3] for _, body in sent]
        assert flags == [frames.SHARED, 0, 0]
        assert arena.slots == 1
        inline = frames.parse_submit(sent[1][1])
        assert inline.out_offset is None
        assert torch.equal(inline.x.tensor(), small)
        y = _expected(demo, small)
        _answer(client, inline.request_id, y, None)  # an inline request gets an inline result
        assert torch.equal(second.future.result().output.tensor(), y)
        assert arena.slots == 1
        text = engine.metrics.render().decode()
        assert 'deconv_ipc_requests_total{path="inline"} 2.0' in text
        client.connection_lost(None)  # the engine is gone: every request fails, nothing more uses the arena
        assert isinstance(first.future.exception(), Exception)
        assert isinstance(big.future.exception(), Exception)
        assert client.slots == {}
        assert client.arena is None
        assert engine.lost == [None]

    run(main())


def test_http_process_without_an_arena_sends_everything_inline(demo: Layer) -> None:
    async def main() -> None:
        client, transport, _ = _client(None)
        RemoteQueue(demo, 0, client).submit(torch.randn(1, 16, 4, 4))
        ((kind, body),) = _sent(client, transport)
        assert kind == frames.SUBMIT
        assert frames._SUBMIT.unpack_from(body)[3] == 0
        assert math.prod(frames.parse_submit(body).x.shape) == 256

    run(main())


# --- the engine's side ----------------------------------------------------------------------------------------


def _engine_connection(arena: memoryview) -> tuple[Any, _Transport]:
    from service.engine.process import EngineConnection

    conn = EngineConnection(SimpleNamespace(), arena)  # type: ignore[arg-type]
    transport = _Transport()
    conn.transport = transport
    return conn, transport


def test_engine_answers_slot_requests_in_their_slots_and_says_done_for_dropped_ones(demo: Layer) -> None:
    async def main() -> None:
        arena = memoryview(bytearray(1 << 16))
        conn, transport = _engine_connection(arena)
        x = torch.randn(1, 16, 4, 4)
        frame = b"".join(bytes(p) for p in frames.submit_frame(5, 0, x, 0.0, None, (0, 1024)))
        req = frames.parse_submit(bytearray(frame[5:]), arena)
        slot = conn._slot(req, SimpleNamespace(layer=demo))
        assert slot.out.nbytes == 8 * 8 * 8 * 4
        assert slot.out.obj is arena.obj
        y = _expected(demo, x)
        slot.out[:] = tensor_bytes(y)  # what the worker does (Worker._deliver)
        answers = []
        for rid, output in ((5, RawTensor(slot.out, y.dtype, tuple(y.shape))),  # in the slot
                            (6, RawTensor(memoryview(bytearray(tensor_bytes(y))), y.dtype, tuple(y.shape))),
                            (7, None)):  # dropped while queued
            conn.pending[rid] = (None, SimpleNamespace(x=slot))
            conn._answer(rid, None if output is None else Result(output, 1, 1, 0.0, "cpu"))  # what Answer hands over
        conn._flush()
        data = transport.frames[0]
        while data:
            size, kind = struct.unpack_from("<IB", data)
            answers.append((kind, bytearray(data[5:4 + size])))
            data = data[4 + size:]
        assert [k for k, _ in answers] == [frames.RESULT, frames.RESULT, frames.DONE]
        shared = frames.parse_result(answers[0][1], torch.float32, slot.out)
        inline = frames.parse_result(answers[1][1], torch.float32, slot.out)
        assert shared.shared
        assert not inline.shared
        assert len(answers[1][1]) - len(answers[0][1]) == y.numel() * 4
        assert torch.equal(shared.y.tensor(), y)
        assert torch.equal(inline.y.tensor(), y)
        assert frames.result_id(answers[2][1]) == 7

    run(main())


def test_engine_refuses_an_output_slot_past_the_arena(demo: Layer) -> None:
    async def main() -> None:
        arena = memoryview(bytearray(4096))
        conn, _ = _engine_connection(arena)
        x = torch.randn(1, 16, 4, 4)  # 1 KiB in, 2 KiB out
        frame = b"".join(bytes(p) for p in frames.submit_frame(5, 0, x, 0.0, None, (0, 3072)))
        req = frames.parse_submit(bytearray(frame[5:]), arena)
        with pytest.raises(frames.ProtocolError, match=r"output slot \[3072, 5120\) is outside"):
            conn._slot(req, SimpleNamespace(layer=demo))

    run(main())
