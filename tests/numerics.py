"""The one measure of a result's error in the tests: the norm-wise relative error against a float64 reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def _float64(a: Any, device: torch.device | None = None) -> torch.Tensor:
    t = a if isinstance(a, torch.Tensor) else torch.tensor(np.asarray(a, dtype=np.float64))
    return t.to(device=device, dtype=torch.float64)


def rel_err(y: Any, ref: Any) -> float:
    """``‖y - ref‖ / ‖ref‖`` (2-norms over every element), in float64.

    ``y`` and ``ref``: tensors of any dtype and device, or anything ``np.asarray`` takes (numpy arrays, lists).
    ``y`` is compared where ``ref`` lives (a GPU output against a CPU reference moves to the CPU). A ``y`` that holds
    NaN or Inf fails at once (an element never written, or an overflow); a reference of norm 0 counts as 1e-300.
    """
    ref64 = _float64(ref)
    y64 = _float64(y, ref64.device)
    assert torch.isfinite(y64).all(), "output holds NaN/Inf: an element was not written (poisoned) or overflowed"
    return float(torch.linalg.vector_norm(y64 - ref64) / torch.linalg.vector_norm(ref64).clamp_min(1e-300))
