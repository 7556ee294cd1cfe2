"""Requests in shared memory on a CPU worker, for tests: the placed path's stand-in (a CPU server maps no shared
memory, so production has none). The batch is computed by the worker's step from tensors over the regions' bytes
(``CudaRegions.lease``), and each request's rows are copied into its output region."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from service.codec import CudaJob, DeviceTensor, as_tensor
from service.engine import paths
from service.engine.cuda_shm import CudaRegions
from service.engine.kinds import Output
from service.engine.paths import Paths, Runner, Turn, guarded, host_batch, in_regions, output_bytes, region_gpu
from service.engine.registry import Layer
from service.errors import ServiceError


def tensor_batch(w: Runner, regions: CudaRegions, layer: Layer, jobs: Sequence[CudaJob], answers: list[Output | None],
                 leased: list[str]) -> None:
    """``paths.placed`` on the CPU: tensors over the regions' bytes, the batch computed by the worker's step, each
    request's rows copied into its region (or its answer, for a host output)."""
    weight, bias, _ = w.weights[layer.name]
    runs: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []  # (request, input, output region's bytes)
    for i, job in enumerate(jobs):
        try:
            x = job.x
            if isinstance(x, DeviceTensor):
                raw = regions.lease(x.token, x.offset, x.nbytes, region_gpu(w, job))
                leased.append(x.token)
                xt = raw.view(x.dtype).view(x.shape)
            else:
                xt = as_tensor(x)
            out = None
            if job.out is not None:
                out = regions.lease(job.out.token, job.out.offset, output_bytes(layer, job), region_gpu(w, job))
                leased.append(job.out.token)
        except ServiceError as exc:
            answers[i] = exc
            continue
        runs.append((i, xt, out))
    if not runs:
        return
    with torch.inference_mode():
        y = w.steps.forward(torch.cat([r[1] for r in runs]), weight, bias, layer)
    start = 0
    for i, xi, out in runs:
        rows = y[start:start + xi.shape[0]]
        start += xi.shape[0]
        if out is None:
            answers[i] = rows.clone()
        else:
            out.copy_(rows.contiguous().reshape(-1).view(torch.uint8))


def tensor_path(w: Runner, layer: Layer, jobs: Sequence[CudaJob], turn: Turn) -> list[Output]:
    """The CPU's stand-in for ``paths.placed_batch``."""
    return guarded(w, layer, jobs, lambda: in_regions(w, layer, jobs, turn, tensor_batch))


CPU_WITH_REGIONS = Paths(host=host_batch, slots=host_batch, regions=tensor_path)
"""A CPU worker's paths with requests in shared memory computed by ``tensor_batch``."""


@pytest.fixture
def cpu_regions(monkeypatch: pytest.MonkeyPatch) -> Paths:
    """CPU workers made during the test (a server's too) compute requests in shared memory (``tensor_batch``)."""
    monkeypatch.setattr(paths, "CPU_PATHS", CPU_WITH_REGIONS)
    return CPU_WITH_REGIONS
