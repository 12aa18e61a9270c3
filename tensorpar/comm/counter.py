"""Collective accounting: which collectives ran, on what dtype, over how many elements."""

from __future__ import annotations

import collections
import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective: ``numel`` is the logical payload (all-reduce: the tensor;
    all-gather: the gathered result; reduce-scatter: the input), padding excluded;
    ``padding`` the elements uneven shards were padded with on their way (gloo
    moves equal shards); ``phase`` is ``"backward"`` when autograd issued it,
    else ``"forward"``."""

    op: str
    dtype: torch.dtype
    numel: int
    group_size: int
    phase: str = "forward"
    padding: int = 0

    @property
    def bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def traffic(self, padded: bool = False) -> float:
        """Bytes each rank sends with a bandwidth-optimal (ring) algorithm: ``2 (n-1)/n`` of the payload
        for an all-reduce, ``(n-1)/n`` for an all-gather or a reduce-scatter (one all-reduce moves what
        a reduce-scatter and an all-gather move together), ``(n-1)/n`` for a broadcast.
        ``padded=True`` counts the padding too."""
        n = self.group_size
        payload = (self.numel + (self.padding if padded else 0)) * self.dtype.itemsize
        return payload * (n - 1) / n * (2 if self.op == "all_reduce" else 1)


@dataclass
class CollectiveCounter:
    """Records every collective issued while it is active.

    A collective issued in backward is recorded by the counters active when
    the matching forward ran and by those active when backward runs, so
    ``loss.backward()`` may run inside or outside the ``with`` block (autograd
    may run backward on another thread, where the block is not visible).

    Example::

        with tensorpar.count_collectives() as counts:
            mlp(x).sum().backward()
        counts.count("all_reduce", phase="forward")   # 1 at tp > 1: g
        counts.count("all_reduce", phase="backward")  # 1 at tp > 1: f
    """

    records: list[CollectiveRecord] = field(default_factory=list)

    def select(self, op: str | None = None, phase: str | None = None) -> list[CollectiveRecord]:
        return [r for r in self.records if op in (None, r.op) and phase in (None, r.phase)]

    def count(self, op: str | None = None, phase: str | None = None) -> int:
        return len(self.select(op, phase))

    def numel(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(r.numel for r in self.select(op, phase))

    def bytes(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(r.bytes for r in self.select(op, phase))

    def traffic(self, op: str | None = None, phase: str | None = None, *, padded: bool = False) -> float:
        """Bytes each rank sends (see :meth:`CollectiveRecord.traffic`)."""
        return sum(r.traffic(padded) for r in self.select(op, phase))

    def summary(self) -> collections.Counter[tuple[str, str, torch.dtype, int]]:
        """How many times each ``(phase, op, dtype, numel)`` occurred."""
        return collections.Counter((r.phase, r.op, r.dtype, r.numel) for r in self.records)


_active: contextvars.ContextVar[tuple[CollectiveCounter, ...]] = contextvars.ContextVar(
    "tensorpar_collective_counters", default=()
)


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounter]:
    """Count the collectives issued inside the block (nesting is allowed)."""
    counter = CollectiveCounter()
    token = _active.set((*_active.get(), counter))
    try:
        yield counter
    finally:
        _active.reset(token)


def active_counters() -> tuple[CollectiveCounter, ...]:
    """The counters of the enclosing ``count_collectives`` blocks; none inside a ``torch.compile``
    graph (counting happens in eager mode; ``CommDebugMode`` counts compiled collectives)."""
    return () if torch.compiler.is_compiling() else _active.get()


def record(op: str, dtype: torch.dtype, numel: int, group_size: int,
           forward_counters: tuple[CollectiveCounter, ...] | None = None, padding: int = 0) -> None:
    """Record a collective with the active counters; ``forward_counters`` marks it as
    backward work and adds the counters that were active in the matching forward."""
    counters = active_counters()
    phase = "forward"
    if forward_counters is not None:
        phase = "backward"
        counters = forward_counters + tuple(c for c in counters if not any(c is f for f in forward_counters))
    for counter in counters:
        counter.records.append(CollectiveRecord(op, dtype, numel, group_size, phase, padding))
