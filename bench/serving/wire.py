"""What a load generator sends for each protocol (``--protocol``) and how it checks the answers (``Wire``): .npy
(``POST /deconv``), KServe's binary tensor extension, KServe system shared memory (a region a client) and KServe CUDA
shared memory (CUDA tensors a client); the input, and one output checked against PyTorch in float64."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
from deconv_client import LayerInfo, _shm


def layer_config(args: argparse.Namespace) -> dict[str, Any]:
    """The layer's config from the repository."""
    return json.loads((args.repository / f"{args.layer}.json").read_text())  # type: ignore[no-any-return]


def make_input(args: argparse.Namespace) -> np.ndarray:
    """The input every request sends: [--batch, C_in, --height, --width] of the layer's dtype, seeded."""
    cfg = layer_config(args)
    if cfg["dtype"] not in ("float32", "float16", "float64"):
        raise SystemExit(f"layer {args.layer} is {cfg['dtype']}; the load generator sends fp16/32/64")
    x = np.random.default_rng(0).standard_normal((args.batch, cfg["in_channels"], args.height, args.width))
    return x.astype(cfg["dtype"])


def npy_body(x: np.ndarray) -> bytes:
    """``x`` as a .npy body."""
    buf = io.BytesIO()
    np.save(buf, x, allow_pickle=False)
    return buf.getvalue()


def check_output(args: argparse.Namespace, x: np.ndarray, sample: bytes | np.ndarray) -> float:
    """Norm-wise relative error of one output (an array, or a .npy body) against PyTorch in float64."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file

    cfg = layer_config(args)
    t = load_file(str(args.repository / f"{args.layer}.safetensors"))
    bias = t["bias"].double() if cfg["bias"] else None
    ref = F.conv_transpose2d(torch.from_numpy(x).double(), t["weight"].double(), bias, cfg["stride"], cfg["padding"],
                             cfg["output_padding"], cfg["groups"], cfg["dilation"])
    y = sample if isinstance(sample, np.ndarray) else np.load(io.BytesIO(sample), allow_pickle=False)
    y = torch.from_numpy(np.asarray(y, dtype=np.float64))
    if y.shape != ref.shape:
        raise RuntimeError(f"the output has shape {list(y.shape)}, PyTorch's {list(ref.shape)}")
    return float((y - ref).norm() / ref.norm())


Decode = Callable[[int, bytes, bytes], Any]  # (client slot, lower-cased response head, body) -> the output


@dataclass
class Wire:
    """What ``--client raw`` sends for one protocol, and how it checks an answer.

    ``bodies`` holds one request body, or one a client slot (``shm``: each client names its own region);
    a 200 answer's body length must lie within ``answer_bytes``; ``decode`` reads one answer's output.
    """

    protocol: str
    path: str
    content_type: str
    headers: dict[str, str]
    bodies: list[bytes]
    in_bytes: int
    out_bytes: int
    answer_bytes: tuple[int, float]
    decode: Decode


MAX_HEAD = 2**16  # bytes of an answer beyond its tensor's: a .npy header, KServe's JSON


def output_shape(args: argparse.Namespace, x: np.ndarray) -> tuple[int, ...]:
    """The layer's output shape for ``x``."""
    return _shm.output_shape(LayerInfo.from_json(layer_config(args)), tuple(x.shape))


def header(head: bytes, name: bytes) -> bytes | None:
    """The value of header ``name`` (lower case) in a lower-cased response head whose lines end with CRLF."""
    start = head.find(b"\r\n" + name + b":")
    if start < 0:
        return None
    start += len(name) + 3
    return head[start:head.index(b"\r\n", start)].strip()


def npy_wire(args: argparse.Namespace, x: np.ndarray) -> Wire:
    """``POST /deconv`` with a .npy body."""
    out_bytes = math.prod(output_shape(args, x)) * x.itemsize

    def decode(_slot: int, _head: bytes, body: bytes) -> np.ndarray:
        return np.load(io.BytesIO(body), allow_pickle=False)  # type: ignore[no-any-return]

    return Wire("npy", f"/deconv?layer={args.layer}", "application/x-npy", {}, [npy_body(x)], x.nbytes, out_bytes,
                (out_bytes, out_bytes + MAX_HEAD), decode)


def kserve_wire(args: argparse.Namespace, x: np.ndarray) -> Wire:
    """``POST /v2/models/{layer}/infer`` with the binary tensor extension, the output asked for as binary."""
    t = _shm.prepare(x)
    shape = output_shape(args, x)
    out_bytes = math.prod(shape) * x.itemsize
    head = json.dumps({"inputs": [{"name": "input", "shape": list(t.shape), "datatype": t.datatype,
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()

    def decode(_slot: int, response_head: bytes, body: bytes) -> np.ndarray:
        n = int(header(response_head, b"inference-header-content-length") or b"-1")
        out = json.loads(body[:n])["outputs"][0]
        if out["parameters"]["binary_data_size"] != len(body) - n or tuple(out["shape"]) != shape:
            raise ValueError(f"the answer's output does not fit: {out}")
        return np.frombuffer(body[n:], dtype=x.dtype).reshape(shape)

    return Wire("kserve", f"/v2/models/{args.layer}/infer", "application/octet-stream",
                {"inference-header-content-length": str(len(head))}, [head + t.raw.tobytes()], x.nbytes, out_bytes,
                (out_bytes, out_bytes + MAX_HEAD), decode)


@contextlib.contextmanager
def shm_wire(url: str, args: argparse.Namespace, x: np.ndarray, clients: int) -> Iterator[Wire]:
    """KServe system shared memory: a region for each of ``clients`` clients, registered with the server at
    ``url`` and holding the input, for as long as the context lasts; then unregistered and unlinked."""
    t = _shm.prepare(x)
    shape = output_shape(args, x)
    size = _shm.region_bytes(t, shape, x.itemsize)
    free = shutil.disk_usage("/dev/shm").free
    if clients * size > free:
        raise SystemExit(f"{clients} regions of {size} bytes do not fit the {free} bytes free in /dev/shm")
    regions: list[_shm.Region] = []
    try:
        with httpx.Client(base_url=url, timeout=min(args.timeout, 30.0)) as http:
            for _ in range(clients):
                region = _shm.Region(size)
                regions.append(region)
                region.shm.buf[:x.nbytes] = t.raw
                http.post(_shm.register_path(region), json=region.register_body()).raise_for_status()
                region.registered = True

        def decode(slot: int, _head: bytes, body: bytes) -> Any:
            return _shm.read_output(t, regions[slot], json.loads(body))

        bodies = [json.dumps(_shm.infer_request(t, r, shape, x.itemsize)).encode() for r in regions]
        yield Wire("shm", f"/v2/models/{args.layer}/infer", "application/json", {}, bodies, x.nbytes,
                   math.prod(shape) * x.itemsize, (1, MAX_HEAD), decode)
    finally:
        unregister(url, [r.name for r in regions if r.registered])
        for region in regions:
            region.destroy()


@contextlib.contextmanager
def cuda_shm_wire(url: str, args: argparse.Namespace, x: np.ndarray, clients: int) -> Iterator[Wire]:
    """KServe CUDA shared memory: an input (holding ``x``) and an output tensor for each of ``clients`` clients,
    client i's on the i-th of ``args.cuda_devices`` in turn, made and registered with the server at ``url`` as the
    SDK does for a call (``deconv_client._cuda_shm.CudaCall``), for as long as the context lasts."""
    import torch
    from deconv_client import _cuda_shm

    devices = (list(range(torch.cuda.device_count())) if args.cuda_devices == "all"
               else [int(d) for d in args.cuda_devices.split(",")])
    info = LayerInfo.from_json(layer_config(args))
    regions = _cuda_shm.CudaRegions(max_regions=4 * clients + 4)  # none retired while the clients run
    calls: list[_cuda_shm.CudaCall] = []
    try:
        with httpx.Client(base_url=url, timeout=min(args.timeout, 30.0)) as http:
            for i in range(clients):
                call = _cuda_shm.CudaCall(torch.from_numpy(x).to(f"cuda:{devices[i % len(devices)]}"), info)
                calls.append(call)
                call.attach(regions)
                for region in call.unregistered():
                    http.post(_cuda_shm.register_path(region), json=region.register_body()).raise_for_status()
                    region.registered = True

        def decode(slot: int, _head: bytes, body: bytes) -> Any:
            return calls[slot].result(json.loads(body)).cpu().numpy()  # the server wrote it before answering

        bodies = [json.dumps(call.request()).encode() for call in calls]
        yield Wire("cuda-shm", f"/v2/models/{args.layer}/infer", "application/json", {}, bodies, x.nbytes,
                   math.prod(output_shape(args, x)) * x.itemsize, (1, MAX_HEAD), decode)
    finally:
        unregister(url, [r.name for r in regions.close() if r.registered], kind="cudasharedmemory")


def unregister(url: str, names: list[str], kind: str = "systemsharedmemory") -> None:
    """Unregister these regions (``kind``: the extension) from the server at ``url`` (bounded: a few seconds each
    at most)."""
    if not names:
        return
    with httpx.Client(base_url=url, timeout=5.0) as http:
        for name in names:
            with contextlib.suppress(httpx.HTTPError):
                http.post(f"/v2/{kind}/region/{quote(name, safe='')}/unregister")


def sweep_regions(url: str, pids: list[int]) -> list[str]:
    """Unregister and unlink what processes ``pids`` (load workers that may have died) left of their regions
    (the SDK names its objects ``deconv-client-<pid>-...``); the names swept."""
    prefixes = tuple(f"deconv-client-{pid}-" for pid in pids)
    try:
        status = httpx.get(f"{url}/v2/systemsharedmemory/status", timeout=5.0).json()
        names = [r["name"] for r in status if r["name"].startswith(prefixes)]
    except (httpx.HTTPError, ValueError, TypeError, KeyError):
        names = []
    unregister(url, names)
    left = [p for p in Path("/dev/shm").glob("deconv-client-*") if p.name.startswith(prefixes)]
    for path in left:
        path.unlink(missing_ok=True)
    return sorted({*names, *(p.name for p in left)})


def make_wire(args: argparse.Namespace, x: np.ndarray) -> Wire:
    """The requests of ``args.protocol`` (``npy`` or ``kserve``; ``shm`` needs the server: ``shm_wire``)."""
    return kserve_wire(args, x) if args.protocol == "kserve" else npy_wire(args, x)
