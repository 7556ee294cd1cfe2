"""Measured kernel choice (kernels.tuning) without a GPU: the candidate lists, the passes' selection rules, the
cache, ``Tuner.choose``'s once-per-problem tuning under threads, and ``conv_transpose2d``'s use of the tuner."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kernels
import kernels.op
from kernels import tuning
from kernels.functional import ConvArgs, normalize_args
from kernels.tuning import (
    DEFAULT,
    SECOND_PASS_MAX,
    SPLIT_BELOW_MS,
    SPLIT_CONFIGS,
    SPLITS,
    TIE,
    KernelChoice,
    Trial,
    Tuner,
    TuneResult,
)

NUM_CONFIGS = 14
NUM_GATHER = 4  # tile configurations below this are gather tiles, the rest halo tiles (split-K capable)


def _tc(config: int, split: int | None = None) -> KernelChoice:
    return KernelChoice("tensor_core", config, split)


def _trial(choice: KernelChoice, ms: float, ran: str | None = None) -> Trial:
    return Trial(choice, ran if ran is not None else (choice.path or "tensor_core"), ms, None)


# --- pure rules ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "expected"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (63, 64), (64, 64),
                                             (65, 128)])
def test_bucket_is_the_next_power_of_two(n: int, expected: int) -> None:
    assert tuning.bucket(n) == expected


@pytest.mark.parametrize(("choice", "label"), [
    (DEFAULT, "default"),
    (KernelChoice(), "default"),
    (KernelChoice("narrow"), "narrow"),
    (KernelChoice("simt"), "simt"),
    (KernelChoice("narrow_tiled", 0), "narrow_tiled0"),
    (_tc(9), "tc9"),
    (_tc(5, 4), "tc5/s4"),
    (_tc(0, 1), "tc0/s1"),
])
def test_labels(choice: KernelChoice, label: str) -> None:
    assert choice.label == label


def test_choices_are_hashable_values() -> None:
    assert KernelChoice() == DEFAULT
    assert _tc(5, 4) == _tc(5, 4)
    assert _tc(5, 4) != _tc(5, 2)
    assert len({DEFAULT, KernelChoice(), _tc(3), _tc(3), _tc(3, 1)}) == 3


def test_candidates_cover_every_family_and_tile_once() -> None:
    cands = tuning.candidates(NUM_CONFIGS)
    assert cands[0] == DEFAULT
    assert len(cands) == len(set(cands)) == 1 + 6 + NUM_CONFIGS
    assert {c.path for c in cands} == {None, "fold", "taps", "taps_fused", "narrow", "sparse", "simt", "tensor_core"}
    tiled = tuning.candidates(NUM_CONFIGS, num_narrow_tiled_configs=2)
    assert [c for c in tiled if c.path == "narrow_tiled"] == [KernelChoice("narrow_tiled", 0),
                                                              KernelChoice("narrow_tiled", 1)]
    assert [c for c in tiled if c.path != "narrow_tiled"] == cands
    assert [c.config for c in cands if c.path == "tensor_core"] == list(range(NUM_CONFIGS))
    assert all(c.split is None for c in cands)
    assert all(c.config is None for c in cands if c.path != "tensor_core")


def test_shuffle_is_a_candidate_for_nchw_inputs_only() -> None:
    nchw = tuning.candidates(NUM_CONFIGS, 3, nchw_output=True)
    assert [c for c in nchw if c.path == "shuffle"] == [KernelChoice("shuffle")]
    assert not [c for c in tuning.candidates(NUM_CONFIGS, 3) if c.path == "shuffle"]


@pytest.mark.parametrize(("dtype", "precision", "expected"), [
    (torch.float32, "fp32", tuning.AGREE["fp32"]),
    (torch.float32, "tf32", tuning.AGREE["tf32"]),
    (torch.float64, "fp32", tuning.AGREE["fp64"]),
    (torch.float16, "fp32", tuning.AGREE["16bit"]),
    (torch.bfloat16, "fp32", tuning.AGREE["16bit"]),
])
def test_agree_tolerance(dtype: torch.dtype, precision: str, expected: float) -> None:
    assert tuning.agree_tolerance(dtype, precision) == expected


def test_agree_tolerances_order() -> None:
    a = tuning.AGREE
    assert a["fp64"] < a["fp32"] < a["tf32"] < a["16bit"]


def _small_problem_trials() -> list[Trial]:
    """A first pass under SPLIT_BELOW_MS: gather tiles (0..3) fastest, halo tiles 4..9 in scrambled order."""
    fast = SPLIT_BELOW_MS / 10
    return [
        _trial(DEFAULT, 4 * fast, ran="tensor_core"),  # the default ran a tensor-core tile: not a halo config
        _trial(KernelChoice("narrow"), 9 * fast),
        _trial(KernelChoice("simt"), 8 * fast),
        _trial(_tc(0), 1 * fast),  # gather tiles: faster, but they have no split-K
        _trial(_tc(3), 1.1 * fast),
        _trial(_tc(4), 6 * fast),
        _trial(_tc(5), 3 * fast),
        _trial(_tc(6), 7 * fast),
        _trial(_tc(7), 2 * fast),
        _trial(_tc(8), 5 * fast),
        _trial(_tc(9), 2.5 * fast),
        _trial(_tc(9, 2), 0.5 * fast),  # already split: never split again
    ]


def test_split_candidates_split_the_fastest_halo_tiles() -> None:
    got = tuning.split_candidates(_small_problem_trials(), NUM_GATHER)
    fastest_halo = [7, 9, 5][:SPLIT_CONFIGS]
    assert got == [_tc(c, s) for c in fastest_halo for s in SPLITS]
    assert all(c.config is not None and c.config >= NUM_GATHER for c in got)
    assert len(got) == SPLIT_CONFIGS * len(SPLITS)


def test_split_candidates_only_for_small_problems() -> None:
    trials = [_trial(t.choice, t.ms * 100, t.ran) for t in _small_problem_trials()]
    assert min(t.ms for t in trials) >= SPLIT_BELOW_MS
    assert tuning.split_candidates(trials, NUM_GATHER) == []
    # Exactly at the threshold is not small.
    at = [_trial(DEFAULT, SPLIT_BELOW_MS), _trial(_tc(5), SPLIT_BELOW_MS * 2)]
    assert tuning.split_candidates(at, NUM_GATHER) == []
    below = [_trial(DEFAULT, SPLIT_BELOW_MS * 0.99), _trial(_tc(5), SPLIT_BELOW_MS * 2)]
    assert tuning.split_candidates(below, NUM_GATHER) == [_tc(5, s) for s in SPLITS]


def test_split_candidates_need_a_halo_tile_that_ran_on_tensor_cores() -> None:
    fast = SPLIT_BELOW_MS / 10
    trials = [
        _trial(DEFAULT, fast, ran="tensor_core"),
        _trial(KernelChoice("narrow"), fast),
        _trial(_tc(0), fast),  # gather tile
        _trial(_tc(3), fast),  # gather tile
        _trial(_tc(6), fast, ran="simt"),  # not what ran
        _trial(_tc(7, 2), fast),  # already split
    ]
    assert tuning.split_candidates(trials, NUM_GATHER) == []
    assert tuning.split_candidates([], NUM_GATHER) == []


def test_second_pass_keeps_the_default_and_the_fastest_few() -> None:
    first = [
        _trial(DEFAULT, 1.0),
        _trial(_tc(3), 0.50),
        _trial(_tc(4), 0.60),
        _trial(KernelChoice("narrow"), 0.70),
        _trial(KernelChoice("simt"), 0.74),
        _trial(KernelChoice("sparse"), 0.80),
    ]
    got = tuning.second_pass_choices(first)
    assert got[0] == DEFAULT
    assert len(got) == SECOND_PASS_MAX
    assert got == [DEFAULT, _tc(3), _tc(4), KernelChoice("narrow")]  # simt (0.74) is within 1.5x but over the max


def test_second_pass_drops_candidates_far_from_the_best() -> None:
    first = [_trial(DEFAULT, 2.0), _trial(_tc(3), 1.0), _trial(_tc(4), 1.0 * tuning.SECOND_PASS_WITHIN + 0.01),
             _trial(KernelChoice("narrow"), 1.0 * tuning.SECOND_PASS_WITHIN)]
    assert tuning.second_pass_choices(first) == [DEFAULT, _tc(3), KernelChoice("narrow")]


def test_second_pass_when_the_default_is_fastest_lists_it_once() -> None:
    first = [_trial(_tc(5), 1.2), _trial(DEFAULT, 1.0), _trial(KernelChoice("simt"), 1.1),
             _trial(_tc(2), 1.3), _trial(_tc(7), 1.4)]
    got = tuning.second_pass_choices(first)
    assert got.count(DEFAULT) == 1
    assert got == [DEFAULT, KernelChoice("simt"), _tc(5), _tc(2)]


def test_second_pass_with_the_default_alone() -> None:
    assert tuning.second_pass_choices([_trial(DEFAULT, 1.0)]) == [DEFAULT]


def test_pick_keeps_the_default_on_a_tie() -> None:
    second = [_trial(DEFAULT, 1.0), _trial(_tc(5), 1.0 * (1 - TIE / 2)), _trial(KernelChoice("narrow"), 1.3)]
    assert tuning.pick(second) == (DEFAULT, 1.0, 1.0)
    # Exactly TIE faster is still a tie.
    assert tuning.pick([_trial(DEFAULT, 1.0), _trial(_tc(5), 1.0 - TIE)])[0] == DEFAULT


def test_pick_takes_a_clear_winner() -> None:
    second = [_trial(KernelChoice("narrow"), 0.9), _trial(DEFAULT, 1.0), _trial(_tc(5, 2), 0.7),
              _trial(_tc(5), 0.8)]
    assert tuning.pick(second) == (_tc(5, 2), 0.7, 1.0)


def test_pick_keeps_the_default_when_it_is_fastest() -> None:
    second = [_trial(_tc(5), 1.1), _trial(DEFAULT, 0.5)]
    assert tuning.pick(second) == (DEFAULT, 0.5, 0.5)


# --- the cache -------------------------------------------------------------------------------------------------


WEIGHT = torch.randn(16, 8, 4, 4, generator=torch.Generator().manual_seed(0))
ARGS = normalize_args(2, 1)


def _key(shape: Sequence[int], **kw: Any) -> Any:
    return Tuner.key(shape, kw.get("weight", WEIGHT), kw.get("has_bias", True), kw.get("args", ARGS),
                     kw.get("precision", "fp32"), kw.get("aligned", True))


def test_key_separates_every_part_of_the_problem() -> None:
    base = _key((2, 16, 8, 8))
    assert base == _key([2, 16, 8, 8]) == _key(torch.Size([2, 16, 8, 8]))
    others = [
        _key((4, 16, 8, 8)),
        _key((2, 16, 8, 9)),
        _key((2, 16, 8, 8), weight=WEIGHT.double()),
        _key((2, 16, 8, 8), weight=torch.randn(16, 8, 3, 3)),
        _key((2, 16, 8, 8), has_bias=False),
        _key((2, 16, 8, 8), args=normalize_args(2, 0)),
        _key((2, 16, 8, 8), args=normalize_args(2, 1, 1)),
        _key((2, 16, 8, 8), precision="tf32"),
        _key((2, 16, 8, 8), aligned=False),
        # channels-last weights: the gemm kernel reads 16-bit ones as they are (no packing), so they time apart
        _key((2, 16, 8, 8), weight=WEIGHT.contiguous(memory_format=torch.channels_last)),
    ]
    assert base not in others
    assert len(set(others)) == len(others)
    assert hash(base) == hash(_key((2, 16, 8, 8)))
    assert base == _key((2, 16, 8, 8), weight=WEIGHT.clone())  # the weight's values and storage do not count


def test_store_lookup_clear() -> None:
    tuner = Tuner()
    a = _key((1, 16, 8, 8))
    assert tuner.lookup(a) is None
    assert len(tuner) == 0
    tuner.store(a, _tc(5))
    assert tuner.lookup(a) == _tc(5)
    tuner.store(a, _tc(6, 2))  # replaced, not duplicated
    assert tuner.lookup(a) == _tc(6, 2)
    assert len(tuner) == 1
    tuner.clear()
    assert len(tuner) == 0
    assert tuner.lookup(a) is None


def test_store_drops_the_oldest_past_max_entries() -> None:
    tuner = Tuner(max_entries=3)
    keys = [_key((n, 16, 8, 8)) for n in range(1, 6)]
    for i, k in enumerate(keys[:3]):
        tuner.store(k, _tc(i))
    assert len(tuner) == 3
    tuner.store(keys[3], _tc(3))
    assert len(tuner) == 3
    assert tuner.lookup(keys[0]) is None  # the oldest went first
    assert [tuner.lookup(k) for k in keys[1:4]] == [_tc(1), _tc(2), _tc(3)]
    tuner.store(keys[1], _tc(7))  # storing again makes it the newest
    tuner.store(keys[4], _tc(4))
    assert tuner.lookup(keys[2]) is None
    assert [tuner.lookup(k) for k in (keys[1], keys[3], keys[4])] == [_tc(7), _tc(3), _tc(4)]
    assert len(tuner) == 3


def test_default_max_entries() -> None:
    assert Tuner().max_entries == tuning.MAX_ENTRIES
    assert Tuner().enabled is False


# --- choose ----------------------------------------------------------------------------------------------------


class FakeTune:
    """Stands in for ``Tuner.tune`` (which needs CUDA): records its calls, waits a little, stores ``answer`` under
    the problem's key as the real one does, and returns a TuneResult."""

    def __init__(self, tuner: Tuner, answer: KernelChoice, delay_s: float = 0.0,
                 error: Exception | None = None) -> None:
        self.tuner = tuner
        self.answer = answer
        self.delay_s = delay_s
        self.error = error
        self.calls: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()

    def __call__(self, shape: Sequence[int], weight: torch.Tensor, bias: torch.Tensor | None, args: ConvArgs,
                 precision: str, aligned: bool = True, packs: Any = None, channels_last: bool = False) -> TuneResult:
        with self._lock:
            self.calls.append((tuple(shape), bias is not None, args, precision, aligned))
        time.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        self.tuner.store(Tuner.key(tuple(int(d) for d in shape), weight, bias is not None, args, precision,
                                   aligned, packs is not None, channels_last), self.answer)
        return TuneResult(self.answer, 1.0, 2.0, (), self.delay_s)


def _fake(monkeypatch: pytest.MonkeyPatch, tuner: Tuner, answer: KernelChoice, **kw: Any) -> FakeTune:
    fake = FakeTune(tuner, answer, **kw)
    monkeypatch.setattr(tuner, "tune", fake)
    return fake


def test_choose_when_disabled_is_the_default_and_never_tunes(monkeypatch: pytest.MonkeyPatch) -> None:
    tuner = Tuner(enabled=False)
    fake = _fake(monkeypatch, tuner, _tc(5))
    tuner.store(_key((2, 16, 8, 8)), _tc(6))  # even a cached choice is not used
    bias = torch.zeros(8)
    assert tuner.choose((2, 16, 8, 8), WEIGHT, bias, ARGS, "fp32") is DEFAULT
    assert tuner.choose((3, 16, 8, 8), WEIGHT, None, ARGS, "tf32", aligned=False) is DEFAULT
    assert fake.calls == []


def test_choose_tunes_once_then_uses_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    tuner = Tuner(enabled=True)
    fake = _fake(monkeypatch, tuner, _tc(9, 2))
    bias = torch.zeros(8)
    assert tuner.choose((2, 16, 8, 8), WEIGHT, bias, ARGS, "fp32") == _tc(9, 2)
    assert tuner.choose(torch.Size([2, 16, 8, 8]), WEIGHT, bias, ARGS, "fp32") == _tc(9, 2)
    assert tuner.choose([2, 16, 8, 8], WEIGHT, torch.ones(8), ARGS, "fp32", aligned=True) == _tc(9, 2)
    assert fake.calls == [((2, 16, 8, 8), True, ARGS, "fp32", True)]
    assert len(tuner) == 1
    assert tuner.lookup(_key((2, 16, 8, 8))) == _tc(9, 2)


def test_choose_uses_a_stored_choice_without_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    tuner = Tuner(enabled=True)
    fake = _fake(monkeypatch, tuner, _tc(1))
    tuner.store(_key((2, 16, 8, 8), has_bias=False), KernelChoice("narrow"))
    assert tuner.choose((2, 16, 8, 8), WEIGHT, None, ARGS, "fp32") == KernelChoice("narrow")
    assert fake.calls == []


def test_choose_tunes_each_problem_separately(monkeypatch: pytest.MonkeyPatch) -> None:
    tuner = Tuner(enabled=True)
    fake = _fake(monkeypatch, tuner, _tc(5))
    bias = torch.zeros(8)
    problems: list[tuple[tuple[int, ...], torch.Tensor | None, str, bool]] = [
        ((2, 16, 8, 8), bias, "fp32", True),
        ((2, 16, 8, 8), bias, "fp32", False),  # unaligned rows: another problem
        ((4, 16, 8, 8), bias, "fp32", True),  # another batch size
        ((2, 16, 9, 8), bias, "fp32", True),  # another height
        ((2, 16, 8, 8), None, "fp32", True),  # no bias
        ((2, 16, 8, 8), bias, "tf32", True),  # another precision
    ]
    for _ in range(2):
        for shape, b, precision, aligned in problems:
            assert tuner.choose(shape, WEIGHT, b, ARGS, precision, aligned=aligned) == _tc(5)
    assert len(fake.calls) == len(problems)
    assert [(c[0], c[1], c[3], c[4]) for c in fake.calls] == [
        (shape, b is not None, precision, aligned) for shape, b, precision, aligned in problems]
    assert len(tuner) == len(problems)


def test_choose_tunes_once_under_concurrent_callers(monkeypatch: pytest.MonkeyPatch) -> None:
    tuner = Tuner(enabled=True)
    fake = _fake(monkeypatch, tuner, _tc(7, 4), delay_s=0.05)
    bias = torch.zeros(8)
    threads_per_problem = 6
    shapes = [(2, 16, 8, 8), (4, 16, 8, 8)]
    barrier = threading.Barrier(threads_per_problem * len(shapes))
    results: list[tuple[tuple[int, ...], KernelChoice]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def caller(shape: tuple[int, ...]) -> None:
        try:
            barrier.wait(5)
            choice = tuner.choose(shape, WEIGHT, bias, ARGS, "fp32")
            with lock:
                results.append((shape, choice))
        except BaseException as exc:  # reported below
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=caller, args=(s,)) for s in shapes for _ in range(threads_per_problem)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert len(results) == len(threads)
    assert all(choice == _tc(7, 4) for _, choice in results)
    assert sorted(c[0] for c in fake.calls) == sorted(shapes)  # once per problem, not once per thread
    assert len(tuner) == len(shapes)


def test_a_failed_tuning_is_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    tuner = Tuner(enabled=True)
    fake = _fake(monkeypatch, tuner, _tc(5), error=RuntimeError("bad argument (simulated)"))
    with pytest.raises(RuntimeError, match="simulated"):
        tuner.choose((2, 16, 8, 8), WEIGHT, None, ARGS, "fp32")
    assert len(tuner) == 0
    fake.error = None
    assert tuner.choose((2, 16, 8, 8), WEIGHT, None, ARGS, "fp32") == _tc(5)
    assert len(fake.calls) == 2


def test_tuning_out_of_memory_runs_the_default_and_tunes_again_later(monkeypatch: pytest.MonkeyPatch) -> None:
    tuner = Tuner(enabled=True)
    fake = _fake(monkeypatch, tuner, _tc(5), error=torch.cuda.OutOfMemoryError("out of memory (simulated)"))
    assert tuner.choose((2, 16, 8, 8), WEIGHT, None, ARGS, "fp32") == DEFAULT
    assert len(tuner) == 0
    fake.error = None
    assert tuner.choose((2, 16, 8, 8), WEIGHT, None, ARGS, "fp32") == _tc(5)
    assert len(fake.calls) == 2


# --- the module's switch, and conv_transpose2d ---------------------------------------------------------------


def test_tuning_is_reachable_from_the_package() -> None:
    assert kernels.tuning is sys.modules["kernels.tuning"]
    assert "tuning" in kernels.__all__
    assert kernels.op.TUNER is tuning.TUNER
    assert isinstance(tuning.TUNER, Tuner)


def test_enable_switches_the_process_tuner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning.TUNER, "enabled", False)  # restored at teardown
    assert tuning.enabled() is False
    tuning.enable()
    assert tuning.enabled() is True
    assert tuning.TUNER.enabled is True
    tuning.enable(False)
    assert tuning.enabled() is False


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("true", True), (" ON ", True), ("yes", True),
                                                 ("", True), ("0", False), (" False ", False), ("off", False),
                                                 ("no", False)])
def test_environment_switch(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    monkeypatch.setenv("DECONV_TUNE", value)
    assert tuning._env_enabled() is expected


def test_measured_choice_is_on_unless_the_environment_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DECONV_TUNE", raising=False)
    assert tuning._env_enabled() is True


class RaisingTuner:
    """A tuner that is on and must not be asked."""

    enabled = True

    def choose(self, *args: Any, **kwargs: Any) -> KernelChoice:
        raise AssertionError("the tuner was consulted for a CPU tensor")


@pytest.mark.parametrize("requires_grad", [False, True])
def test_cpu_tensors_never_consult_the_tuner(monkeypatch: pytest.MonkeyPatch, requires_grad: bool) -> None:
    monkeypatch.setattr(tuning.TUNER, "enabled", True)
    monkeypatch.setattr(tuning.TUNER, "choose", RaisingTuner().choose)
    monkeypatch.setattr(tuning.TUNER, "tune", RaisingTuner().choose)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 5, 6, generator=g, requires_grad=requires_grad)
    b = torch.randn(8, generator=g)
    y = kernels.conv_transpose2d(x, WEIGHT, b, stride=2, padding=1)
    assert torch.equal(y, F.conv_transpose2d(x, WEIGHT, b, 2, 1))
    if requires_grad:
        y.sum().backward()
        assert x.grad is not None
    # The same with a stand-in tuner object where the CUDA call reads it.
    monkeypatch.setattr(kernels.op, "TUNER", RaisingTuner())
    y1 = kernels.conv_transpose2d(x[0], WEIGHT, None, 2, 1)  # unbatched
    assert torch.equal(y1, F.conv_transpose2d(x[0], WEIGHT, None, 2, 1))
