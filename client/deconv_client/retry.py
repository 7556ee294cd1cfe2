"""Retry settings: exponential backoff with full jitter for 429, 503 and connection errors.

A retried request waits ``uniform(0, min(backoff_max, backoff_base * 2**(n - 1)))`` seconds before its n-th retry
("full jitter"). When the server sent ``Retry-After`` that many seconds are added in front of the jittered wait,
so clients told the same ``Retry-After`` do not all come back in the same instant; a ``Retry-After`` longer than
``max_retry_after`` is not waited for: the error is raised at once. A per-call deadline also cuts retries short:
no wait ever ends after it.

4xx statuses other than 429 are never retried: sending the same request again cannot fix it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import httpx

__all__ = ["Retry"]

# Connection-level failures worth another try. Read/write *timeouts* are left out on purpose: the server may
# still be computing the first attempt, and a second one would only add to its load.
_RETRYABLE_TRANSPORT_ERRORS: tuple[type[httpx.TransportError], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)


@dataclass(frozen=True)
class Retry:
    """How a client retries: pass one as ``retry=`` to :class:`~deconv_client.Client` (``retry=False`` turns
    retries off, as does ``Retry(max_attempts=1)`` or :meth:`Retry.disabled`).

    Attributes:
        max_attempts: attempts in all, the first one included (1: never retry).
        backoff_base: the cap of the first retry's jittered wait, in seconds; it doubles with every retry.
        backoff_max: the largest cap of a jittered wait, in seconds.
        statuses: the HTTP statuses that are retried; only 429 and 5xx are allowed.
        connection_errors: retry when the connection fails (refused, reset, closed early, connect timeout).
        respect_retry_after: wait at least the server's ``Retry-After`` before retrying.
        max_retry_after: give up at once when the server asks for a longer wait than this, in seconds.
    """

    max_attempts: int = 4
    backoff_base: float = 0.1
    backoff_max: float = 5.0
    statuses: frozenset[int] = field(default_factory=lambda: frozenset({429, 503}))
    connection_errors: bool = True
    respect_retry_after: bool = True
    max_retry_after: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.backoff_base < 0 or self.backoff_max < 0 or self.max_retry_after < 0:
            raise ValueError("backoff_base, backoff_max and max_retry_after must not be negative")
        object.__setattr__(self, "statuses", frozenset(self.statuses))
        bad = sorted(s for s in self.statuses if not (s == 429 or 500 <= s < 600))
        if bad:
            raise ValueError(f"only 429 and 5xx statuses may be retried, not {bad}")

    @classmethod
    def disabled(cls) -> Retry:
        """Settings that never retry."""
        return cls(max_attempts=1)

    def backoff(self, retry_number: int, rng: random.Random | None = None) -> float:
        """The jittered wait before retry number ``retry_number`` (1 for the first retry), in seconds."""
        cap = min(self.backoff_max, self.backoff_base * 2 ** max(0, retry_number - 1))
        return (rng or random).uniform(0.0, cap)

    def delay(
        self,
        retry_number: int,
        *,
        status: int | None = None,
        exc: BaseException | None = None,
        retry_after: float | None = None,
        rng: random.Random | None = None,
    ) -> float | None:
        """Seconds to wait before retry ``retry_number``, or ``None`` when the failure must not be retried.

        Pass the failed attempt's ``status`` (with its ``Retry-After`` in seconds), or the ``exc`` that ended
        it. ``retry_number`` counts retries, so retry ``max_attempts`` would be one attempt too many.
        """
        if retry_number >= self.max_attempts:
            return None
        if status is not None:
            if status not in self.statuses:
                return None
        elif exc is None or not (self.connection_errors and isinstance(exc, _RETRYABLE_TRANSPORT_ERRORS)):
            return None
        wait = self.backoff(retry_number, rng)
        if retry_after is not None and self.respect_retry_after:
            if retry_after > self.max_retry_after:
                return None
            wait += retry_after
        return wait
