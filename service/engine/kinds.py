"""The kinds of request a batch can hold, and the one type that covers them all.

A request's input reaches the engine as one of: a torch tensor, a ``RawTensor`` (its bytes as they arrived), a
``SlotTensor`` (a ``RawTensor`` in a slot of an HTTP process's arena, with its output's place there too), or a
``CudaJob`` (its tensors in shared memory the engine maps). ``Request`` is that union. The batcher sorts each
request into a ``Kind`` once, when it is queued (``kind_of``), batches requests in shared memory the engine maps
only with each other (its lanes), and hands each batch to a worker with its kind (``batch_kind``); the worker runs
the path it chose for that kind when it was made (``service.engine.paths``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from service.codec import AnyTensor, CudaJob, DeviceTensor, SlotTensor
from service.errors import ServiceError

Request = AnyTensor | CudaJob
"""A request's input as the engine carries it: a host tensor (torch, raw bytes, or a slot), or a ``CudaJob``."""

Output = AnyTensor | DeviceTensor | ServiceError
"""A request's answer from a worker: its output (host tensor, or where in shared memory it was written), or the error
of that request alone."""


class Kind(enum.Enum):
    """Which path a batch takes on a worker (``service.engine.paths``)."""

    HOST = "host"  # inputs in host memory: staged (GPU) or computed as they are (CPU); outputs split per request
    SLOTS = "slots"  # every input in a page-locked slot: on a GPU, between the slots and the GPU in one call
    REGIONS = "regions"  # every input a CudaJob: read and written where it lies, on that GPU's worker


def kind_of(x: Request) -> Kind:
    """The kind of one request (the batcher asks once, when it is queued)."""
    if isinstance(x, CudaJob):
        return Kind.REGIONS
    if type(x) is SlotTensor and x.pinned:
        return Kind.SLOTS
    return Kind.HOST


def batch_kind(kinds: Iterable[Kind]) -> Kind:
    """The kind of a batch of requests of these kinds: theirs when they agree, else ``HOST`` (a batch that mixes
    page-locked slots with other host memory is staged). Requests in shared memory the engine maps are never batched
    with others (the batcher's lanes)."""
    first: Kind | None = None
    for k in kinds:
        if first is None:
            first = k
        elif k is not first:
            return Kind.HOST
    return first or Kind.HOST
