"""GPU tests (run with ``-m cuda`` on the device machine): the service on every GPU against PyTorch in float64."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from service.config import DEFAULT_LAYER_REPOSITORY, Settings
from service.engine.local import GPU_WORKERS, LocalEngine
from service.engine.registry import Layer
from tests.numerics import rel_err

from .conftest import NPY, SAFETENSORS, ServerProcess, load_npy, metric_value, npy_bytes, run, serve_app

pytestmark = pytest.mark.cuda

COMPILE_TIMEOUT_S = 600  # first start compiles the kernels


def _reference(layer: Layer, x: torch.Tensor) -> torch.Tensor:
    c = layer.config
    b = layer.bias.double() if layer.bias is not None else None
    return F.conv_transpose2d(x.double().cpu(), layer.weight.double(), b, c.stride, c.padding, c.output_padding,
                              c.groups, c.dilation)


def _gpu_workers() -> list[str]:
    """The names of the workers of a server on every GPU with the default workers a GPU."""
    return [f"cuda:{i}/{j}" for i in range(torch.cuda.device_count()) for j in range(GPU_WORKERS)]


def _settings(**kw: Any) -> Settings:
    return Settings(layer_repository=DEFAULT_LAYER_REPOSITORY, devices="all", **kw)


def test_every_bundled_layer_on_every_gpu_matches_float64():
    async def main() -> None:
        async with serve_app(_settings(), timeout=COMPILE_TIMEOUT_S) as (app, client):
            engine: LocalEngine = app.state.engine
            assert engine.backend == "cuda"
            assert len(engine.pool.workers) == GPU_WORKERS * torch.cuda.device_count()
            assert engine.pool.devices == torch.cuda.device_count()
            for layer in engine.registry:
                c = layer.config
                for n, h, w in ((1, 7, 5), (5, 16, 16), (3, 13, 29)):
                    x = torch.randn(n, c.in_channels, h, w, dtype=torch.float64).to(layer.dtype)
                    if layer.dtype == torch.bfloat16:
                        r = await client.post(f"/deconv?layer={c.name}", content=st_save({"x": x}),
                                              headers={"content-type": SAFETENSORS})
                        assert r.status_code == 200, r.text[:300]
                        y = st_load(r.content)["output"]
                    else:
                        r = await client.post(f"/deconv?layer={c.name}", content=npy_bytes(x.numpy()),
                                              headers={"content-type": NPY})
                        assert r.status_code == 200, r.text[:300]
                        y = torch.from_numpy(load_npy(r.content).copy())
                    assert y.dtype == layer.dtype
                    err = rel_err(y, _reference(layer, x))
                    assert err <= layer.tolerance, f"{c.name} {list(x.shape)}: {err:.2e} > {layer.tolerance:.0e}"

    run(main(), COMPILE_TIMEOUT_S + 120)


def test_concurrent_requests_batch_on_the_gpu_and_split_back_correctly():
    async def main() -> None:
        async with serve_app(_settings(max_queue_delay_ms=50.0), timeout=COMPILE_TIMEOUT_S) as (app, client):
            layer = app.state.engine.registry.get("demo")
            xs = [torch.randn(n, 16, 16, 16) for n in (1, 2, 3, 4, 5, 6, 7, 8)]
            responses = await asyncio.gather(*(
                client.post("/deconv?layer=demo", content=npy_bytes(x.numpy()), headers={"content-type": NPY})
                for x in xs))
            sizes = set()
            for x, r in zip(xs, responses, strict=True):
                assert r.status_code == 200, r.text[:300]
                sizes.add(int(r.headers["x-deconv-batch-size"]))
                assert rel_err(torch.from_numpy(load_npy(r.content).copy()), _reference(layer, x)) <= layer.tolerance
            assert max(sizes) > 8  # several requests shared a kernel call
            text = (await client.get("/metrics")).text
            assert metric_value(text, "deconv_gpu_memory_bytes", device="cuda:0", kind="allocated") > 0
            total = sum(metric_value(text, "deconv_worker_batches_total", worker=name) for name in _gpu_workers())
            assert total >= 2

    run(main(), COMPILE_TIMEOUT_S + 120)


def test_kserve_on_gpu():
    async def main() -> None:
        async with serve_app(_settings(), timeout=COMPILE_TIMEOUT_S) as (app, client):
            layer = app.state.engine.registry.get("unet_up")
            x = torch.randn(2, 128, 9, 11)
            raw = x.numpy().tobytes()
            head = (b'{"inputs":[{"name":"input","shape":[2,128,9,11],"datatype":"FP32",'
                    b'"parameters":{"binary_data_size":%d}}],"parameters":{"binary_data_output":true}}' % len(raw))
            r = await client.post("/v2/models/unet_up/infer", content=head + raw,
                                  headers={"inference-header-content-length": str(len(head))})
            assert r.status_code == 200, r.text[:300]
            n = int(r.headers["inference-header-content-length"])
            y = torch.from_numpy(np.frombuffer(r.content[n:], np.float32).reshape(2, 64, 18, 22).copy())
            assert rel_err(y, _reference(layer, x)) <= layer.tolerance

    run(main(), COMPILE_TIMEOUT_S + 120)


def test_multi_process_server_on_gpu(tmp_path: Path) -> None:
    """Two HTTP processes feeding the GPU engine: every bundled layer, concurrent requests, GPU metrics; the tensors
    go through the HTTP processes' shared memory (the worker reads inputs from and writes outputs into slots), and
    megabyte ones straight between the page-locked slots and the GPU."""
    from service.engine.registry import BatchLimits, load_repository

    proc = ServerProcess({"DECONV_DEVICES": "all", "DECONV_HTTP_PROCESSES": "2", "DECONV_MAX_QUEUE_DELAY_MS": "20"},
                         tmp_path / "server.log")
    registry = load_repository(DEFAULT_LAYER_REPOSITORY, BatchLimits(64, 1 << 28, 2.0, 256))

    async def one(client: httpx.AsyncClient, layer: Layer, n: int, hw: tuple[int, int] = (12, 9)) -> None:
        c = layer.config
        x = torch.randn(n, c.in_channels, *hw, dtype=torch.float64).to(layer.dtype)
        if layer.dtype == torch.bfloat16:
            body, ctype = st_save({"x": x}), SAFETENSORS
        else:
            body, ctype = npy_bytes(x.numpy()), NPY
        r = await client.post(f"/deconv?layer={c.name}", content=body, headers={"content-type": ctype})
        assert r.status_code == 200, r.text[:300]
        y = st_load(r.content)["output"] if ctype == SAFETENSORS else torch.from_numpy(load_npy(r.content).copy())
        assert y.dtype == layer.dtype
        assert rel_err(y, _reference(layer, x)) <= layer.tolerance, c.name

    async def main() -> None:
        big = registry.get("dcgan_up1")  # [n, 128, 32, 32] fp32: 0.5 MiB a sample in, 1 MiB out
        assert big is not None
        jobs = [(layer, n, (12, 9)) for layer in registry for n in (1, 2, 3, 4)]
        jobs += [(big, n, (32, 32)) for n in (1, 2, 3, 4)]
        clients = [httpx.AsyncClient(base_url=proc.url, timeout=60) for _ in jobs]  # one connection each
        try:
            await asyncio.gather(*(one(cl, *job) for cl, job in zip(clients, jobs, strict=True)))
            # The engine process samples GPU memory once a second (no event reaches this process): poll, bounded.
            deadline = time.monotonic() + 60
            while metric_value(text := (await clients[0].get("/metrics")).text, "deconv_gpu_memory_bytes",
                               device="cuda:0", kind="allocated") <= 0:
                assert time.monotonic() < deadline, "no GPU memory sample within 60 s"
                await asyncio.sleep(0.1)
        finally:
            for cl in clients:
                await cl.aclose()
        assert metric_value(text, "deconv_http_processes") == 2
        assert metric_value(text, "deconv_gpu_memory_bytes", device="cuda:0", kind="allocated") > 0
        assert metric_value(text, "deconv_requests_total", layer="demo", api="native", status="200") == 4
        assert metric_value(text, "deconv_ipc_requests_total", path="shared") == len(jobs)  # shared memory
        direct = sum(metric_value(text, "deconv_worker_direct_batches_total", worker=name) for name in _gpu_workers())
        assert direct >= 1  # page-locked

    try:
        proc.wait_ready(COMPILE_TIMEOUT_S)
        run(main(), 300)
    finally:
        assert proc.stop(60) == 0, proc.log()
