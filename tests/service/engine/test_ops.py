"""The kernels' batch calls for serving (service.engine.ops), where they run without a GPU: the kernel choice's
extension arguments and the packed weights' checks. The GPU tests are in tests/kernels/test_cuda.py and
tests/kernels/test_cuda_tuning.py."""

from __future__ import annotations

import pytest
import torch

from kernels import tuning
from kernels.internal import FORCE_PATHS, ConvTranspose2dArgumentError, ext_packs
from kernels.tuning import DEFAULT, KernelChoice
from service.engine.ops import WeightPacks

NUM_CONFIGS = 14  # tensor-core tile configurations (as tests/kernels/test_cpu_tuning.py)


def _tc(config: int, split: int | None = None) -> KernelChoice:
    return KernelChoice("tensor_core", config, split)


@pytest.mark.parametrize(("choice", "expected"), [
    (DEFAULT, (-1, -1, -1, -1, -1)),
    (KernelChoice(), (-1, -1, -1, -1, -1)),  # equal to DEFAULT, not the same object
    (KernelChoice("simt"), (FORCE_PATHS["simt"], -1, -1, -1, -1)),
    (KernelChoice("narrow"), (FORCE_PATHS["narrow"], -1, -1, -1, -1)),
    (KernelChoice("sparse"), (FORCE_PATHS["sparse"], -1, -1, -1, -1)),
    (KernelChoice("narrow_tiled"), (FORCE_PATHS["narrow_tiled"], -1, -1, -1, -1)),
    (_tc(9), (FORCE_PATHS["tensor_core"], 9, -1, -1, -1)),
    (_tc(5, 4), (FORCE_PATHS["tensor_core"], 5, 4, -1, -1)),
    (_tc(0, 1), (FORCE_PATHS["tensor_core"], 0, 1, -1, -1)),
    (KernelChoice("gemm", 2, 16), (FORCE_PATHS["gemm"], 2, 16, -1, -1)),
    (KernelChoice("gemm", 1, None, True), (FORCE_PATHS["gemm"], 1, -1, 1, -1)),
    (KernelChoice("gemm", 0, 4, False), (FORCE_PATHS["gemm"], 0, 4, 0, -1)),
    (KernelChoice("gemm", 0, 1, rounded=True), (FORCE_PATHS["gemm"], 0, 1, -1, 1)),
    (KernelChoice("gemm", 3, None, False, rounded=False), (FORCE_PATHS["gemm"], 3, -1, 0, 0)),
])
def test_forced_maps_a_choice_to_the_extension_arguments(choice: KernelChoice,
                                                         expected: tuple[int, int, int, int, int]) -> None:
    assert choice.forced() == expected


def test_force_paths_match_the_extension_codes() -> None:
    assert FORCE_PATHS == {None: -1, "simt": 0, "tensor_core": 1, "narrow": 2, "sparse": 3, "gemm": 4,
                           "narrow_tiled": 5, "shuffle": 6, "fold": 7, "taps": 8, "taps_fused": 9}
    for c in tuning.candidates(NUM_CONFIGS, 3, nchw_output=True):
        path, config, split, staged, rounded = c.forced()
        assert path == FORCE_PATHS[c.path]
        assert config == (-1 if c.config is None else c.config)
        assert split == -1
        assert staged == (-1 if c.staged is None else int(c.staged))
        assert rounded == -1


def test_weight_packs_take_a_contiguous_4d_cuda_weight_only() -> None:
    with pytest.raises(ConvTranspose2dArgumentError, match="contiguous 4-D CUDA"):
        WeightPacks(torch.randn(16, 8, 4, 4))
    w = torch.randn(16, 8, 4, 4)
    assert ext_packs(None, w) is None
    packs = object.__new__(WeightPacks)  # as if made for another tensor (no GPU here to make a real one)
    packs.weight = torch.randn(16, 8, 4, 4)
    with pytest.raises(ConvTranspose2dArgumentError, match="another weight tensor"):
        ext_packs(packs, w)
