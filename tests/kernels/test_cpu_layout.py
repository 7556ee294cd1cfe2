"""The output layout rule of kernels.functional (PyTorch's), on the CPU (no kernel runs)."""

from __future__ import annotations

import torch

from kernels.functional import suggests_channels_last


def test_channels_last_follows_pytorchs_stride_rule() -> None:
    """Agrees with PyTorch's own rule (torch._prims_common.suggest_memory_format) on ordinary and degenerate shapes,
    both layouts."""
    from torch._prims_common import suggest_memory_format

    shapes = [(2, 3, 4, 5), (1, 3, 4, 5), (8, 100, 1, 1), (2, 1, 4, 5), (2, 3, 1, 5), (2, 3, 4, 1), (1, 1, 1, 1)]
    for shape in shapes:
        for t in (torch.empty(shape), torch.empty(shape).contiguous(memory_format=torch.channels_last),
                  torch.empty(shape[0], shape[2], shape[3], shape[1]).permute(0, 3, 1, 2)):
            want = suggest_memory_format(t) == torch.channels_last
            assert suggests_channels_last(t) == want, (shape, t.stride())
    assert not suggests_channels_last(torch.empty(2, 3, 4))
    assert not suggests_channels_last(torch.empty(2, 3, 4, 5).transpose(2, 3))  # neither layout
