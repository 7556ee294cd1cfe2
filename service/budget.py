"""The bound on bytes of inference requests in flight (``DECONV_MAX_INFLIGHT_BYTES``).

Each HTTP process holds a ``Budget``: a request takes from it the bytes it declares before its body is read (its
Content-Length, or each chunk as it comes when it declares none), then its decompressed body and its output, and
gives everything back once its answer is written (what one request holds: its ``Held``). A request that does not
fit is answered 429 with Retry-After before anything is allocated for it, so that however many clients send large
bodies at once, the memory held for requests stays bounded. Nothing here waits: the event loop is the only thread
that takes and gives.
"""

from __future__ import annotations

from service.errors import OverloadedError
from service.metrics import Metrics


class Budget:
    """Bytes in flight in this process, at most ``limit``."""

    def __init__(self, limit: int, metrics: Metrics) -> None:
        self.limit = limit
        self.used = 0
        self._gauge = metrics.inflight_bytes
        self._refused = metrics.inflight_refused
        self._limit_gauge = metrics.inflight_limit

    def publish(self) -> None:
        """Show the limit in the metrics (each process that serves HTTP, when its app starts)."""
        self._limit_gauge.set(self.limit)

    def take(self, n: int) -> None:
        """Hold ``n`` more bytes.

        Raises:
            OverloadedError: they would exceed the limit (429, Retry-After 1 s); nothing is held then.
        """
        if n <= 0:
            return
        if self.used + n > self.limit:
            self._refused.inc()
            raise OverloadedError(f"the server holds {self.used} bytes of requests in flight; {n} more would exceed "
                                  f"its limit of {self.limit}; retry later", retry_after_s=1.0)
        self.used += n
        self._gauge.set(self.used)

    def give(self, n: int) -> None:
        """Give back ``n`` bytes taken earlier."""
        if n > 0:
            self.used -= n
            self._gauge.set(self.used)


class Held:
    """The bytes one request holds of a ``Budget``: taken as it needs them (``take``, 429 when they do not fit), all
    given back when it ends (``release``): an HTTP request's once its answer is written (``service.http.asgi``), a
    gRPC call's when its handler returns (the context it runs in)."""

    __slots__ = ("budget", "held")

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.held = 0

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()

    def take(self, n: int) -> None:
        """Hold ``n`` more bytes (``Budget.take``)."""
        self.budget.take(n)
        self.held += n

    def release(self) -> None:
        """Give back every byte held."""
        if self.held:
            self.budget.give(self.held)
            self.held = 0
