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
    all-gather: the gathered result; reduce-scatter: the input), padding excluded."""

    op: str
    dtype: torch.dtype
    numel: int
    group_size: int

    @property
    def bytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class CollectiveCounter:
    """Records every collective issued while it is active.

    A collective issued in backward is attributed to the counters that were
    active when the matching forward ran, so ``loss.backward()`` may run inside
    or outside the ``with`` block.

    Example::

        with tensorpar.count_collectives() as counts:
            mlp(x).sum().backward()
        counts.count("all_reduce")   # 2 at tp > 1: g in forward, f in backward
    """

    records: list[CollectiveRecord] = field(default_factory=list)

    def count(self, op: str | None = None) -> int:
        return sum(1 for r in self.records if op is None or r.op == op)

    def numel(self, op: str | None = None) -> int:
        return sum(r.numel for r in self.records if op is None or r.op == op)

    def bytes(self, op: str | None = None) -> int:
        return sum(r.bytes for r in self.records if op is None or r.op == op)

    def summary(self) -> collections.Counter[tuple[str, torch.dtype, int]]:
        """How many times each ``(op, dtype, numel)`` occurred."""
        return collections.Counter((r.op, r.dtype, r.numel) for r in self.records)


_active: contextvars.ContextVar[tuple[CollectiveCounter, ...]] = contextvars.ContextVar(
    "tensorpar_collective_counters", default=()
)


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounter]:
    """Count the collectives issued inside the block (nesting is allowed)."""
    counter = CollectiveCounter()
    token = _active.set(_active.get() + (counter,))
    try:
        yield counter
    finally:
        _active.reset(token)


def active_counters() -> tuple[CollectiveCounter, ...]:
    return _active.get()


def record(counters: tuple[CollectiveCounter, ...], op: str, dtype: torch.dtype, numel: int,
           group_size: int) -> None:
    for counter in counters:
        counter.records.append(CollectiveRecord(op, dtype, numel, group_size))
