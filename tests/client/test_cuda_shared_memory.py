"""``Client(..., cuda_shared_memory=True)`` and ``AsyncClient(..., cuda_shared_memory=True)`` without a GPU: the
requests the SDK makes for a tensor in CUDA shared memory, sync and async, against a stand-in server
(``httpx.MockTransport``) that reads and writes the client's memory where the requests say, as the server's GPU
worker does. Torch CPU tensors stand in for CUDA tensors, and ``FakeCuda`` for the CUDA IPC calls
(:mod:`deconv_client.cuda_ipc`): an "allocation" is a CPU tensor the test made, its "handle" its address. The real
thing runs on the GPU: tests/service/test_cuda_shm.py.
"""

from __future__ import annotations

import base64
import ctypes
import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
import torch.nn.functional as F
from deconv_client import BadRequestError, CodecError, _cuda_shm, cuda_ipc
from deconv_client._tensor import is_torch_tensor

from .conftest import MakeClient, error_response

LAYER = {
    "name": "up", "in_channels": 4, "out_channels": 6, "kernel_size": [4, 4], "stride": [2, 2],
    "padding": [1, 1], "output_padding": [0, 0], "dilation": [1, 1], "groups": 1, "bias": False,
    "dtype": "float32",
}  # fmt: skip
WEIGHT = torch.randn(4, 6, 4, 4, generator=torch.Generator().manual_seed(0))


class FakeCuda:
    """CUDA IPC calls over CPU memory: allocations are the tensors given to ``allocate`` (anything else is an
    allocation of its own), a handle is the allocation's address."""

    def __init__(self) -> None:
        self.allocations: list[tuple[int, int]] = []
        self.handles = 0

    def allocate(self, t: torch.Tensor) -> torch.Tensor:
        self.allocations.append((t.data_ptr(), t.numel() * t.element_size()))
        return t

    def allocation(self, device: int, ptr: int) -> tuple[int, int]:
        for base, size in self.allocations:
            if base <= ptr < base + size:
                return base, size
        return ptr, 1 << 30

    def get_handle(self, device: int, base: int) -> bytes:
        self.handles += 1
        return base.to_bytes(8, "little") + bytes(56)


class Server:
    """The server's side: registrations by name, and inference that reads the input and writes the output in the
    client's memory at the registered allocations' addresses plus the requests' offsets."""

    def __init__(self) -> None:
        self.regions: dict[str, dict[str, Any]] = {}
        self.log: list[str] = []
        self.infer_bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/layers/up":
            return httpx.Response(200, json=LAYER)
        name = path.split("/")[-2]
        if path.endswith("/register"):
            body = json.loads(request.content)
            assert set(body) == {"raw_handle", "device_id", "byte_size"}
            handle = base64.b64decode(body["raw_handle"]["b64"])
            assert len(handle) == 64
            self.log.append(f"register {name}")
            self.regions[name] = {"base": int.from_bytes(handle[:8], "little"), **body}
            return httpx.Response(200)
        if path.endswith("/unregister"):
            self.log.append(f"unregister {name}")
            self.regions.pop(name, None)
            return httpx.Response(200)
        if path == "/v2/models/up/infer":
            body = json.loads(request.content)
            self.infer_bodies.append(body)
            inp, out = body["inputs"][0], body["outputs"][0]["parameters"]
            p = inp["parameters"]
            src = self.regions[p["shared_memory_region"]]
            assert p["shared_memory_offset"] + p["shared_memory_byte_size"] <= src["byte_size"]
            data = ctypes.string_at(src["base"] + p["shared_memory_offset"], p["shared_memory_byte_size"])
            x = torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(inp["shape"])
            y = F.conv_transpose2d(x if x.dim() == 4 else x[None], WEIGHT, stride=2, padding=1)
            y = y if x.dim() == 4 else y[0]
            dst = self.regions[out["shared_memory_region"]]
            raw = y.contiguous().numpy().tobytes()
            assert out["shared_memory_byte_size"] == len(raw)
            assert out["shared_memory_offset"] + len(raw) <= dst["byte_size"]
            ctypes.memmove(dst["base"] + out["shared_memory_offset"], raw, len(raw))
            return httpx.Response(200, json={"model_name": "up", "model_version": "1", "outputs": [{
                "name": "output", "datatype": "FP32", "shape": list(y.shape), "parameters": {
                    "shared_memory_region": out["shared_memory_region"], "shared_memory_byte_size": len(raw),
                    "shared_memory_offset": out["shared_memory_offset"]}}]})
        return error_response(404, "not_found")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    cuda = FakeCuda()
    syncs: list[int] = []
    monkeypatch.setattr(cuda_ipc, "cuda", lambda: cuda)
    monkeypatch.setattr(_cuda_shm, "is_cuda_tensor", lambda x: is_torch_tensor(x) and x.numel() > 0)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: SimpleNamespace(synchronize=lambda: syncs.append(1)))
    cuda.syncs = syncs  # type: ignore[attr-defined]
    return cuda


def _reference(x: torch.Tensor) -> torch.Tensor:
    return F.conv_transpose2d(x if x.dim() == 4 else x[None], WEIGHT, stride=2, padding=1).reshape(
        (*x.shape[:-3], 6, 2 * x.shape[-2], 2 * x.shape[-1]))


def test_tensors_stay_in_their_allocations_registered_once(make_client: MakeClient, fake: FakeCuda) -> None:
    server = Server()
    client = make_client(server, cuda_shared_memory=True)
    assert client.cuda_shared_memory
    segment = fake.allocate(torch.randn(4 * 4 * 5 * 5 * 3, generator=torch.Generator().manual_seed(1)))
    whole = segment[: 4 * 4 * 5 * 5].view(4, 4, 5, 5)
    part = segment[4 * 4 * 5 * 5: 4 * 4 * 5 * 5 + 2 * 4 * 5 * 5].view(2, 4, 5, 5)  # inside, at an offset
    for x in (whole, part, part[1]):
        y = client.deconv("up", x)
        assert isinstance(y, torch.Tensor)
        assert torch.allclose(y, _reference(x), atol=1e-5)
    inputs = [b["inputs"][0]["parameters"] for b in server.infer_bodies]
    assert {p["shared_memory_region"] for p in inputs} == {inputs[0]["shared_memory_region"]}  # one allocation
    assert [p["shared_memory_offset"] for p in inputs] == [0, 400 * 4, 500 * 4]
    assert inputs[0]["shared_memory_byte_size"] == 400 * 4
    region = server.regions[inputs[0]["shared_memory_region"]]
    assert (region["device_id"], region["byte_size"]) == (0, segment.numel() * 4)
    assert all(b["outputs"][0]["parameters"]["shared_memory_region"] in server.regions for b in server.infer_bodies)
    assert len(fake.syncs) == 3  # the caller's stream waited for before each request  # type: ignore[attr-defined]
    registered = [e for e in server.log if e.startswith("register")]
    assert len(registered) == len(server.regions)
    client.close()
    assert sorted(e.removeprefix("unregister ") for e in server.log if e.startswith("unregister")) == sorted(
        e.removeprefix("register ") for e in registered)
    assert server.regions == {}


def test_registrations_are_bounded_and_the_least_recently_used_goes(make_client: MakeClient, fake: FakeCuda,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    server = Server()
    client = make_client(server, cuda_shared_memory=True)
    xs = [fake.allocate(torch.randn(1, 4, 3, 3)) for _ in range(3)]
    outputs: list[torch.Tensor] = []
    real_empty = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:  # every output in one allocation of its own, kept
        outputs.append(fake.allocate(real_empty(*args, **kwargs)))
        return outputs[-1]

    monkeypatch.setattr(torch, "empty", empty)
    client.client._cuda_regions.max_regions = 2
    for x in xs:
        assert torch.allclose(client.deconv("up", x), _reference(x), atol=1e-5)
    assert len(server.regions) == 2  # the first calls' allocations were unregistered to make room
    assert len([e for e in server.log if e.startswith("unregister")]) == 4


def test_a_cpu_tensor_goes_the_usual_way_and_errors_come_through(make_client: MakeClient, fake: FakeCuda,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/v1/layers/up":
            return httpx.Response(200, json=LAYER)
        return error_response(400, "invalid_shared_memory", "CUDA shared memory needs a GPU")

    monkeypatch.setattr(_cuda_shm, "is_cuda_tensor", lambda x: False)
    client = make_client(handler, cuda_shared_memory=True)
    with pytest.raises(BadRequestError):
        client.deconv("up", torch.randn(1, 4, 3, 3))
    assert calls == ["/deconv"]  # not a CUDA tensor: the native route
    monkeypatch.setattr(_cuda_shm, "is_cuda_tensor", lambda x: True)
    with pytest.raises(BadRequestError, match="needs a GPU"):
        client.deconv("up", fake.allocate(torch.randn(1, 4, 3, 3)))
    assert calls[1:] == ["/v1/layers/up", calls[2]]
    assert calls[2].startswith("/v2/cudasharedmemory/region/deconv-cuda-")
    assert calls[2].endswith("/register")
    with pytest.raises(CodecError, match="cannot be sent through CUDA shared memory"):
        client.deconv("up", torch.ones(1, 4, 3, 3, dtype=torch.int32))


def test_memory_without_an_ipc_handle_is_a_codec_error(make_client: MakeClient, fake: FakeCuda,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def no_handle(device: int, base: int) -> bytes:
        raise cuda_ipc.CudaError("cudaIpcGetMemHandle: invalid argument (CUDA error 1)")

    monkeypatch.setattr(fake, "get_handle", no_handle)
    client = make_client(Server(), cuda_shared_memory=True)
    with pytest.raises(CodecError, match="expandable segments"):
        client.deconv("up", torch.randn(1, 4, 3, 3))


def test_region_bookkeeping(fake: FakeCuda) -> None:
    regions = _cuda_shm.CudaRegions(max_regions=1)
    a, offset, retired = regions.acquire(0, 4096, 16)
    assert (offset, retired, a.users) == (0, [], 1)
    assert a.register_body() == {"raw_handle": {"b64": base64.b64encode((4096).to_bytes(8, "little") + bytes(56))
                                                .decode()}, "device_id": 0, "byte_size": 1 << 30}
    b, _, retired = regions.acquire(1, 8192, 16)  # a is in use: kept beyond the bound
    assert retired == []
    regions.release(a)
    again, _, retired = regions.acquire(1, 8192, 8)
    assert again is b
    assert retired == [a]
    assert _cuda_shm.unregister_path(a) == f"/v2/cudasharedmemory/region/{a.name}/unregister"
    assert regions.close() == [b]
    with pytest.raises(RuntimeError, match="closed"):
        regions.acquire(0, 4096, 16)
