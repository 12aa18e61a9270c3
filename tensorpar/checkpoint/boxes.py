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

A box held by several ranks (a replicated tensor; a tp shard on every dp
replica) is written by exactly one of them, chosen from a hash of its name so
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
from torch.distributed.tensor import DTensor

from ..mesh import Mesh, group_rank_size
from ..sharding import Shard


@dataclass(frozen=True)
class Box:
    """A box of a full tensor of size ``size``: ``sizes`` elements from ``offsets`` in each dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    size: tuple[int, ...]

    @property
    def empty(self) -> bool:
        """Whether the box holds nothing of a tensor that has elements (an empty FSDP2 chunk)."""
        return 0 in self.sizes and 0 not in self.size


def locate(value: torch.Tensor, placement: Shard | None, group: ProcessGroup | None) -> tuple[torch.Tensor, Box, bool]:
    """``(local tensor, its box in the full tensor, whether it is split over dp)`` for ``value``, a plain
    tensor or an FSDP2 ``DTensor``, whose tp placement is ``placement`` over ``group`` (None: replicated)."""
    if isinstance(value, DTensor):
        local = value.to_local()
        (chunk,) = value.__create_chunk_list__()  # this rank's chunk of the tp shard
        offsets, split = list(chunk.offsets), any(p.is_shard() for p in value.placements)
        assert tuple(chunk.sizes) == tuple(local.shape), (chunk, local.shape)
    else:
        local, offsets, split = value, [0] * value.dim(), False
    full = list(value.shape)  # the tp shard's shape (a DTensor's global shape)
    if placement is not None and group is not None:
        if placement.blocks > 1:  # a piece of each block: several boxes, which one Box cannot describe
            raise ValueError(f"a tensor split in {placement.blocks} blocks along dim {placement.dim} (a fused "
                             "projection) is no single box of the full tensor: distributed checkpoints cannot "
                             "store it; save tensorpar.full_state_dict(model) instead")
        rank, n = group_rank_size(group)
        start, length = placement.bounds(n, rank)
        assert full[placement.dim] == length, (full, placement, n, rank)
        offsets[placement.dim] += start
        full[placement.dim] = placement.size
    return local, Box(tuple(offsets), tuple(local.shape), tuple(full)), split


def writes(name: str, *, tp_split: bool, dp_split: bool, mesh: Mesh) -> bool:
    """Whether this rank writes tensor ``name``, held alike by every rank along the mesh dimensions it
    is not split over (tp unless ``tp_split``, dp unless ``dp_split``): exactly one of them does."""
    h = zlib.crc32(name.encode())
    return (tp_split or mesh.tp_rank == h % mesh.tp) and (dp_split or mesh.dp_rank == (h // mesh.tp) % mesh.dp)
