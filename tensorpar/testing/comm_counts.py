"""Collective accounting on torch's ``CommDebugMode`` (which counts c10d's ops and functional collectives,
eager or compiled: ``get_comm_counts()``), also keeping each call's payload and whether autograd's
backward issued it, for tests and benchmarks that check Megatron's counts and bytes.

Example::

    with count_collectives() as counts:
        mlp(x).sum().backward()
    counts.count("all_reduce", phase="backward")  # 1 at tp > 1: f
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor.debug import CommDebugMode


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective: ``numel`` is its payload as it travels (all-reduce and broadcast: the tensor;
    all-gather: the gathered result; reduce-scatter: the input; uneven shards padded to the largest),
    ``phase`` ``"backward"`` when autograd's backward issued it, else ``"forward"``."""

    op: str
    dtype: torch.dtype
    numel: int
    group_size: int
    phase: str = "forward"

    @property
    def bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def traffic(self) -> float:
        """Bytes each rank sends with a bandwidth-optimal (ring) algorithm: ``2 (n-1)/n`` of the payload
        for an all-reduce, ``(n-1)/n`` for an all-gather, a reduce-scatter or a broadcast."""
        n = self.group_size
        return self.bytes * (n - 1) / n * (2 if self.op == "all_reduce" else 1)


def _size(group: Any) -> int:
    """The size of a group as an op receives it: a functional collective's name, c10d's script object."""
    pg = ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else _resolve_process_group(group)
    return pg.size()


_c10d, _functional = torch.ops.c10d, torch.ops._c10d_functional
#: for each collective op: its name here, and (dtype, payload elements, group size) from its arguments
_PAYLOADS: Mapping[Any, tuple[str, Callable[..., tuple[torch.dtype, int, int]]]] = MappingProxyType({
    _functional.all_reduce: ("all_reduce", lambda x, op, g: (x.dtype, x.numel(), _size(g))),
    _functional.all_gather_into_tensor: ("all_gather", lambda x, n, g: (x.dtype, x.numel() * n, n)),
    _functional.reduce_scatter_tensor: ("reduce_scatter", lambda x, op, n, g: (x.dtype, x.numel(), n)),
    _functional.broadcast: ("broadcast", lambda x, src, g: (x.dtype, x.numel(), _size(g))),
    _c10d.allreduce_: ("all_reduce", lambda xs, pg, *_: (xs[0].dtype, xs[0].numel(), _size(pg))),
    _c10d._allgather_base_: ("all_gather", lambda out, x, pg, *_: (out.dtype, out.numel(), _size(pg))),
    _c10d._reduce_scatter_base_: ("reduce_scatter", lambda out, x, pg, *_: (x.dtype, x.numel(), _size(pg))),
    _c10d.broadcast_: ("broadcast", lambda xs, pg, *_: (xs[0].dtype, xs[0].numel(), _size(pg))),
})


class CollectiveLog(CommDebugMode):
    """``CommDebugMode`` that also keeps a :class:`CollectiveRecord` of each collective it sees (``with
    CollectiveLog() as log:`` counts the collectives issued inside the block, on this thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CollectiveRecord] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        known = _PAYLOADS.get(getattr(func, "_overloadpacket", None))
        if known is not None:
            name, payload = known
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            self.records.append(CollectiveRecord(name, *payload(*args, *(kwargs or {}).values()), phase))
        return out

    def select(self, op: str | None = None, phase: str | None = None) -> list[CollectiveRecord]:
        return [r for r in self.records if op in (None, r.op) and phase in (None, r.phase)]

    def count(self, op: str | None = None, phase: str | None = None) -> int:
        return len(self.select(op, phase))

    def numel(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(r.numel for r in self.select(op, phase))

    def bytes(self, op: str | None = None, phase: str | None = None) -> int:
        return sum(r.bytes for r in self.select(op, phase))

    def traffic(self, op: str | None = None, phase: str | None = None) -> float:
        """Bytes each rank sends (see :meth:`CollectiveRecord.traffic`)."""
        return sum(r.traffic() for r in self.select(op, phase))

    def summary(self) -> collections.Counter[tuple[str, str, torch.dtype, int]]:
        """How many times each ``(phase, op, dtype, numel)`` occurred."""
        return collections.Counter((r.phase, r.op, r.dtype, r.numel) for r in self.records)


count_collectives = CollectiveLog  #: ``with count_collectives() as counts:`` (see the module's docstring)
