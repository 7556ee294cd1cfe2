"""The naive baseline for bench/serving/service_load.py: one FastAPI endpoint, one ``nn.ConvTranspose2d`` call per
request.

No batching, no queue, no kernels of ours: decode the .npy body, run PyTorch's module (cuDNN on a GPU), encode.
It loads the same layers (config + weights) from the layer repository as the service, so the outputs match;
``--layer`` takes a comma list, and a request picks one with ``?layer=NAME`` (the first without it).

    python -m bench.serving.naive_server --port 8001 [--layer demo[,dcgan_up1]] [--repository layers] [--device auto]
"""

from __future__ import annotations

import argparse
import io
import json
import logging
from pathlib import Path

import numpy as np
import torch
import uvicorn
from fastapi import FastAPI, HTTPException, Request, Response
from safetensors.torch import load_file
from starlette.concurrency import run_in_threadpool
from torch import nn

ROOT = Path(__file__).resolve().parents[2]


def build_module(repository: Path, layer: str, device: torch.device) -> nn.ConvTranspose2d:
    """The layer as a plain ``nn.ConvTranspose2d`` with the repository's weights."""
    cfg = json.loads((repository / f"{layer}.json").read_text())
    tensors = load_file(str(repository / f"{layer}.safetensors"))
    module = nn.ConvTranspose2d(cfg["in_channels"], cfg["out_channels"], cfg["kernel_size"], stride=cfg["stride"],
                                padding=cfg["padding"], output_padding=cfg["output_padding"], groups=cfg["groups"],
                                bias=cfg["bias"], dilation=cfg["dilation"])
    with torch.no_grad():
        module.weight.copy_(tensors["weight"])
        if cfg["bias"]:
            module.bias.copy_(tensors["bias"])
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "float64": torch.float64}[cfg["dtype"]]
    return module.to(device=device, dtype=dtype).eval()


def create_app(repository: Path, layer: str, device: torch.device) -> FastAPI:
    """One POST /deconv route for the layers of the comma list ``layer`` and the health route the load generator
    waits for."""
    names = [name.strip() for name in layer.split(",") if name.strip()]
    modules = {name: build_module(repository, name, device) for name in names}
    app = FastAPI(title="naive deconv")

    @app.get("/health/ready")
    def ready() -> dict[str, str]:
        return {"status": "ready"}

    def compute(module: nn.ConvTranspose2d, body: bytes) -> tuple[bytes, int]:
        x = np.load(io.BytesIO(body), allow_pickle=False)
        with torch.no_grad():
            y = module(torch.from_numpy(x).to(device)).cpu().numpy()
        out = io.BytesIO()
        np.save(out, y, allow_pickle=False)
        return out.getvalue(), len(x)

    @app.post("/deconv")
    async def deconv(request: Request, layer: str = names[0]) -> Response:
        # The module runs in FastAPI's thread pool (as a sync endpoint would), one request per call.
        if layer not in modules:
            raise HTTPException(404, f"no layer {layer!r}")
        try:
            content, n = await run_in_threadpool(compute, modules[layer], await request.body())
        except ValueError as exc:
            raise HTTPException(400, "not a .npy body") from exc
        return Response(content, media_type="application/x-npy", headers={"X-Deconv-Batch-Size": str(n)})

    return app


def main() -> None:
    """Serve the naive endpoint."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--layer", default="demo")
    p.add_argument("--repository", type=Path, default=ROOT / "layers")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:i]")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else (
        torch.device(args.device))
    logging.basicConfig(level=logging.WARNING)
    uvicorn.run(create_app(args.repository, args.layer, device), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
