"""Where a rank's tensor lies in the full tensor, stated to DCP as a :class:`Box` (tensorpar's tp shards are
balanced, not ``torch.chunk``'s, chunked again over dp by FSDP2, and a fused projection's shard is several pieces
of the full tensor). The planners write and read plain local tensors by their boxes; DCP reshards."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..full import is_dtensor
from ..mesh import group_rank_size
from ..sharding import Shard


@dataclass(frozen=True)
class Box:
    """``sizes`` elements from ``offsets`` of a full tensor of size ``size``; a local tensor of several boxes along
    ``dim`` lists ``pieces``: ``(start in the local tensor, start in the full tensor, length, whether written)``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    size: tuple[int, ...]
    dim: int = 0
    pieces: tuple[tuple[int, int, int, bool], ...] = ()

    def chunk(self) -> dcp.ChunkStorageMetadata:
        return dcp.ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.sizes))

    def parts(self) -> list[tuple[int, Box, bool]]:
        """``(start along dim in the local tensor, single box, written)`` of each part of the local tensor."""
        if not self.pieces:
            return [(0, self, True)]
        d = self.dim
        return [(local, Box((*self.offsets[:d], full, *self.offsets[d + 1:]), (*self.sizes[:d], n, *self.sizes[d + 1:]),
                            self.size), write) for local, full, n, write in self.pieces]


def locate(value: torch.Tensor, placement: Shard | None, group: ProcessGroup | None) -> tuple[torch.Tensor, Box]:
    """``(local tensor, its box in the full tensor)`` for ``value``, a plain tensor or an FSDP2 ``DTensor``,
    whose tp placement is ``placement`` over ``group`` (None: replicated over tp)."""
    local = value.to_local() if is_dtensor(value) else value
    offsets = list(value.__create_chunk_list__()[0].offsets) if is_dtensor(value) else [0] * value.dim()
    full = list(value.shape)  # the tp shard's shape (a DTensor's global shape); offsets: this rank's chunk in it
    if placement is None or group is None:
        return local, Box(tuple(offsets), tuple(local.shape), tuple(full))
    rank, n = group_rank_size(group)
    dim = placement.dim % value.dim()
    lo, hi = offsets[dim], offsets[dim] + local.shape[dim]  # the chunk's rows of the tp shard
    pieces: list[tuple[int, int, int, bool]] = []
    at, last = 0, None  # where each piece starts in the tp shard; whether the last one is held by every rank
    for i, (start, length) in enumerate(placement.pieces(n, rank)):
        a, b = max(lo, at), min(hi, at + length)  # the piece's overlap with this rank's chunk
        shared = i == len(placement.units) and n > 1  # the replicated tail (after the blocks): a chunk of its own
        if pieces and a < b and pieces[-1][1] + pieces[-1][2] == start + a - at and last == shared:
            pieces[-1] = (*pieces[-1][:2], pieces[-1][2] + b - a, pieces[-1][3])  # runs on from the last one
        elif a < b or (not pieces and a == b == lo):
            pieces.append((a - lo, start + a - at, b - a, not shared or rank == 0))
        at, last = at + length, shared
    assert at == full[dim], (full, placement, n, rank)
    pieces = [p for p in pieces if p[2]] or pieces[:1]
    full[dim], offsets[dim] = placement.size, pieces[0][1]
    keep = len(pieces) > 1 or not pieces[0][3]
    return local, Box(tuple(offsets), tuple(local.shape), tuple(full), dim, tuple(pieces) if keep else ())


def _parts(name: str, tensor: torch.Tensor, boxes: Mapping[str, Box], writing: bool
           ) -> list[tuple[MetadataIndex, torch.Tensor, Box]]:
    """``(index, view, single box)`` of each part of ``tensor`` (when ``writing``, of those this rank writes); a
    tensor without a box is whole."""
    box = boxes.get(name) or Box((0,) * tensor.dim(), tuple(tensor.shape), tuple(tensor.shape))
    if 0 in box.sizes and not (writing and 0 in box.size):
        return []  # an empty FSDP2 chunk: nothing to write or read
    return [(MetadataIndex(name, part.offsets), tensor.narrow(box.dim, at, part.sizes[box.dim]) if box.pieces
             else tensor, part) for at, part, written in box.parts() if written or not writing]


class BoxSavePlanner(dcp.DefaultSavePlanner):
    """Writes each tensor of the flat state dict as the box ``boxes[name]`` of its full tensor (or whole)."""

    def __init__(self, boxes: Mapping[str, Box]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes

    def create_local_plan(self) -> dcp.SavePlan:
        parts = [p for name, tensor in self.state_dict.items() for p in _parts(name, tensor, self.boxes, True)]
        self.views = {index: view for index, view, _ in parts}
        return dcp.SavePlan([dcp.WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            chunk=box.chunk(), size=torch.Size(box.size), properties=TensorProperties.create_from_tensor(view)))
            for index, view, box in parts])

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self.views[index]  # DCP's writer copies a view of a larger storage to its own


class BoxLoadPlanner(dcp.DefaultLoadPlanner):
    """Reads into each tensor of the flat state dict the box ``boxes[name]`` of its full tensor (or all of it)."""

    def __init__(self, boxes: Mapping[str, Box]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes, self.views = boxes, dict[MetadataIndex, torch.Tensor]()

    def create_local_plan(self) -> dcp.LoadPlan:
        assert self.metadata is not None
        items: list[dcp.ReadItem] = []
        for name, tensor in self.state_dict.items():
            parts = _parts(name, tensor, self.boxes, False)
            self.views |= {index: view for index, view, _ in parts}
            stored = cast(dcp.TensorStorageMetadata, self.metadata.state_dict_metadata[name])
            items += create_read_items_for_chunk_list(name, stored, [box.chunk() for _, _, box in parts])
        return dcp.LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.views[index]
