"""Where a rank's tensor lies in the full tensor, and which rank writes it.

A rank holds each tensor of the model as a box of the full (unsharded) tensor:

* a tensor split over tp (see :mod:`tensorpar.full`) is the balanced shard
  ``[start, start + length)`` of its split dim, the larger shards first
  (10 rows over 4 ranks: 3, 3, 2, 2 at offsets 0, 3, 6, 8);
* under FSDP2 (``tensorpar.fully_shard_dp``) it is a ``DTensor`` over the dp
  sub-mesh whose global shape is the tp shard, split along dim 0 by
  ``torch.chunk``'s rule (``⌈rows / dp⌉`` each, the last ones shorter or
  empty); the DTensor describes its own chunk (``__create_chunk_list__``),
  in the coordinates of the tp shard.

The two compose: the chunk's offsets plus the tp shard's start along the split
dim give a box of the full tensor, for example::

    full (10, 4) --tp=4--> rows [6, 8) --FSDP2, dp=2--> rows [6, 7) and [7, 8)

A fused projection's tp shard is several pieces of the full tensor laid end to
end (see :meth:`tensorpar.Shard.pieces`): its :class:`Box` lists them, each a
box of its own, and the dp chunk of such a shard keeps its overlap with each.

A box held by several ranks (a replicated tensor; a tp shard on every dp
replica; a fused projection's replicated tail) is written by exactly one of them, chosen from a hash of its name so
that the writing is spread over the ranks (:func:`writes`). DCP would dedup
such boxes itself, but in the coordinator's global plan, which travels between
ranks as pickled objects (and needs numpy); every rank can tell on its own
which boxes fall to it, so each plans alone and no plan travels.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from ..full import is_dtensor
from ..mesh import Mesh, group_rank_size
from ..sharding import Shard


@dataclass(frozen=True)
class Box:
    """A box of a full tensor of size ``size``: ``sizes`` elements from ``offsets`` in each dim.

    A local tensor made of several boxes of the full tensor laid end to end along ``dim`` has
    ``pieces``: ``(start in the local tensor, start in the full tensor, length, held by every tp
    rank)`` of each along ``dim`` (``offsets[dim]`` is then the first one's).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    size: tuple[int, ...]
    dim: int = 0
    pieces: tuple[tuple[int, int, int, bool], ...] = ()

    @property
    def empty(self) -> bool:
        """Whether the box holds nothing of a tensor that has elements (an empty FSDP2 chunk)."""
        return 0 in self.sizes and 0 not in self.size

    def parts(self) -> list[tuple[int, Box, bool]]:
        """``(start along dim in the local tensor, the single box, whether every tp rank holds it)`` of
        each part of the local tensor: the box itself, or one per piece."""
        if not self.pieces:
            return [(0, self, False)]
        d = self.dim
        return [(local, Box((*self.offsets[:d], full, *self.offsets[d + 1:]), (*self.sizes[:d], n, *self.sizes[d + 1:]),
                            self.size), shared) for local, full, n, shared in self.pieces]


def locate(value: torch.Tensor, placement: Shard | None, group: ProcessGroup | None) -> tuple[torch.Tensor, Box, bool]:
    """``(local tensor, its box in the full tensor, whether it is split over dp)`` for ``value``, a plain
    tensor or an FSDP2 ``DTensor``, whose tp placement is ``placement`` over ``group`` (None: replicated)."""
    if is_dtensor(value):
        local = value.to_local()
        (chunk,) = value.__create_chunk_list__()  # this rank's chunk of the tp shard
        offsets, split = list(chunk.offsets), any(p.is_shard() for p in value.placements)
        assert tuple(chunk.sizes) == tuple(local.shape), (chunk, local.shape)
    else:
        local, offsets, split = value, [0] * value.dim(), False
    full = list(value.shape)  # the tp shard's shape (a DTensor's global shape)
    if placement is None or group is None:
        return local, Box(tuple(offsets), tuple(local.shape), tuple(full)), split
    rank, n = group_rank_size(group)
    dim = placement.dim % value.dim()
    lo, hi = offsets[dim], offsets[dim] + local.shape[dim]  # the chunk's rows of the tp shard
    pieces: list[tuple[int, int, int, bool]] = []
    at = 0  # where each piece starts in the tp shard
    everyone = set(placement.pieces(n, 0)).intersection(*(placement.pieces(n, r) for r in range(1, n)))
    for start, length in placement.pieces(n, rank):
        a, b = max(lo, at), min(hi, at + length)  # the piece's overlap with this rank's chunk
        shared = (start, length) in everyone and n > 1
        if pieces and a < b and pieces[-1][1] + pieces[-1][2] == start + a - at and pieces[-1][3] == shared:
            pieces[-1] = (*pieces[-1][:2], pieces[-1][2] + b - a, shared)  # runs on from the last one: one box
        elif a < b or (not pieces and a == b == lo):
            pieces.append((a - lo, start + a - at, b - a, shared))
        at += length
    assert at == full[dim], (full, placement, n, rank)
    pieces = [p for p in pieces if p[2]] or pieces[:1]  # a chunk that starts where a piece ends holds none of it
    full[dim] = placement.size
    offsets[dim] = pieces[0][1]
    box = Box(tuple(offsets), tuple(local.shape), tuple(full), dim,
              tuple(pieces) if len(pieces) > 1 or pieces[0][3] else ())
    return local, box, split


def written(box: Box, name: str, *, tp_split: bool, dp_split: bool, mesh: Mesh) -> Box | None:
    """The part of ``box`` that this rank writes for tensor ``name`` (see :func:`writes`), or None: a piece
    held by every tp rank (a fused projection's replicated tail) is written by one of them."""
    if box.empty:
        return None
    if not box.pieces:
        return box if writes(name, tp_split=tp_split, dp_split=dp_split, mesh=mesh) else None
    # the replicated tail (whatever dp chunks it falls in) is written by one tp rank, chosen by its own name
    kept = tuple(p for p in box.pieces if writes(f"{name}@replicated" if p[3] else name,
                                                 tp_split=tp_split and not p[3], dp_split=dp_split, mesh=mesh))
    return Box(box.offsets, box.sizes, box.size, box.dim, kept) if kept else None


def writes(name: str, *, tp_split: bool, dp_split: bool, mesh: Mesh) -> bool:
    """Whether this rank writes tensor ``name``, held alike by every rank along the mesh dimensions it
    is not split over (tp unless ``tp_split``, dp unless ``dp_split``): exactly one of them does."""
    h = zlib.crc32(name.encode())
    return (tp_split or mesh.tp_rank == h % mesh.tp) and (dp_split or mesh.dp_rank == (h // mesh.tp) % mesh.dp)
