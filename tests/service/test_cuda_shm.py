"""GPU tests of KServe CUDA shared memory (run with ``-m cuda`` on the device machine; bench/device/cuda_shm.sh).

The real server (one process, and two HTTP processes in front of the engine process) with its GPU worker, and
clients in this process, which pass it device memory: tritonclient's ``tritonclient.utils.cuda_shared_memory``
(skipped, with the reason, when the cuda-python package it needs is missing), raw KServe requests with regions of
torch allocations exported by ``deconv_client.cuda_ipc`` (mixed with host inputs and outputs), and the SDK with
CUDA torch tensors (``Client``/``AsyncClient(..., cuda_shared_memory=True)``). Every output is checked against
``F.conv_transpose2d`` in float64 with the layer's tolerance, as the other GPU service tests do. The client and the
server are different processes, as CUDA IPC requires.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from deconv_client import AsyncClient, Client, InvalidInputError, cuda_ipc

from bench.serving import service_load
from bench.serving.wire import check_output, make_input
from service.config import DEFAULT_LAYER_REPOSITORY
from service.engine.registry import BatchLimits, Layer, Registry, load_repository
from tests.numerics import rel_err

from .conftest import ServerProcess, metric_value, run

pytestmark = pytest.mark.cuda

COMPILE_TIMEOUT_S = 600  # the first start may compile the kernels


def _reference(layer: Layer, x: torch.Tensor) -> torch.Tensor:
    c = layer.config
    b = layer.bias.double() if layer.bias is not None else None
    x4 = x.double().cpu()
    y = F.conv_transpose2d(x4 if x4.dim() == 4 else x4[None], layer.weight.double(), b, c.stride, c.padding,
                           c.output_padding, c.groups, c.dilation)
    return y if x.dim() == 4 else y[0]


@pytest.fixture(scope="module", params=["1", "2"], ids=["single", "multi"])
def live(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("cuda-shm") / "server.log"
    proc = ServerProcess({"DECONV_DEVICES": "all", "DECONV_HTTP_PROCESSES": request.param, "DECONV_TUNE": "0"}, log)
    try:
        proc.wait_ready(COMPILE_TIMEOUT_S)
        yield proc
    finally:
        assert proc.stop(60) == 0, proc.log()[-5000:]
        assert "Traceback" not in proc.log(), proc.log()[-5000:]


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_repository(DEFAULT_LAYER_REPOSITORY, BatchLimits(64, 1 << 28, 2.0, 256))


def _cuda_shared_memory() -> Any:
    try:
        import tritonclient.utils.cuda_shared_memory as cudashm
    except (ImportError, RuntimeError) as exc:  # tritonclient raises RuntimeError without cuda-python
        pytest.skip(f"tritonclient.utils.cuda_shared_memory cannot be imported (it needs the cuda-python package, "
                    f"cuda.bindings): {exc}")
    return cudashm


def _triton(proc: ServerProcess) -> Any:
    """A new tritonclient client: a new connection (a multi-process server hands connections out in turn)."""
    import tritonclient.http as triton

    return triton.InferenceServerClient(proc.url.removeprefix("http://"), network_timeout=120.0)


def test_tritonclient_infers_through_cuda_shared_memory(live: ServerProcess, registry: Registry) -> None:
    cudashm = _cuda_shared_memory()
    import tritonclient.http as triton

    layer = registry.get("demo")
    x = torch.randn(2, 16, 16, 16, dtype=torch.float64).float()
    ref = _reference(layer, x)
    y_shape = [2, 8, 32, 32]
    in_bytes, out_bytes = x.numel() * 4, int(np.prod(y_shape)) * 4
    tag = uuid.uuid4().hex[:8]
    ins = cudashm.create_shared_memory_region(f"in-{tag}", in_bytes, 0)
    outs = cudashm.create_shared_memory_region(f"out-{tag}", out_bytes, 0)
    clients = [_triton(live) for _ in range(4)]
    try:
        cudashm.set_shared_memory_region(ins, [x.numpy()])
        assert "cuda_shared_memory" in clients[0].get_server_metadata()["extensions"]
        clients[0].register_cuda_shared_memory(f"in-{tag}", cudashm.get_raw_handle(ins), 0, in_bytes)
        clients[0].register_cuda_shared_memory(f"out-{tag}", cudashm.get_raw_handle(outs), 0, out_bytes)
        for client in clients[1:]:  # every connection (both HTTP processes of a multi-process server) sees them
            status = client.get_cuda_shared_memory_status()
            assert {(s["name"], s["device_id"], s["byte_size"]) for s in status} >= {
                (f"in-{tag}", 0, in_bytes), (f"out-{tag}", 0, out_bytes)}
        for client in clients[1:3]:
            inp = triton.InferInput("input", list(x.shape), "FP32")
            inp.set_shared_memory(f"in-{tag}", in_bytes)
            out = triton.InferRequestedOutput("output", binary_data=True)
            out.set_shared_memory(f"out-{tag}", out_bytes)
            result = client.infer("demo", [inp], outputs=[out])
            output = result.get_output("output")
            assert "data" not in output
            assert output["parameters"]["shared_memory_region"] == f"out-{tag}"
            assert output["parameters"]["shared_memory_byte_size"] == out_bytes
            y = cudashm.get_contents_as_numpy(outs, np.float32, y_shape)
            assert rel_err(y, ref) <= layer.tolerance
        # the input in CUDA shared memory, the output as binary data
        inp = triton.InferInput("input", list(x.shape), "FP32")
        inp.set_shared_memory(f"in-{tag}", in_bytes)
        result = clients[3].infer("demo", [inp], outputs=[triton.InferRequestedOutput("output", binary_data=True)])
        assert rel_err(result.as_numpy("output"), ref) <= layer.tolerance
        # unregistered through one connection: no connection can use it any more
        clients[0].unregister_cuda_shared_memory(f"in-{tag}")
        for client in clients[1:]:
            with pytest.raises(triton.InferenceServerException, match="no shared-memory region"):
                client.infer("demo", [inp])
        clients[1].unregister_cuda_shared_memory()
        for client in clients:
            assert client.get_cuda_shared_memory_status() == []
    finally:
        for client in clients:
            client.close()
        cudashm.destroy_shared_memory_region(ins)
        cudashm.destroy_shared_memory_region(outs)


def test_system_regions_go_between_the_region_and_the_gpu(live: ServerProcess, registry: Registry) -> None:
    """tritonclient's system shared memory against a GPU server: the engine maps and page-locks the regions, the
    tensors go between them and the GPU by reference (in a multi-process server the requests reach the engine as
    references, path "cuda", not through the arena), megabyte requests among them; numbers against float64."""
    triton = pytest.importorskip("tritonclient.http", reason="tritonclient is not installed")
    import tritonclient.utils.shared_memory as sysshm

    layer = registry.get("dcgan_up1")  # [n, 128, 32, 32] fp32: 0.5 MiB a sample in, 1 MiB out
    tag = uuid.uuid4().hex[:8]
    xs = [torch.randn(n, 128, 32, 32, dtype=torch.float64).float() for n in (1, 4, 2)]
    in_bytes = sum(x.numel() * 4 for x in xs)
    out_bytes = 2 * in_bytes
    ins = sysshm.create_shared_memory_region(f"in-{tag}", f"/deconv-in-{tag}", in_bytes)
    outs = sysshm.create_shared_memory_region(f"out-{tag}", f"/deconv-out-{tag}", out_bytes)
    client = _triton(live)
    before = _ipc_by_reference(live)
    try:
        sysshm.set_shared_memory_region(ins, [x.numpy() for x in xs])
        client.register_system_shared_memory(f"in-{tag}", f"/deconv-in-{tag}", in_bytes)
        client.register_system_shared_memory(f"out-{tag}", f"/deconv-out-{tag}", out_bytes)
        at_in = at_out = 0
        for x in xs:
            n_in, n_out = x.numel() * 4, x.numel() * 8
            inp = triton.InferInput("input", list(x.shape), "FP32")
            inp.set_shared_memory(f"in-{tag}", n_in, offset=at_in)
            out = triton.InferRequestedOutput("output", binary_data=True)
            out.set_shared_memory(f"out-{tag}", n_out, offset=at_out)
            result = client.infer("dcgan_up1", [inp], outputs=[out])
            assert result.get_output("output")["parameters"]["shared_memory_byte_size"] == n_out
            y = np.array(sysshm.get_contents_as_numpy(outs, np.float32, [x.shape[0], 64, 64, 64], offset=at_out))
            assert rel_err(y, _reference(layer, x)) <= layer.tolerance
            at_in, at_out = at_in + n_in, at_out + n_out
        if metric_value(httpx.get(live.url + "/metrics").text, "deconv_http_processes") == 2:
            assert _ipc_by_reference(live) - before == len(xs)
        client.unregister_system_shared_memory()
    finally:
        client.close()
        sysshm.destroy_shared_memory_region(ins)
        sysshm.destroy_shared_memory_region(outs)


def _ipc_by_reference(proc: ServerProcess) -> float:
    """Requests a multi-process server's HTTP processes sent to the engine naming regions the engine maps."""
    return metric_value(httpx.get(proc.url + "/metrics").text, "deconv_ipc_requests_total", path="cuda")


def _region(t: torch.Tensor) -> tuple[dict[str, Any], int]:
    """The register body of the allocation that holds ``t`` (torch's caching allocator hands out pieces of larger
    allocations: the handle names the allocation's base), and ``t``'s offset in it."""
    cuda = cuda_ipc.cuda()
    device = t.device.index or 0
    base, size = cuda.allocation(device, t.data_ptr())
    handle = cuda.get_handle(device, base)
    return {"raw_handle": {"b64": base64.b64encode(handle).decode()}, "device_id": device, "byte_size": size}, \
        t.data_ptr() - base


def test_kserve_requests_name_regions_of_torch_allocations(live: ServerProcess, registry: Registry) -> None:
    """Regions of torch allocations with the SDK's CUDA IPC calls: CUDA input and output at offsets, each mixed
    with a host output or input, an unbatched sample, and the checks a client's mistakes meet."""
    layer = registry.get("demo")
    x = torch.randn(3, 16, 13, 29, device="cuda")
    ref = _reference(layer, x)
    y = torch.full((3, 8, 26, 58), float("nan"), device="cuda")
    torch.cuda.synchronize()
    (in_body, in_at), (out_body, out_at) = _region(x), _region(y)
    tag = uuid.uuid4().hex[:8]
    x_param = {"shared_memory_region": f"in-{tag}", "shared_memory_byte_size": x.numel() * 4,
               "shared_memory_offset": in_at}
    y_param = {"shared_memory_region": f"out-{tag}", "shared_memory_byte_size": y.numel() * 4,
               "shared_memory_offset": out_at}

    def body(inp: dict[str, Any] | None, out: dict[str, Any] | None, shape: list[int]) -> dict[str, Any]:
        tensor: dict[str, Any] = {"name": "input", "shape": shape, "datatype": "FP32"}
        if inp is None:
            tensor["data"] = x[: shape[0]].cpu().numpy().ravel().tolist() if len(shape) == 4 else \
                x[0].cpu().numpy().ravel().tolist()
        else:
            tensor["parameters"] = inp
        return {"inputs": [tensor], "outputs": [{"name": "output", "parameters": out or {"binary_data": False}}]}

    async def main() -> None:
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as c:
            r = await c.post(f"/v2/cudasharedmemory/region/in-{tag}/register", json=in_body)
            assert r.status_code == 200, r.text
            r = await c.post(f"/v2/cudasharedmemory/region/out-{tag}/register", json=out_body)
            assert r.status_code == 200, r.text
            # both in CUDA regions
            r = await c.post("/v2/models/demo/infer", json=body(x_param, y_param, [3, 16, 13, 29]))
            assert r.status_code == 200, r.text
            assert rel_err(y, ref) <= layer.tolerance
            # input in a region, output as JSON; input as JSON, output in a region
            r = await c.post("/v2/models/demo/infer", json=body(x_param, None, [3, 16, 13, 29]))
            assert r.status_code == 200, r.text
            assert rel_err(np.array(r.json()["outputs"][0]["data"]).reshape(3, 8, 26, 58), ref) <= layer.tolerance
            y.fill_(float("nan"))
            torch.cuda.synchronize()
            r = await c.post("/v2/models/demo/infer", json=body(None, y_param, [3, 16, 13, 29]))
            assert r.status_code == 200, r.text
            assert rel_err(y, ref) <= layer.tolerance
            # one unbatched sample, both in regions
            y.fill_(float("nan"))
            torch.cuda.synchronize()
            one_in = {**x_param, "shared_memory_byte_size": x[0].numel() * 4}
            one_out = {**y_param, "shared_memory_byte_size": y[0].numel() * 4}
            r = await c.post("/v2/models/demo/infer", json=body(one_in, one_out, [16, 13, 29]))
            assert r.status_code == 200, r.text
            assert r.json()["outputs"][0]["shape"] == [8, 26, 58]
            assert rel_err(y[0], ref[0]) <= layer.tolerance
            assert torch.isnan(y[1:]).all()  # nothing written past the request's output
            # mistakes: 400, nothing run
            r = await c.post("/v2/models/demo/infer", json=body(
                {**x_param, "shared_memory_offset": in_body["byte_size"]}, y_param, [3, 16, 13, 29]))
            assert r.status_code == 400
            assert "reach past the end" in r.json()["error"]
            r = await c.post(f"/v2/cudasharedmemory/region/bad-{tag}/register", json={**in_body, "device_id": 99})
            assert r.status_code == 400
            assert "device_id 99 is not a GPU this server computes on" in r.json()["error"]
            r = await c.post(f"/v2/cudasharedmemory/region/bad-{tag}/register",
                             json={**in_body, "raw_handle": {"b64": base64.b64encode(bytes(64)).decode()}})
            assert r.status_code == 400
            assert "does not open" in r.json()["error"]
            r = await c.post(f"/v2/cudasharedmemory/region/big-{tag}/register",
                             json={**in_body, "byte_size": in_body["byte_size"] + (64 << 20)})
            if r.status_code == 200:  # the driver could not tell the allocation's size: byte_size is trusted
                assert "size of a mapped allocation cannot be read" in live.log()
                print("CUDA shared memory: the allocation's size was not checked (the driver could not tell it)")
                await c.post(f"/v2/cudasharedmemory/region/big-{tag}/unregister")
            else:
                assert r.status_code == 400, r.text
                assert "larger than the GPU allocation" in r.json()["error"]
            assert (await c.post("/v2/cudasharedmemory/unregister")).status_code == 200
            assert (await c.get("/v2/cudasharedmemory/status")).json() == []

    run(main(), 300)


def test_the_sdk_passes_cuda_tensors_in_place(live: ServerProcess, registry: Registry) -> None:
    base = torch.randn(5, 16, 9, 11, device="cuda")
    inputs = {"demo": [torch.randn(3, 16, 13, 29, device="cuda"), base[2:4], base[1]],  # a whole tensor, views
              "demo_fp16": [torch.randn(2, 16, 8, 8, device="cuda", dtype=torch.float16)],
              "dcgan_up2_bf16": [torch.randn(2, 64, 8, 8, device="cuda", dtype=torch.bfloat16)]}
    with Client(live.url, cuda_shared_memory=True, timeout=120) as client:
        for name, xs in inputs.items():
            layer = registry.get(name)
            for x in xs:
                y = client.deconv(name, x)
                assert y.is_cuda
                assert y.device == x.device
                assert y.dtype == x.dtype
                assert rel_err(y, _reference(layer, x)) <= layer.tolerance, (name, list(x.shape))
        mine = {s["name"] for s in client.cuda_shared_memory_status() if s["name"].startswith("deconv-cuda-")}
        assert mine
        x = inputs["demo"][0]
        for _ in range(3):  # the same allocations: no new registration
            client.deconv("demo", x)
        assert {s["name"] for s in client.cuda_shared_memory_status()
                if s["name"].startswith("deconv-cuda-")} == mine
        with pytest.raises(InvalidInputError, match="channels"):
            client.deconv("demo", torch.randn(1, 3, 4, 4, device="cuda"))
    with Client(live.url) as plain:
        assert not any(s["name"] in mine for s in plain.cuda_shared_memory_status())  # unregistered by close()

    async def main() -> None:
        layer = registry.get("demo")
        xs = [torch.randn(n, 16, 10, 10, device="cuda") for n in (1, 2, 3, 4)]
        async with AsyncClient(live.url, cuda_shared_memory=True, timeout=120) as client:
            ys = await client.deconv_many("demo", xs, concurrency=4)
            for x, y in zip(xs, ys, strict=True):
                assert y.is_cuda
                assert rel_err(y, _reference(layer, x)) <= layer.tolerance
            assert await client.cuda_shared_memory_status()
        async with AsyncClient(live.url) as plain:
            assert not any(s["name"].startswith(f"deconv-cuda-{os.getpid()}-")
                           for s in await plain.cuda_shared_memory_status())

    run(main(), 300)


def test_a_failed_cuda_ipc_call_leaves_no_error_behind() -> None:
    """A handle that does not open is an error of that call only: torch's next kernels in this thread see no
    error of it (the runtime's last error is cleared), as the server's engine relies on after a bad registration."""
    x = torch.randn(1 << 10, device="cuda")
    cuda = cuda_ipc.cuda()
    with pytest.raises(cuda_ipc.CudaError, match="cudaIpcOpenMemHandle"):
        cuda.open(0, bytes(64))
    y = (x * 2).sum()
    torch.cuda.synchronize()
    assert torch.isfinite(y)
    base, size = cuda.allocation(0, x.data_ptr())
    assert base <= x.data_ptr() < x.data_ptr() + x.numel() * 4 <= base + size
    assert len(cuda.get_handle(0, base)) == cuda_ipc.HANDLE_BYTES


def test_the_load_generator_drives_cuda_shared_memory(live: ServerProcess) -> None:
    """bench/serving/service_load.py's ``--protocol cuda-shm``: each client's input and output are CUDA tensors whose
    allocations it registers once; the answers are 200, the output read back matches PyTorch, and the regions are
    unregistered afterwards."""
    args = argparse.Namespace(layer="demo", repository=DEFAULT_LAYER_REPOSITORY, batch=3, height=8, width=8,
                              clients=3, timeout=60.0, client="raw", protocol="cuda-shm", max_seconds=None,
                              cuda_devices="0")
    x = make_input(args)
    result = asyncio.run(asyncio.wait_for(service_load.drive(live.url, args, x, 12), 300))
    assert result["statuses"] == {"200": 12}
    assert check_output(args, x, result["_sample"]) < 1e-5
    status = httpx.get(f"{live.url}/v2/cudasharedmemory/status", timeout=30).json()
    assert not any(r["name"].startswith(f"deconv-cuda-{os.getpid()}-") for r in status)
