"""A real CUDA out-of-memory on the GPU: the batch is split and retried, then per-request errors; the service lives on.

Needs one NVIDIA GPU (sm_80+) and the CUDA build of torch. Steps, on a server started here (``DECONV_DEVICES=0``):

1. ``one_sample``: this process takes GPU memory until less than one sample fits; 8 concurrent one-sample requests
   ([1, 32, 512, 512] fp32 in, [1, 16, 1024, 1024] out, 96 MiB of device memory per sample) share a batch.
   Expected: every request 500 ``internal`` once the halving reached one sample (``kind="oom"`` counted), no
   traceback in the answers.
2. ``split``: memory taken until only ``--free-gib`` is left; ``--wave`` concurrent one-sample requests are batched
   into one kernel call that does not fit. Expected: every request 200 with the right output (checked against
   float64 on the CPU), ``deconv_worker_failures_total{kind="oom_retry"}`` > 0.
3. ``after``: memory given back; later requests 200, ``/health/ready`` 200, no worker restarted, exit status 0.

    python -m bench.serving.reliability.gpu --out docs/benchmarks/reliability-gpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bench.serving.reliability.server import NPY, ROOT, Server, load, metric_sum, npy, scrape
from service.export import export_model

LAYER = "oom_probe"
IN_SHAPE = (1, 32, 512, 512)  # 32 MiB in, 64 MiB out per sample (fp32)
SAMPLE_BYTES = 96 * 2**20


class Hog:
    """GPU memory held by this process, so that the server's batch does not fit."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.blocks: list[torch.Tensor] = []

    def leave_free(self, free_bytes: int) -> int:
        """Allocate until about ``free_bytes`` of the device stay free; the free bytes measured afterwards."""
        chunk = 256 * 2**20
        while True:
            free, _ = torch.cuda.mem_get_info(self.device)
            if free <= free_bytes:
                return free
            size = min(chunk, free - free_bytes)
            if size < 2**20:
                return free
            try:
                self.blocks.append(torch.empty(size, dtype=torch.uint8, device=f"cuda:{self.device}"))
            except torch.cuda.OutOfMemoryError:
                chunk //= 2
                if chunk < 2**20:
                    return int(torch.cuda.mem_get_info(self.device)[0])

    def release(self) -> None:
        """Give everything back."""
        self.blocks.clear()
        torch.cuda.empty_cache()


def make_repository(root: Path, wave: int) -> nn.ConvTranspose2d:
    torch.manual_seed(0)
    module = nn.ConvTranspose2d(IN_SHAPE[1], 16, 4, stride=2, padding=1)
    export_model(module, root, precision="tf32", names={"": LAYER}, overwrite=True,
                 limits={"max_batch_size": wave, "max_batch_bytes": 64 * 2**30, "max_queue_delay_ms": 2000.0,
                         "max_queue_size": 4 * wave})
    return module.double()


async def wave(url: str, count: int, module: nn.ConvTranspose2d, check: int = 2) -> dict[str, Any]:
    """``count`` concurrent one-sample requests; statuses, and the first ``check`` outputs against float64."""
    rng = np.random.default_rng(count)
    xs = [rng.standard_normal(IN_SHAPE).astype(np.float32) for _ in range(count)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(client.post(f"/deconv?layer={LAYER}", content=npy(x),
                                                headers={"content-type": NPY}) for x in xs))
        wall = time.perf_counter() - t0
        samples = await scrape(client)
        ready = (await client.get("/health/ready")).status_code
    counts: dict[str, int] = {}
    for r in rs:
        counts[str(r.status_code)] = counts.get(str(r.status_code), 0) + 1
    errors = []
    for x, r in list(zip(xs, rs, strict=True))[:check]:
        if r.status_code == 200:
            ref = F.conv_transpose2d(torch.from_numpy(x).double(), module.weight.detach(), module.bias.detach(),
                                     stride=2, padding=1)
            y = torch.from_numpy(load(r.content)).double()
            errors.append(float((y - ref).norm() / ref.norm()))
    bodies = [r.text for r in rs if r.status_code != 200]
    return {
        "statuses": counts, "wall_s": round(wall, 2), "rel_errors": errors, "ready": ready,
        "batch_sizes": sorted({int(r.headers.get("x-deconv-batch-size", 0)) for r in rs if r.status_code == 200}),
        "error_types": sorted({json.loads(b)["error"]["type"] for b in bodies}) if bodies else [],
        "leaks": sum("Traceback" in b or 'File "' in b or str(ROOT) in b for b in bodies),
        "failures": {k: metric_sum(samples, "deconv_worker_failures_total", kind=k)
                     for k in ("oom_retry", "oom", "error")},
        "restarts": metric_sum(samples, "deconv_worker_restarts_total"),
        "gpu_memory_bytes": {lab["kind"]: v for n, lab, v in samples if n == "deconv_gpu_memory_bytes"},
    }


def main(argv: list[str] | None = None) -> int:
    """Run the three steps; print and write the figures; exit 1 if a check failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=int, default=0, help="CUDA device index (default 0)")
    parser.add_argument("--wave", type=int, default=64, help="requests per wave = samples in the first batch")
    parser.add_argument("--free-gib", type=float, default=3.0, help="device memory left free for step 1")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    results: dict[str, Any] = {
        "machine": {"gpu": torch.cuda.get_device_name(args.device), "torch": torch.__version__,
                    "platform": platform.platform()},
        "layer": f"ConvTranspose2d(32, 16, 4, stride=2, padding=1), input {list(IN_SHAPE)} fp32, tf32",
        "wave": args.wave, "sample_device_bytes": SAMPLE_BYTES,
    }
    hog = Hog(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        module = make_repository(root / "layers", args.wave)
        env = {"DECONV_DEVICES": str(args.device), "DECONV_LAYER_REPOSITORY": str(root / "layers"),
               "DECONV_MAX_BODY_BYTES": str(256 * 2**20), "DECONV_REQUEST_TIMEOUT_S": "300"}
        server = Server.start(env, root / "server.log", ready_timeout=600)
        try:
            # One sample not fitting goes first: a batch that succeeded would leave its memory in the server's
            # allocator cache, where the next batch would find it whatever this process holds.
            free = hog.leave_free(SAMPLE_BYTES // 3)
            results["one_sample"] = {"free_bytes_before": free, **asyncio.run(wave(server.url, 8, module, 0))}
            hog.release()
            free = hog.leave_free(int(args.free_gib * 2**30))
            results["split"] = {"free_bytes_before": free, **asyncio.run(wave(server.url, args.wave, module))}
            hog.release()
            results["after"] = asyncio.run(wave(server.url, 8, module))
        finally:
            hog.release()
            results["exit_status"] = server.stop(timeout=120)
            log = server.log()
            results["log_out_of_memory_lines"] = [line for line in log.splitlines() if "out of memory" in line][:20]
    split, one, after = results["split"], results["one_sample"], results["after"]
    checks = {
        "split_all_200": split["statuses"] == {"200": args.wave},
        "split_retried_in_halves": split["failures"]["oom_retry"] > one["failures"]["oom_retry"]
        and split["failures"]["oom"] == one["failures"]["oom"],
        "split_outputs_right": bool(split["rel_errors"]) and max(split["rel_errors"]) < 2e-3,
        "one_sample_all_500_internal": set(one["statuses"]) == {"500"} and one["error_types"] == ["internal"],
        "one_sample_counted_as_oom": one["failures"]["oom"] > 0,
        "no_internals_in_answers": one["leaks"] == 0,
        "after_all_200": after["statuses"] == {"200": 8} and max(after["rel_errors"]) < 2e-3,
        "still_ready": after["ready"] == 200,
        "no_worker_restart": after["restarts"] == 0,
        "exit_status_0": results["exit_status"] == 0,
    }
    results["checks"], results["ok"] = checks, all(checks.values())
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
