"""GPU tests of the KServe v2 gRPC API (run with ``-m cuda`` on the device machine): a GPU server (one process, and
two HTTP processes in front of the engine process) with ``DECONV_GRPC_PORT``, driven by ``tritonclient.grpc`` from
this process: binary inference on the CUDA kernels, system shared memory (which a GPU server's engine maps and
page-locks, so that the requests reach it as references) and CUDA shared memory of torch allocations exported by
``deconv_client.cuda_ipc``. Every output is checked against ``F.conv_transpose2d`` in float64 with the layer's
tolerance, as the other GPU service tests do.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from deconv_client import cuda_ipc

from service.config import DEFAULT_LAYER_REPOSITORY
from service.engine.registry import BatchLimits, Layer, Registry, load_repository
from tests.numerics import rel_err

from ..conftest import ServerProcess, free_port

pytestmark = pytest.mark.cuda
grpcclient = pytest.importorskip("tritonclient.grpc")

COMPILE_TIMEOUT_S = 600  # the first start may compile the kernels


def _reference(layer: Layer, x: torch.Tensor) -> torch.Tensor:
    c = layer.config
    b = layer.bias.double() if layer.bias is not None else None
    return F.conv_transpose2d(x.double().cpu(), layer.weight.double(), b, c.stride, c.padding, c.output_padding,
                              c.groups, c.dilation)


@pytest.fixture(scope="module", params=["1", "2"], ids=["single", "multi"])
def live(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess,
                                                                                                      str]]:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    log = tmp_path_factory.mktemp("grpc-cuda") / "server.log"
    port = free_port()
    proc = ServerProcess({"DECONV_DEVICES": "all", "DECONV_HTTP_PROCESSES": request.param, "DECONV_TUNE": "0",
                          "DECONV_GRPC_PORT": str(port)}, log)
    try:
        proc.wait_ready(COMPILE_TIMEOUT_S)
        yield proc, f"127.0.0.1:{port}"
    finally:
        assert proc.stop(60) == 0, proc.log()[-5000:]
        assert "Traceback" not in proc.log(), proc.log()[-5000:]


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_repository(DEFAULT_LAYER_REPOSITORY, BatchLimits(64, 1 << 28, 2.0, 256))


def test_binary_inference_on_the_gpu(live: tuple[ServerProcess, str], registry: Registry) -> None:
    _, address = live
    client = grpcclient.InferenceServerClient(address)
    assert "cuda_shared_memory" in client.get_server_metadata().extensions
    assert client.get_model_config("dcgan_up1").config.instance_group[0].kind == 1  # KIND_GPU
    layer = registry.get("dcgan_up1")
    for n in (1, 3, 8):  # 0.5 MiB a sample in, 1 MiB out
        x = torch.randn(n, 128, 32, 32)
        tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x.numpy())
        y = client.infer("dcgan_up1", [tensor]).as_numpy("output")
        assert rel_err(y.copy(), _reference(layer, x)) <= layer.tolerance


def test_system_shared_memory_by_reference(live: tuple[ServerProcess, str], registry: Registry) -> None:
    import tritonclient.utils.shared_memory as sysshm

    _, address = live
    client = grpcclient.InferenceServerClient(address)
    layer = registry.get("dcgan_up1")
    tag = uuid.uuid4().hex[:8]
    x = torch.randn(4, 128, 32, 32)
    in_bytes, out_bytes = x.numel() * 4, x.numel() * 8
    ins = sysshm.create_shared_memory_region(f"in-{tag}", f"/deconv-gin-{tag}", in_bytes)
    outs = sysshm.create_shared_memory_region(f"out-{tag}", f"/deconv-gout-{tag}", out_bytes)
    try:
        sysshm.set_shared_memory_region(ins, [x.numpy()])
        client.register_system_shared_memory(f"in-{tag}", f"/deconv-gin-{tag}", in_bytes)
        client.register_system_shared_memory(f"out-{tag}", f"/deconv-gout-{tag}", out_bytes)
        tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
        tensor.set_shared_memory(f"in-{tag}", in_bytes)
        output = grpcclient.InferRequestedOutput("output")
        output.set_shared_memory(f"out-{tag}", out_bytes)
        result = client.infer("dcgan_up1", [tensor], outputs=[output])
        assert result.get_output("output").parameters["shared_memory_byte_size"].int64_param == out_bytes
        y = np.array(sysshm.get_contents_as_numpy(outs, np.float32, [4, 64, 64, 64]))
        assert rel_err(y, _reference(layer, x)) <= layer.tolerance
        client.unregister_system_shared_memory()
    finally:
        sysshm.destroy_shared_memory_region(ins)
        sysshm.destroy_shared_memory_region(outs)


def test_cuda_shared_memory_of_torch_allocations(live: tuple[ServerProcess, str], registry: Registry) -> None:
    """Input and output in CUDA regions (torch allocations, registered by their IPC handles): the server's GPU
    worker reads and writes them in place."""
    _, address = live
    client = grpcclient.InferenceServerClient(address)
    layer = registry.get("dcgan_up1")
    cuda = cuda_ipc.cuda()
    x = torch.randn(2, 128, 32, 32, device="cuda:0")
    y = torch.empty(2, 64, 64, 64, device="cuda:0")
    torch.cuda.synchronize()
    names = []
    try:
        for name, t in (("gin", x), ("gout", y)):
            base, size = cuda.allocation(0, t.data_ptr())
            handle = cuda.get_handle(0, base)
            region = f"{name}-{uuid.uuid4().hex[:8]}"
            client.register_cuda_shared_memory(region, base64.b64encode(handle), 0, size)
            names.append((region, t.data_ptr() - base))
        status = client.get_cuda_shared_memory_status(as_json=True)["regions"]
        assert {n for n, _ in names} <= set(status)
        (rin, at_in), (rout, at_out) = names
        tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
        tensor.set_shared_memory(rin, x.numel() * 4, offset=at_in)
        output = grpcclient.InferRequestedOutput("output")
        output.set_shared_memory(rout, y.numel() * 4, offset=at_out)
        client.infer("dcgan_up1", [tensor], outputs=[output])
        assert rel_err(y.cpu(), _reference(layer, x.cpu())) <= layer.tolerance
    finally:
        client.unregister_cuda_shared_memory()
    assert client.get_cuda_shared_memory_status(as_json=True).get("regions", {}) == {}
