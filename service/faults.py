"""Fault injection for reliability tests: ``DECONV_FAULTS``, honoured only with ``DECONV_TEST_MODE=1``.

The worker calls two hooks on its own thread: ``before_batch`` when it starts executing a batch and
``before_forward`` before every kernel call (a batch split after an out-of-memory error makes several).
Faults are armed only once the service is ready, so that the start-up self-tests pass; ``startup`` is the exception:
an HTTP process calls ``hold_startup`` while it starts.

Syntax: faults separated by ``,``, each ``KIND`` followed by ``:key=value`` options::

    DECONV_FAULTS="error:layer=demo:times=1,oom:above=2,delay:ms=20"

| kind | hook | what it does |
| --- | --- | --- |
| ``error`` | batch | the kernel raises ``RuntimeError`` (the batch's requests get 500) |
| ``oom`` | kernel call | CUDA out of memory for kernel calls of more than ``above`` samples (default 0: all) |
| ``exit`` | batch | the worker thread dies (an exception no handler catches leaves its loop) |
| ``hang`` | batch | the worker thread blocks (ending at shutdown), as in a kernel that never returns |
| ``delay`` | kernel call | the kernel call takes ``ms`` milliseconds longer |
| ``hold`` | batch | the batch waits until the service begins draining (SIGTERM), then runs |
| ``startup`` | start-up | an HTTP process of a multi-process server, once connected to the engine, holds its start-up |
|  |  | inside prometheus-client's metrics lock (where creating its metrics stands) until a SIGTERM reaches it |

Options: ``layer=NAME`` (only that layer's batches), ``every=N`` (every N-th matching call, default 1),
``times=N`` (at most N times in all, default unlimited), ``after=N`` (the first N matching calls pass). Nothing
here imports FastAPI.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("deconv.service")

KINDS = ("error", "oom", "exit", "hang", "delay", "hold", "startup")
_OPTIONS = {"layer", "every", "times", "above", "ms", "after"}


class WorkerCrash(BaseException):
    """Raised by the ``exit`` fault: derives from BaseException so that it escapes every ``except Exception``."""


@dataclass
class Fault:
    """One injected fault and how often it has fired."""

    kind: str
    layer: str | None = None
    every: int = 1
    times: int | None = None
    above: int = 0
    ms: float = 0.0
    after: int = 0
    calls: int = 0
    fired: int = 0

    def describe(self) -> str:
        """The fault as written in ``DECONV_FAULTS`` (defaults left out)."""
        parts = [self.kind]
        if self.layer is not None:
            parts.append(f"layer={self.layer}")
        if self.every != 1:
            parts.append(f"every={self.every}")
        if self.times is not None:
            parts.append(f"times={self.times}")
        if self.after:
            parts.append(f"after={self.after}")
        if self.kind == "oom":
            parts.append(f"above={self.above}")
        if self.kind == "delay":
            parts.append(f"ms={self.ms:g}")
        return ":".join(parts)


def parse(spec: str) -> list[Fault]:
    """Parse ``DECONV_FAULTS``.

    Raises:
        ValueError: an unknown kind or option, or a value that is not a non-negative number.
    """
    faults = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        kind, *options = item.split(":")
        kind = kind.strip().lower()
        if kind not in KINDS:
            raise ValueError(f"fault {item!r}: unknown kind {kind!r} (one of {', '.join(KINDS)})")
        fault = Fault(kind)
        for option in options:
            key, sep, value = (s.strip() for s in option.partition("="))
            if not sep or key not in _OPTIONS:
                raise ValueError(f"fault {item!r}: unknown option {option!r} "
                                 f"(layer=, every=, times=, above=, ms=, after=)")
            if key == "layer":
                fault.layer = value
                continue
            try:
                number = float(value) if key == "ms" else int(value)
            except ValueError:
                raise ValueError(f"fault {item!r}: {key} must be a number, got {value!r}") from None
            if number < 0 or (key == "every" and number < 1):
                raise ValueError(f"fault {item!r}: {key} must be {'positive' if key == 'every' else 'non-negative'}")
            setattr(fault, key, number)
        faults.append(fault)
    return faults


@dataclass
class Faults:
    """The parsed faults of one service; the worker threads call the hooks."""

    faults: list[Fault] = field(default_factory=list)
    armed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _released: threading.Event = field(default_factory=threading.Event, repr=False)
    _draining: threading.Event = field(default_factory=threading.Event, repr=False)

    @classmethod
    def from_spec(cls, spec: str) -> Faults:
        """Faults from ``DECONV_FAULTS`` (empty: none)."""
        return cls(parse(spec))

    def __bool__(self) -> bool:
        return bool(self.faults)

    def describe(self) -> str:
        """Every fault, as in ``DECONV_FAULTS``."""
        return ",".join(f.describe() for f in self.faults)

    def arm(self) -> None:
        """Start injecting (the service calls this once it is ready)."""
        if self.faults and not self.armed:
            self.armed = True
            log.critical("FAULT INJECTION ARMED (test mode): %s", self.describe())

    def release(self) -> None:
        """Let threads blocked by ``hang`` or ``hold`` go (at shutdown)."""
        self._released.set()
        self._draining.set()

    def begin_drain(self) -> None:
        """Let batches held by ``hold`` run (the service began draining)."""
        self._draining.set()

    def _firing(self, kinds: tuple[str, ...], layer: str, samples: int) -> list[Fault]:
        if not self.armed:
            return []
        firing = []
        with self._lock:
            for f in self.faults:
                if f.kind not in kinds or (f.layer is not None and f.layer != layer):
                    continue
                if f.kind == "oom" and samples <= f.above:
                    continue
                if f.times is not None and f.fired >= f.times:
                    continue
                f.calls += 1
                if f.calls > f.after and (f.calls - f.after) % f.every == 0:
                    f.fired += 1
                    firing.append(f)
        return firing

    def hold_startup(self, lock: AbstractContextManager[Any] | None) -> None:
        """Hook in an HTTP process's start-up, on its event loop, once it is connected to the engine: ``startup``
        holds it there, with ``lock`` (prometheus-client's, ``service.metrics.update_lock``) held, until the process
        receives SIGTERM and its handler has returned. A SIGTERM thus always interrupts a metric update of
        a starting process, as it can by chance when the process creates its metrics."""
        if lock is None or not any(f.kind == "startup" for f in self.faults):
            return
        received: list[int] = []
        handler = signal.getsignal(signal.SIGTERM)

        def on_signal(sig: int, frame: Any) -> None:
            received.append(sig)
            if callable(handler):
                handler(sig, frame)

        signal.signal(signal.SIGTERM, on_signal)
        try:
            with lock:
                log.critical("fault injected: start-up held until SIGTERM (test mode)")
                while not received:  # the signal interrupts the sleep; its handler runs here, lock held
                    time.sleep(0.01)
        finally:
            signal.signal(signal.SIGTERM, handler)
        log.warning("fault released: start-up goes on after SIGTERM")

    def before_batch(self, layer: str, samples: int) -> None:
        """Hook at the start of a batch (worker thread): ``error``, ``exit``, ``hang``, ``hold``."""
        for f in self._firing(("error", "exit", "hang", "hold"), layer, samples):
            log.warning("fault injected: %s on a batch of %d sample(s) of layer %s", f.kind, samples, layer)
            if f.kind == "hold":
                self._draining.wait()
                continue
            if f.kind == "error":
                raise RuntimeError("injected kernel failure (DECONV_FAULTS)")
            if f.kind == "exit":
                raise WorkerCrash("injected worker thread death (DECONV_FAULTS)")
            self._released.wait()
            raise WorkerCrash("hung worker thread released at shutdown (DECONV_FAULTS)")

    def before_forward(self, layer: str, samples: int) -> None:
        """Hook before each kernel call (worker thread): ``oom``, ``delay``."""
        for f in self._firing(("oom", "delay"), layer, samples):
            if f.kind == "delay":
                time.sleep(f.ms / 1000)
                continue
            log.warning("fault injected: out of memory for %d sample(s) of layer %s", samples, layer)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected by DECONV_FAULTS)")
