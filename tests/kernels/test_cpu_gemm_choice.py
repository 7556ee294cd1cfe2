"""Measured choice and the gemm kernel (kernels.tuning), on the CPU: which gemm candidates the tuner times."""

from __future__ import annotations

from kernels import tuning
from kernels.tuning import DEFAULT, GEMM_SPLITS, ROUNDED_CHOICES, SPLIT_BELOW_MS, KernelChoice, Trial

NUM_CONFIGS = 14
NUM_GATHER = 4
NUM_GEMM = 13


def _trial(choice: KernelChoice, ms: float, ran: str) -> Trial:
    return Trial(choice, ran, ms, None)


def test_candidates_include_every_gemm_configuration_once() -> None:
    got = tuning.candidates(NUM_CONFIGS, NUM_GEMM)
    gemm = [c for c in got if c.path == "gemm"]
    assert gemm == [KernelChoice("gemm", c) for c in range(NUM_GEMM)]
    assert len(got) == len(set(got))
    assert tuning.candidates(NUM_CONFIGS) == [c for c in got if c.path != "gemm"]  # no gemm kernel: none asked


def test_an_nchw_output_times_each_gemm_configuration_staged_and_straight() -> None:
    got = tuning.candidates(NUM_CONFIGS, NUM_GEMM, nchw_output=True)
    gemm = [c for c in got if c.path == "gemm"]
    assert gemm == [KernelChoice("gemm", c, staged=s) for c in range(NUM_GEMM) for s in (False, True)]
    # Beside them, the other families as for a channels-last output, and the shuffle kernel (NCHW inputs only).
    others = [c for c in got if c.path not in ("gemm", "shuffle")]
    assert others == [c for c in tuning.candidates(NUM_CONFIGS) if c.path != "gemm"]
    assert [c for c in got if c.path == "shuffle"] == [KernelChoice("shuffle")]


def test_split_candidates_keep_the_fastest_gemm_output_route() -> None:
    fast = SPLIT_BELOW_MS / 10
    trials = [_trial(DEFAULT, fast, "gemm"), _trial(KernelChoice("gemm", 0, staged=False), 3 * fast, "gemm"),
              _trial(KernelChoice("gemm", 0, staged=True), 2 * fast, "gemm")]
    got = [c for c in tuning.split_candidates(trials, NUM_GATHER) if c.path == "gemm"]
    assert got == [KernelChoice("gemm", 0, s, True) for s in GEMM_SPLITS]


def test_small_problems_time_the_fastest_gemm_configuration_split() -> None:
    fast = SPLIT_BELOW_MS / 10
    trials = [_trial(DEFAULT, fast, "gemm"), _trial(KernelChoice("gemm", 0), 3 * fast, "gemm"),
              _trial(KernelChoice("gemm", 1), 2 * fast, "gemm"), _trial(KernelChoice("gemm", 2), 4 * fast, "gemm"),
              _trial(KernelChoice("gemm", 1, 4), fast, "gemm")]  # already split: never split again
    got = [c for c in tuning.split_candidates(trials, NUM_GATHER) if c.path == "gemm"]
    assert got == [KernelChoice("gemm", 1, s) for s in GEMM_SPLITS]


def test_no_gemm_split_candidates_when_it_did_not_run_or_the_problem_is_large() -> None:
    fast = SPLIT_BELOW_MS / 10
    fell_back = [_trial(DEFAULT, fast, "tensor_core"), _trial(KernelChoice("gemm", 0), fast, "tensor_core")]
    assert [c for c in tuning.split_candidates(fell_back, NUM_GATHER) if c.path == "gemm"] == []
    large = [_trial(DEFAULT, SPLIT_BELOW_MS, "gemm"), _trial(KernelChoice("gemm", 0), SPLIT_BELOW_MS, "gemm")]
    assert tuning.split_candidates(large, NUM_GATHER) == []


def test_gemm_labels() -> None:
    assert KernelChoice("gemm", 2).label == "gemm2"
    assert KernelChoice("gemm", 0, 16).label == "gemm0/s16"
    assert KernelChoice("gemm").label == "gemm"
    assert KernelChoice("gemm", 1, 2, True).label == "gemm1/s2/staged"
    assert KernelChoice("gemm", 0, staged=False).label == "gemm0/direct"
    assert KernelChoice("gemm", 0, 1, rounded=True).label == "gemm0/s1/rounded"
    assert KernelChoice("gemm", 3, rounded=False).label == "gemm3/kernel-rounded"


def test_rounded_candidates_are_the_fastest_gemm_trials_with_a_rounded_input() -> None:
    trials = [_trial(DEFAULT, 1.0, "gemm"), _trial(KernelChoice("gemm", 0), 3.0, "gemm"),
              _trial(KernelChoice("gemm", 1), 0.5, "gemm"), _trial(KernelChoice("gemm", 2, 4), 0.7, "gemm"),
              _trial(KernelChoice("gemm", 5), 0.1, "tensor_core"),  # fell back: not a gemm trial
              _trial(KernelChoice("gemm", 1, rounded=True), 0.2, "gemm"),  # already rounded
              _trial(KernelChoice("tensor_core", 3), 0.3, "tensor_core")]
    for rounded in (True, False):  # channels-last inputs rounded before the kernel; NCHW ones by the kernel
        got = tuning.rounded_candidates(trials, rounded)
        assert len(got) == ROUNDED_CHOICES == 3
        assert got == [KernelChoice("gemm", 1, rounded=rounded), KernelChoice("gemm", 2, 4, rounded=rounded),
                       KernelChoice("gemm", rounded=rounded)]
    assert tuning.rounded_candidates([_trial(KernelChoice("tensor_core", 3), 0.3, "tensor_core")], True) == []
