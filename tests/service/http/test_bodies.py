"""Request bodies in reused buffers (service/http/bodies.py): lent, back only when the last view is gone, bounded;
and bodies read through them by the routes."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from service.config import Settings
from service.engine.local import LocalEngine
from service.http.bodies import GRAIN, MIN_BYTES, BodyPool
from tests.numerics import rel_err

from ..conftest import NPY, load_npy, npy_bytes, reference, run, serve_app, write_layer

MiB = 2**20


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def test_small_bodies_and_a_pool_of_nothing_get_no_buffer() -> None:
    async def main() -> None:
        assert BodyPool(64 * MiB).take(MIN_BYTES - 1) is None
        assert BodyPool(0).take(MiB) is None
        with pytest.raises(ValueError, match="max_idle_bytes"):
            BodyPool(-1)

    run(main())


def test_a_buffer_comes_back_when_its_last_view_is_gone_and_is_lent_again() -> None:
    async def main() -> None:
        pool = BodyPool(64 * MiB)
        view = pool.take(MiB + 3)
        assert view is not None
        assert (len(view), view.readonly) == (MiB + 3, False)
        view[:4] = b"abcd"
        first = address(view)
        tensor = torch.frombuffer(view[:8], dtype=torch.uint8)  # a decoded tensor keeps the buffer
        part = view[100:200]
        del view
        assert pool.idle == 0
        del tensor
        assert pool.idle == 0
        del part
        assert (pool.idle, pool.idle_bytes) == (1, MiB + GRAIN)
        again = pool.take(MiB)
        assert again is not None
        assert (address(again), bytes(again[:4])) == (first, b"abcd")
        assert (pool.taken, pool.reused, pool.idle) == (2, 1, 0)

    run(main())


def test_a_body_takes_an_idle_buffer_only_when_it_is_not_much_larger() -> None:
    async def main() -> None:
        pool = BodyPool(64 * MiB)
        big = pool.take(4 * MiB)
        del big
        small = pool.take(MIN_BYTES)  # 4 MiB for a 64 KiB body: a new buffer
        assert (pool.reused, pool.idle) == (0, 1)
        near = pool.take(4 * MiB - 200 * 2**10)  # within a quarter of the body: the idle one
        assert (pool.reused, pool.idle) == (1, 0)
        del small, near

    run(main())


def test_idle_buffers_are_bounded_the_least_recently_returned_given_up_first() -> None:
    async def main() -> None:
        pool = BodyPool(2 * MiB)
        a, b, c = pool.take(MiB), pool.take(MiB), pool.take(MiB)
        assert None not in (a, b, c)
        addresses = [address(v) for v in (a, b, c) if v is not None]
        del a, b, c  # returned in this order: a's buffer is given up
        assert (pool.idle, pool.idle_bytes) == (2, 2 * MiB)
        d, e = pool.take(MiB), pool.take(MiB)
        assert {address(v) for v in (d, e) if v is not None} == set(addresses[1:])
        del d, e
        huge = pool.take(3 * MiB)  # larger than the bound: never kept, and nothing else given up for it
        del huge
        assert (pool.idle, pool.idle_bytes) == (2, 2 * MiB)

    run(main())


def test_a_view_dropped_in_another_thread_comes_back_on_the_event_loop() -> None:
    async def main() -> None:
        pool = BodyPool(64 * MiB)
        box = [pool.take(MiB)]
        seen: list[int] = []

        def drop() -> None:
            box.clear()
            seen.append(pool.idle)  # not yet: the loop takes it back

        worker = threading.Thread(target=drop)
        worker.start()
        worker.join()
        assert seen == [0]
        await asyncio.sleep(0)  # the loop runs the release the thread scheduled before this task resumes
        assert pool.idle == 1

    run(main())


def test_large_bodies_are_read_into_reused_buffers_with_the_right_answers(tmp_path: Path) -> None:
    module = write_layer(tmp_path, "wide", in_channels=16, out_channels=4, kernel_size=2, stride=2)
    settings = Settings(layer_repository=tmp_path, devices="cpu", body_pool_bytes=16 * MiB)

    async def main() -> None:
        async with serve_app(settings) as (app, client):
            pool: BodyPool = app.state.bodies
            for seed in range(3):
                x = torch.randn(2, 16, 32, 32, generator=torch.Generator().manual_seed(seed))  # 128 KiB
                r = await client.post("/deconv", params={"layer": "wide"}, content=npy_bytes(x.numpy()),
                                      headers={"content-type": NPY, "accept": NPY})
                assert r.status_code == 200, r.text
                assert rel_err(torch.from_numpy(load_npy(r.content)), reference(module, x)) < 1e-6
            assert pool.taken == 3
            short = npy_bytes(np.zeros((2, 16, 32, 32), np.float32))
            r = await client.post("/deconv", params={"layer": "wide"}, content=short[:-4],
                                  headers={"content-type": NPY, "content-length": str(len(short))})
            assert r.status_code == 400
            assert "ended after" in r.text

    run(main())


def test_only_bodies_that_carry_a_tensor_as_it_is_are_read_into_the_engines_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A body that holds its tensor's bytes as they are (.npy, safetensors, KServe binary) is read into memory the
    engine lends (``Engine.body_buffer``: a multi-process server's arena), from where the tensor goes on without a
    copy; a compressed or JSON body, whose tensor is made from it, goes to the reused buffers instead."""
    module = write_layer(tmp_path, "wide", in_channels=16, out_channels=4, kernel_size=2, stride=2)
    settings = Settings(layer_repository=tmp_path, devices="cpu", body_pool_bytes=16 * MiB)
    lent: list[int] = []

    def body_buffer(self: object, nbytes: int) -> memoryview:
        lent.append(nbytes)
        return memoryview(bytearray(nbytes))

    monkeypatch.setattr(LocalEngine, "body_buffer", body_buffer)
    x = torch.randn(2, 16, 32, 32, generator=torch.Generator().manual_seed(3))  # 128 KiB
    ref = reference(module, x)
    binary = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                          "parameters": {"binary_data_size": x.numel() * 4}}],
              "parameters": {"binary_data_output": True}}
    head = json.dumps(binary).encode()
    as_json = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                      "data": x.flatten().tolist()}],
                          "parameters": {"binary_data_output": True}}).encode()

    async def main() -> None:
        async with serve_app(settings) as (_, client):
            bodies = [("/deconv?layer=wide", npy_bytes(x.numpy()), {"content-type": NPY}, True),
                      ("/v2/models/wide/infer", head + x.numpy().tobytes(),
                       {"inference-header-content-length": str(len(head))}, True),
                      ("/v2/models/wide/infer", gzip.compress(head + x.numpy().tobytes()),
                       {"inference-header-content-length": str(len(head)), "content-encoding": "gzip"}, False),
                      ("/v2/models/wide/infer", as_json, {"content-type": "application/json"}, False)]
            for path, body, headers, engines in bodies:
                lent.clear()
                r = await client.post(path, content=body, headers=headers)
                assert r.status_code == 200, r.text[:300]
                if path.startswith("/deconv"):
                    y = load_npy(r.content)
                else:
                    n = int(r.headers["inference-header-content-length"])
                    y = np.frombuffer(r.content[n:], np.float32).reshape(tuple(ref.shape))
                assert rel_err(torch.from_numpy(np.array(y)), ref) < 1e-5
                assert lent == ([len(body)] if engines else []), path

    run(main())
