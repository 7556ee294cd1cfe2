"""``Client(..., shared_memory=True)`` and ``AsyncClient(..., shared_memory=True)``: tensors through the server's
KServe v2 system shared-memory extension, against the same servers as test_integration.py (in-process and a live
subprocess), sync and async; numbers against ``F.conv_transpose2d`` in float64 on the bundled weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from deconv_client import InvalidInputError
from deconv_client._shm import MIN_REGION_BYTES, RegionPool

from tests.numerics import rel_err

from .conftest import Mirror
from .test_integration import (  # noqa: F401  (fixtures)
    asgi_server,
    layer_repo,
    live_server,
    make,
    random_input,
    reference,
    server,
    tolerance,
)


def _names(status: list[dict[str, object]]) -> set[str]:
    return {str(s["name"]) for s in status if str(s["name"]).startswith("deconv-client-")}


def test_deconv_through_shared_memory(make) -> None:  # noqa: F811  (the imported fixture)
    client: Mirror = make(shared_memory=True)
    plain: Mirror = make()
    before = _names(plain.shared_memory_status())
    x = random_input("demo", n=2, h=9, w=7)
    y = client.deconv("demo", x.numpy())
    assert isinstance(y, np.ndarray)
    assert y.dtype == np.float32
    assert rel_err(torch.from_numpy(y), reference("demo", x)) < tolerance("demo")
    y = client.deconv("demo", x[0])  # torch, unbatched
    assert isinstance(y, torch.Tensor)
    assert rel_err(y, reference("demo", x[:1])[0]) < tolerance("demo")
    for name in ("demo_fp16", "dcgan_up2_bf16"):  # half precision, bfloat16 through torch
        xh = random_input(name, n=1, h=5, w=5, seed=3)
        assert rel_err(client.deconv(name, xh), reference(name, xh)) < tolerance(name)
    mine = _names(plain.shared_memory_status()) - before
    assert len(mine) == 1  # one region, reused by every call
    # a tensor larger than the region: a new region, the old one unregistered
    big = random_input("demo", n=4, h=40, w=40, seed=5)
    assert rel_err(torch.from_numpy(client.deconv("demo", big.numpy())), reference("demo", big)) < tolerance("demo")
    now = _names(plain.shared_memory_status()) - before
    assert len(now) == 1
    assert now != mine
    client.close()
    assert _names(plain.shared_memory_status()) - before == set()
    assert not any(Path("/dev/shm", name).exists() for name in now | mine)


def test_errors_come_through_and_the_region_is_reused(make) -> None:  # noqa: F811  (the imported fixture)
    client: Mirror = make(shared_memory=True)
    plain: Mirror = make()
    before = _names(plain.shared_memory_status())
    with pytest.raises(InvalidInputError, match="channels"):
        client.deconv("demo", np.zeros((1, 3, 4, 4), np.float32))
    x = random_input("demo", n=1, h=4, w=4)
    assert rel_err(torch.from_numpy(client.deconv("demo", x.numpy())), reference("demo", x)) < tolerance("demo")
    assert len(_names(plain.shared_memory_status()) - before) == 1


def test_deconv_many_through_shared_memory(make) -> None:  # noqa: F811  (the imported fixture)
    client: Mirror = make(shared_memory=True)
    xs = [random_input("demo", n=1, h=6, w=6, seed=i) for i in range(6)]
    ys = client.deconv_many("demo", [x.numpy() for x in xs], concurrency=3)
    for x, y in zip(xs, ys, strict=True):
        assert rel_err(torch.from_numpy(y), reference("demo", x)) < tolerance("demo")


def test_region_pool_reuses_and_retires() -> None:
    pool = RegionPool()
    a, retired = pool.acquire(100)
    assert a.size == MIN_REGION_BYTES
    assert retired == []
    b, _ = pool.acquire(100)  # a is busy: a second region
    assert b is not a
    a.registered = b.registered = True
    pool.release(a)
    pool.release(b)
    again, _ = pool.acquire(MIN_REGION_BYTES)
    assert again in (a, b)
    pool.release(again)
    big, retired = pool.acquire(MIN_REGION_BYTES + 1)
    assert big.size == 2 * MIN_REGION_BYTES
    assert set(retired) == {a, b}
    for region in retired:
        region.destroy()
    regions = pool.close()
    assert regions == [big]
    big.destroy()
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(1)
