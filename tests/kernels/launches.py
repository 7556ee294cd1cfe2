"""The CUDA kernels a call launches once it is steady, by name (torch.profiler), for the GPU tests that count them."""

from __future__ import annotations

from collections.abc import Callable

import torch


def kernels_launched(fn: Callable[[], object]) -> list[str]:
    """The names of the CUDA kernels ``fn()`` launches, after a first call outside the profile (first-call work)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
