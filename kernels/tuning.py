"""Measured kernel choice per problem, like ``torch.backends.cudnn.benchmark``.

The dispatcher in kernels/csrc picks a kernel family (narrow, sparse, tensor cores, SIMT), a tile configuration
and a split-K factor from the problem's sizes alone. That rule was fitted on a handful of problems, and on others
a different tile is faster (bench/NOTES.md v12). With tuning on, the first call of a problem times every kernel
that can run it, on random inputs of the same shape, and keeps the fastest; later calls of that problem reuse the
choice at no cost (a dictionary lookup).

Tuning is on by default: on 320 generated decoder layers the rule's kernel was within 1.15x of the measured one on
only 41% of them and over 1.5x slower on 113, while measuring took 62 ms per layer (median; 0.18 s at the 90th
percentile, 0.55 s at most; bench/kernels/choice_sweep.py, bench/NOTES.md v26), once per GPU model thanks to the
store below.
``DECONV_TUNE=0`` in the environment (or ``kernels.tuning.enable(False)``) runs the rule's choice instead: no
measuring on first calls, and the same kernel, so the same rounding, on every machine.

    import kernels
    y = kernels.conv_transpose2d(x, w, b, 2)  # the first call of this shape measures (milliseconds, once)
    kernels.tuning.enable(False)              # or DECONV_TUNE=0 in the environment: the rule's choice

A problem is the device, the input's shape, dtype and memory layout (NCHW or channels-last: the gemm kernel reads
the latter as it is, the other kernels the former), the weight's shape, whether there is a bias, the stride,
padding, output_padding, dilation and groups, the precision, whether the input rows start 16-byte aligned (what
the warp-specialized tiles need), and whether the calls bring packed weights (``WeightPacks``: the service's do,
which makes the tensor-core kernels cheaper by their packing kernel). Every choice is one that the GPU tests run
on awkward shapes, so any choice is correct; the tuner still compares each candidate's output with the default
kernel's and drops a candidate that disagrees (logged as an error: it would be a kernel bug).

Choices are also kept on disk (``kernels.choice_store``: one file per GPU model, driver, torch and kernel build,
``DECONV_TUNE_CACHE``), so that a problem measured once is not measured again by a later process: a restarted
server, or the next run of a script, reads the choice instead.

Timing follows bench/harness.py's Timer: CUDA events around each call, an L2 flush before each, the median of several
calls. A first pass times every candidate a few times; the fastest few are timed again, longer, with the default
among them, and the fastest of that pass wins (the default on a tie within 2%).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kernels import choice_store
from kernels.internal import FORCE_PATHS, forward_cuda, load_extension, loaded_extension, out_hw

log = logging.getLogger("deconv.tuning")

# First pass: every candidate, this many timed calls; second pass: the best few, this many.
FIRST_REPS = 3
SECOND_REPS = 15
SECOND_PASS_MAX = 4  # candidates in the second pass, the default among them
SECOND_PASS_WITHIN = 1.5  # ... and only those within this factor of the first pass's best
TIE = 0.02  # a candidate must beat the default by more than this fraction to replace it
# Split-K candidates (several blocks of a thread-block cluster sharing one tile) are timed only for problems whose
# best first-pass time is under this: larger problems already fill the GPU with tiles.
SPLIT_BELOW_MS = 0.25
SPLITS = (1, 2, 4, 8)
SPLIT_CONFIGS = 3  # the fastest halo configurations of the first pass that get split candidates
GEMM_SPLITS = (1, 2, 4, 8, 16)  # the gemm kernel's split-K candidates, for its fastest configuration
# TF32: the gemm kernel's fastest choices are timed again with the input rounded the other way (``rounded``): a
# channels-last input rounded to TF32 in a pass of its own, which spares the kernel rounding each stage; an NCHW
# one, which its layout change rounds by default, rounded by the kernel (bench/NOTES.md v22).
ROUNDED_CHOICES = 3
MAX_ENTRIES = 4096  # cached problems per process (the oldest dropped first)
# Norm-wise relative difference from the default kernel's output above which a candidate is rejected, by precision
# ("fp32" exact, "tf32", 16-bit types, float64): several times what two correct kernels differ by.
AGREE = {"fp32": 1e-4, "tf32": 5e-3, "16bit": 3e-2, "fp64": 1e-10}


@dataclass(frozen=True)
class KernelChoice:
    """A kernel asked of the dispatcher: ``path`` ("simt", "tensor_core", "narrow", "narrow_tiled", "sparse", "gemm",
    "shuffle", "fold", "taps", "taps_fused" or None to let it choose), ``config`` (a tile configuration of the
    tensor-core kernels, or of the gemm kernel), ``split`` (the halo or gemm kernel's split-K factor), ``staged`` (the
    gemm kernel with an NCHW output: True writes it channels-last into scratch and converts it, False stores it
    straight) and ``rounded`` (the gemm kernel's TF32 products: True rounds the input to TF32 before the kernel, False
    has the kernel round each stage)."""

    path: str | None = None
    config: int | None = None
    split: int | None = None
    staged: bool | None = None
    rounded: bool | None = None

    @property
    def label(self) -> str:
        """Short name for logs and tables: "default", "narrow", "narrow_tiled1", "tc9", "tc5/s4", "gemm0/s2",
        "gemm1/s1/staged", "gemm0/s1/rounded"."""
        if self == DEFAULT:
            return "default"
        prefix = "tc" if self.path in (None, "tensor_core") else self.path
        name = f"{prefix}{self.config}" if self.config is not None else (self.path or "default")
        if self.split is not None:
            name = f"{name}/s{self.split}"
        if self.staged is not None:
            name = f"{name}/{'staged' if self.staged else 'direct'}"
        if self.rounded is not None:
            name = f"{name}/{'rounded' if self.rounded else 'kernel-rounded'}"
        return name

    def forced(self) -> tuple[int, int, int, int, int]:
        """The extension's (force_path, force_config, force_split, force_staged, force_round) for this choice."""
        return (FORCE_PATHS[self.path], -1 if self.config is None else self.config,
                -1 if self.split is None else self.split, -1 if self.staged is None else int(self.staged),
                -1 if self.rounded is None else int(self.rounded))


DEFAULT = KernelChoice()


@dataclass(frozen=True)
class Trial:
    """One candidate's measurement: the kernel family that ran, its median time and its output's relative
    difference from the default kernel's (None when it was not compared)."""

    choice: KernelChoice
    ran: str
    ms: float
    diff: float | None


@dataclass(frozen=True)
class TuneResult:
    """The outcome of tuning one problem: the choice, its time and the default's (second pass, same calls), every
    trial (first pass, then second), and the seconds tuning took."""

    choice: KernelChoice
    ms: float
    default_ms: float
    trials: tuple[Trial, ...]
    seconds: float


def _env_enabled() -> bool:
    """Measured choice is on unless ``DECONV_TUNE`` turns it off (0, false, no, off)."""
    return os.environ.get("DECONV_TUNE", "").strip().lower() not in ("0", "false", "no", "off")


def bucket(n: int) -> int:
    """The batch size a serving batch of ``n`` samples is tuned at: the next power of two."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def agree_tolerance(dtype: torch.dtype, precision: str) -> float:
    """How far a candidate's output may be from the default kernel's (norm-wise relative difference)."""
    if dtype == torch.float64:
        return AGREE["fp64"]
    if dtype == torch.float32:
        return AGREE[precision]
    return AGREE["16bit"]


def candidates(num_configs: int, num_gemm_configs: int = 0, nchw_output: bool = False,
               num_narrow_tiled_configs: int = 0) -> list[KernelChoice]:
    """Every first-pass candidate: the default, each kernel family, each tensor-core, tiled narrow and gemm
    configuration; for an NCHW output, each gemm configuration both staged and stored straight, and the shuffle
    kernel (it reads an NCHW input as it is)."""
    out = [DEFAULT, KernelChoice("fold"), KernelChoice("taps"), KernelChoice("taps_fused"), KernelChoice("narrow")]
    if nchw_output:
        out.append(KernelChoice("shuffle"))
    out += [KernelChoice("narrow_tiled", c) for c in range(num_narrow_tiled_configs)]
    out += [KernelChoice("sparse"), KernelChoice("simt")]
    out += [KernelChoice("tensor_core", c) for c in range(num_configs)]
    for c in range(num_gemm_configs):
        out += [KernelChoice("gemm", c, staged=s) for s in (False, True)] if nchw_output else [KernelChoice("gemm", c)]
    return out


def split_candidates(trials: Sequence[Trial], num_gather: int) -> list[KernelChoice]:
    """Split-K variants (when the problem is small) of the fastest halo tile configurations among ``trials`` and of
    the fastest gemm configuration."""
    if not trials or min(t.ms for t in trials) >= SPLIT_BELOW_MS:
        return []
    tc = [t for t in trials if t.ran == "tensor_core" and t.choice.config is not None
          and t.choice.config >= num_gather and t.choice.split is None]
    best = sorted(tc, key=lambda t: t.ms)[:SPLIT_CONFIGS]
    out = [KernelChoice("tensor_core", t.choice.config, s) for t in best for s in SPLITS]
    gemm = [t for t in trials if t.ran == "gemm" and t.choice.path == "gemm" and t.choice.split is None]
    if gemm:
        g = min(gemm, key=lambda t: t.ms).choice
        out += [KernelChoice("gemm", g.config, s, g.staged) for s in GEMM_SPLITS]
    return out


def rounded_candidates(trials: Sequence[Trial], rounded: bool) -> list[KernelChoice]:
    """The ``ROUNDED_CHOICES`` fastest gemm trials among ``trials`` (any split, the input rounded as by default),
    each with ``rounded`` asked for: True (a channels-last input rounded to TF32 before the kernel) or False (an
    NCHW one rounded by the kernel)."""
    gemm = sorted((t for t in trials if t.ran == "gemm" and t.choice.rounded is None), key=lambda t: t.ms)
    out: list[KernelChoice] = []
    for t in gemm:
        c = t.choice
        r = KernelChoice("gemm", c.config, c.split, c.staged, rounded=rounded)
        if r not in out:
            out.append(r)
        if len(out) == ROUNDED_CHOICES:
            break
    return out


def pick(second: Sequence[Trial]) -> tuple[KernelChoice, float, float]:
    """The winner of the second pass (the default on a tie within ``TIE``): (choice, its ms, the default's ms).
    The first pass only chose who runs in the second."""
    default = next(t for t in second if t.choice == DEFAULT)
    best = min(second, key=lambda t: t.ms)
    if best.ms < default.ms * (1 - TIE):
        return best.choice, best.ms, default.ms
    return DEFAULT, default.ms, default.ms


def second_pass_choices(first: Sequence[Trial]) -> list[KernelChoice]:
    """Who runs again: the default, then the fastest first-pass candidates within ``SECOND_PASS_WITHIN`` of the
    best, ``SECOND_PASS_MAX`` in all."""
    best = min(t.ms for t in first)
    out = [DEFAULT]
    for t in sorted(first, key=lambda t: t.ms):
        if len(out) >= SECOND_PASS_MAX or t.ms > best * SECOND_PASS_WITHIN:
            break
        if t.choice not in out:
            out.append(t.choice)
    return out


# GPU cycles of a sleep queued before each timed call (~100 us at H100/H200 clocks), longer than any call's host
# dispatch, so that the call is queued before its start event runs and the events time the GPU alone, not the host
# (bench/harness.py's timers use it too; bench/NOTES.md v12: on a slow host a batch-1 call's Python dispatch outlasted
# the L2 flush).
HOST_SLACK_CYCLES = 200_000


class Timer:
    """CUDA-event timing of one call's GPU time after an L2 flush, as bench/harness.py's Timer times: the median of
    ``reps``."""

    def __init__(self, device: torch.device) -> None:
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        self.flush = torch.empty(max(2 * l2, 64 << 20), dtype=torch.uint8, device=device)

    def __call__(self, fn: Callable[[], object], reps: int) -> float:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
        for start, end in events:
            self.flush.zero_()
            torch.cuda._sleep(HOST_SLACK_CYCLES)
            start.record()
            fn()
            end.record()
        events[-1][1].synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)


class Tuner:
    """The process's cache of measured choices (``TUNER``); thread-safe, one tuning at a time per device."""

    def __init__(self, enabled: bool = False, max_entries: int = MAX_ENTRIES) -> None:
        self._enabled = enabled
        self.max_entries = max_entries
        # Read without the lock (one dict lookup, atomic in CPython: a call's whole cost when tuned); written with it.
        self._cache: dict[Hashable, KernelChoice] = {}
        self._lock = threading.Lock()  # guards writes to _cache, and _device_locks, _files
        self._device_locks: dict[int, threading.Lock] = {}
        # Per CUDA device index: its choice file and the entries read from it, or None (the store is off or failed).
        self._files: dict[int, tuple[choice_store.ChoiceFile, dict[str, dict[str, Any]]] | None] = {}

    @property
    def enabled(self) -> bool:
        """Whether calls use measured choice. Changing it makes the extension forget the calls it remembered (their
        kernel choice was the other way's)."""
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = bool(value)
        _forget_calls()

    @staticmethod
    def key(shape: Sequence[int], weight: torch.Tensor, has_bias: bool, args: Any, precision: str,
            aligned: bool, packed: bool = False, channels_last: bool = False) -> tuple[Hashable, ...]:
        """The cache key of a problem (``args``: kernels.functional.ConvArgs, hashable). The weight's strides count:
        the gemm kernel reads channels-last 16-bit weights as they are and packs NCHW ones on every call."""
        return (torch.Size(shape), weight.shape, weight.stride(), weight.dtype, weight.device, has_bias, args,
                precision, aligned, packed, channels_last)

    def lookup(self, key: Hashable) -> KernelChoice | None:
        """The cached choice for ``key``, or None."""
        return self._cache.get(key)

    def store(self, key: Hashable, choice: KernelChoice) -> None:
        """Cache ``choice`` for ``key``; past ``max_entries`` the oldest entries are dropped first."""
        with self._lock:
            self._cache.pop(key, None)
            self._cache[key] = choice
            while len(self._cache) > self.max_entries:
                del self._cache[next(iter(self._cache))]

    def clear(self) -> None:
        """Forget every choice held in memory (and the extension the calls it remembered with them). Choices kept on
        disk are read again on the next call of their problem (``kernels.choice_store``: delete the file, or set
        ``DECONV_TUNE_CACHE=off``, to measure anew)."""
        with self._lock:
            self._cache.clear()
            self._files.clear()
        _forget_calls()

    def _file(self, device: torch.device) -> tuple[choice_store.ChoiceFile, dict[str, dict[str, Any]]] | None:
        """``device``'s choice file and its entries (read once), or None: not a CUDA device, the store off, or
        failed (logged once)."""
        if device.type != "cuda":
            return None
        index = _index(device)
        if index in self._files:
            return self._files[index]
        found = None
        try:
            directory = choice_store.store_dir()
            if directory is not None:
                load_extension()
                from kernels.build import loaded_key

                name = choice_store.identity(torch.device("cuda", index), loaded_key() or "unbuilt")
                file = choice_store.ChoiceFile(directory / f"{name}.json")
                found = (file, file.read())
        except Exception as exc:  # the store is an optimisation: never a reason for a call to fail
            log.warning("measured kernel choices are kept in memory only: %s", exc)
        with self._lock:
            return self._files.setdefault(index, found)

    def _recall(self, key: tuple[Hashable, ...], device: torch.device) -> KernelChoice | None:
        """The choice kept on disk for ``key``, if any."""
        found = self._file(device)
        fields = None if found is None else found[1].get(choice_store.problem_id(key))
        if fields is None or fields["path"] not in FORCE_PATHS:  # a kernel family this code does not know
            return None
        return KernelChoice(**fields)

    def _keep(self, key: tuple[Hashable, ...], device: torch.device, choice: KernelChoice) -> None:
        """Write ``choice`` for ``key`` to ``device``'s choice file (the store turns off for this device if that
        fails)."""
        found = self._file(device)
        if found is None:
            return
        file, entries = found
        problem, fields = choice_store.problem_id(key), dataclasses.asdict(choice)
        try:
            file.write(problem, fields)
        except OSError as exc:
            log.warning("cannot keep measured kernel choices in %s (%s); they are kept in memory only", file.path,
                        exc)
            with self._lock:
                self._files[_index(device)] = None
            return
        entries[problem] = fields

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)

    def _device_lock(self, index: int) -> threading.Lock:
        with self._lock:
            return self._device_locks.setdefault(index, threading.Lock())

    def choose(self, shape: Sequence[int], weight: torch.Tensor, bias: torch.Tensor | None, args: Any,
               precision: str, aligned: bool = True, packs: Any = None, channels_last: bool = False) -> KernelChoice:
        """The kernel for this problem: ``DEFAULT`` when tuning is off, else the cached choice, tuning it first
        if there is none (on ``weight``'s device, on the current stream, blocking the calling thread); the default
        when tuning runs out of GPU memory. ``packs``: the calls' ``WeightPacks`` for ``weight``, if they bring
        them; ``channels_last``: whether the calls' inputs are channels-last.

        Raises:
            what the default kernel raises on this problem, other than running out of memory.
        """
        if not self.enabled:
            return DEFAULT
        key = self.key(shape, weight, bias is not None, args, precision, aligned, packs is not None, channels_last)
        choice = self.lookup(key)
        if choice is not None:
            return choice
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            return DEFAULT  # no measuring inside a CUDA graph capture: tune the problem before capturing it
        with self._device_lock(weight.device.index or 0):
            choice = self.lookup(key)  # another thread may have tuned it meanwhile
            if choice is None:
                choice = self._recall(key, weight.device)  # measured by an earlier process
                if choice is not None:
                    self.store(key, choice)
                    return choice
                try:
                    choice = self.tune(shape, weight, bias, args, precision, aligned=aligned, packs=packs,
                                       channels_last=channels_last).choice
                except torch.cuda.OutOfMemoryError:
                    # Tuning holds a few copies of the problem; the call itself may still fit. Not cached: a
                    # later call tunes again.
                    log.warning("tuning %s ran out of GPU memory; the default kernel runs",
                                _describe(shape, weight, args, precision))
                    return DEFAULT
                self._keep(key, weight.device, choice)
        return choice

    def tune(self, shape: Sequence[int], weight: torch.Tensor, bias: torch.Tensor | None, args: Any,
             precision: str, aligned: bool = True, packs: Any = None, channels_last: bool = False) -> TuneResult:
        """Measure every candidate kernel on random inputs of ``shape`` and cache the fastest (see the module).

        Raises:
            whatever the default kernel raises on this problem (out of memory, a bad argument); a failing
            non-default candidate is only skipped.
        """
        t0 = time.perf_counter()
        ext = load_extension()
        dev = weight.device
        shape = tuple(int(d) for d in shape)
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        with torch.no_grad(), torch.cuda.device(dev):
            gen = torch.Generator(device=dev).manual_seed(0x5EED)
            # Random (never zero) input; when the problem's rows are not 16-byte aligned, neither are these.
            flat = torch.randn(numel + 1, device=dev, generator=gen).to(weight.dtype)
            x = (flat[:numel] if aligned else flat[1:])
            if channels_last:  # the same memory order as the calls' inputs: [N, H, W, C]
                n, c, h, w = shape
                x = x.view(n, h, w, c).permute(0, 3, 1, 2)
            else:
                x = x.view(shape)
            h_out, w_out = out_hw(shape, weight, args)
            # NCHW inputs write into one output; channels-last ones get a new output a call, in the layout the
            # calls get (an NCHW ``out`` would time the gemm kernel writing the other layout).
            out = None if channels_last else torch.empty(
                (shape[0], weight.shape[1] * args.groups, h_out, w_out), dtype=weight.dtype, device=dev)
            timer = Timer(dev)
            last: list[torch.Tensor] = []

            def call(c: KernelChoice) -> str:
                y, ran = forward_cuda(x, weight, bias, args, precision, out=out, force_path=c.path,
                                       force_config=c.config, force_split=c.split, force_staged=c.staged,
                                       force_round=c.rounded, packs=packs)
                last[:] = [y]
                return ran

            acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
            call(DEFAULT)
            ref = last[0].to(acc, copy=True)
            ref_norm = float(ref.norm()) or 1.0
            tol = agree_tolerance(weight.dtype, precision)

            def trial(c: KernelChoice, reps: int, check: bool) -> Trial | None:
                try:
                    ran = call(c)  # warm-up (first launch of a kernel loads its module)
                    if c.path is not None and ran != c.path:
                        return None  # not eligible: the dispatcher fell back, a duplicate of another candidate
                    diff = None
                    if check and c != DEFAULT:
                        diff = float((last[0].to(acc) - ref).norm()) / ref_norm
                        if not diff <= tol:  # also catches NaN
                            log.error("tuning %s: %s disagrees with the default kernel (relative difference "
                                      "%.2e > %.0e); skipped", _describe(shape, weight, args, precision), c.label,
                                      diff, tol)
                            return None
                    ms = timer(lambda: call(c), reps)
                    return Trial(c, ran, ms, diff)
                except torch.cuda.OutOfMemoryError:
                    if c == DEFAULT:
                        raise
                    log.warning("tuning: %s ran out of memory; skipped", c.label)
                except RuntimeError as exc:
                    if c == DEFAULT:
                        raise
                    log.warning("tuning: %s failed (%s); skipped", c.label, exc)
                return None

            first: list[Trial] = []
            for c in candidates(int(ext.num_tensor_core_configs), int(ext.num_gemm_configs),
                                nchw_output=not channels_last,
                                num_narrow_tiled_configs=int(ext.num_narrow_tiled_configs)):
                t = trial(c, FIRST_REPS, check=True)
                if t is not None:
                    first.append(t)
            for c in split_candidates(first, int(ext.num_gather_configs)):
                t = trial(c, FIRST_REPS, check=True)
                if t is not None:
                    first.append(t)
            if precision == "tf32" and weight.dtype == torch.float32:
                for c in rounded_candidates(first, rounded=channels_last):
                    t = trial(c, FIRST_REPS, check=True)
                    if t is not None:
                        first.append(t)
            second = [t for c in second_pass_choices(first)
                      if (t := trial(c, SECOND_REPS, check=False)) is not None]
        choice, ms, default_ms = pick(second)
        result = TuneResult(choice, ms, default_ms, tuple(first + second), time.perf_counter() - t0)
        self.store(self.key(shape, weight, bias is not None, args, precision, aligned, packs is not None,
                            channels_last), choice)
        log.info("tuned %s: %s %.4f ms (default %.4f ms), %d trials in %.2f s",
                 _describe(shape, weight, args, precision), choice.label, ms, default_ms, len(result.trials),
                 result.seconds)
        return result


def _index(device: torch.device) -> int:
    """``device``'s index (the current CUDA device's for "cuda"; 0 for others)."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


def _forget_calls() -> None:
    """Make the extension, if loaded, forget the calls it remembered (kernels/csrc/binding.cpp's call cache)."""
    ext = loaded_extension()
    if ext is not None:
        ext.clear_call_cache()


def _describe(shape: Sequence[int], weight: torch.Tensor, args: Any, precision: str) -> str:
    return (f"{list(shape)} x {list(weight.shape)} {str(weight.dtype).removeprefix('torch.')}/{precision} "
            f"stride {list(args.stride)} padding {list(args.padding)} dilation {list(args.dilation)} "
            f"groups {args.groups}")


TUNER = Tuner(enabled=_env_enabled())


def enable(enabled: bool = True) -> None:
    """Turn measured kernel choice on (or off) for this process."""
    TUNER.enabled = enabled


def enabled() -> bool:
    """Whether measured kernel choice is on."""
    return TUNER.enabled
