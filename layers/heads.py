"""Which attention heads a tp rank computes, and which key/value heads they read (grouped-query attention).

With ``g = n_head / n_kv_head`` query heads per KV head (query head ``i`` reads
KV head ``i // g``), the heads are split in one of two ways:

* ``n_kv_head >= tp``: by whole query *groups*, a KV head and its ``g`` query
  heads together, balanced over the ranks. A rank holds K and V of its own
  groups only, and its query heads read them in groups of ``g``.
* ``n_kv_head < tp`` (multi-query attention at tp > 1, say): the query heads are
  split alone, balanced, and every rank holds all of K and V. A rank's query
  heads ``[lo, hi)`` read KV heads ``lo // g`` to ``(hi - 1) // g``; where its
  first query head falls inside a group, they read them unevenly (query heads
  1-3 of groups of 2 read KV heads 0, 1, 1).

:class:`~layers.attention.ParallelSelfAttention` and
:func:`~layers.hf_parallel.parallelize_hf` both split their heads by
:func:`head_layout`.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from tensorpar.checks import check_int
from tensorpar.sharding import partition_bounds


@dataclass(frozen=True)
class HeadLayout:
    """One rank's heads: global query heads ``query``, the KV heads whose K and V rows it holds
    (``kv_held``: all of them when ``kv_replicated``, fewer KV heads than ranks; else its own groups'),
    and for each of its query heads, in order, the global KV head it reads (``kv_read``)."""

    query: range
    kv_held: range
    kv_read: tuple[int, ...]
    kv_replicated: bool

    @property
    def kv_reads(self) -> range:
        """The KV heads this rank's query heads read (consecutive)."""
        return range(self.kv_read[0], self.kv_read[-1] + 1)

    @property
    def group_size(self) -> int | None:
        """How many consecutive local query heads read each KV head of :attr:`kv_reads`, when that number
        is the same for all of them (SDPA's ``enable_gqa`` and Hugging Face's ``repeat_kv`` then pair them
        up); ``None`` when the local query heads read their KV heads unevenly."""
        readers = set(collections.Counter(self.kv_read).values())
        return readers.pop() if len(readers) == 1 else None


def head_layout(n_head: int, n_kv_head: int, tp: int, rank: int) -> HeadLayout:
    """The heads of rank ``rank`` of ``tp`` for ``n_head`` query heads reading ``n_kv_head`` KV heads.

    Example::

        >>> head_layout(6, 2, 4, 1)  # query heads 2, 3 of groups of 3: K and V held whole
        HeadLayout(query=range(2, 4), kv_held=range(0, 2), kv_read=(0, 1), kv_replicated=True)
        >>> head_layout(8, 4, 3, 0)  # 4 groups of 2 over 3 ranks: groups 0 and 1 on rank 0
        HeadLayout(query=range(0, 4), kv_held=range(0, 2), kv_read=(0, 0, 1, 1), kv_replicated=False)
    """
    for name, value in (("n_head", n_head), ("n_kv_head", n_kv_head), ("tp", tp)):
        check_int(value, name)
    if n_head % n_kv_head:
        raise ValueError(f"n_head ({n_head}) is not divisible by n_kv_head ({n_kv_head})")
    g = n_head // n_kv_head
    if n_kv_head >= tp:  # whole query groups per rank
        kv_lo, kv_count = partition_bounds(n_kv_head, tp, rank, name="n_kv_head")
        query, kv_held = range(g * kv_lo, g * (kv_lo + kv_count)), range(kv_lo, kv_lo + kv_count)
    else:  # query heads alone; every rank holds every KV head
        lo, count = partition_bounds(n_head, tp, rank, name="n_head")
        query, kv_held = range(lo, lo + count), range(n_kv_head)
    return HeadLayout(query=query, kv_held=kv_held, kv_read=tuple(q // g for q in query),
                      kv_replicated=n_kv_head < tp)
