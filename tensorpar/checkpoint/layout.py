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
    """``sizes`` elements from ``offsets`` of a full tensor of size ``size``; a local tensor made of several boxes
    along ``dim`` lists ``pieces``: ``(start in the local tensor, start in the full tensor, length, whether this
    rank writes it)`` (a fused projection's replicated tail is written by tp rank 0 alone)."""

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
    if is_dtensor(value):
        local = value.to_local()
        (chunk,) = value.__create_chunk_list__()  # this rank's chunk of the tp shard
        offsets = list(chunk.offsets)
    else:
        local, offsets = value, [0] * value.dim()
    full = list(value.shape)  # the tp shard's shape (a DTensor's global shape)
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


def _view(state_dict: Mapping[str, torch.Tensor], boxes: Mapping[str, Box], index: MetadataIndex) -> torch.Tensor:
    return next(view for i, view, _ in _parts(index.fqn, state_dict[index.fqn], boxes, False) if i == index)


class BoxSavePlanner(dcp.DefaultSavePlanner):
    """Writes each tensor of the flat state dict as the box ``boxes[name]`` of its full tensor (or whole)."""

    def __init__(self, boxes: Mapping[str, Box]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes

    def create_local_plan(self) -> dcp.SavePlan:
        parts = [p for name, tensor in self.state_dict.items() for p in _parts(name, tensor, self.boxes, True)]
        self.plan = dcp.SavePlan([dcp.WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            chunk=box.chunk(), size=torch.Size(box.size), properties=TensorProperties.create_from_tensor(view)))
            for index, view, box in parts])
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        view = _view(self.state_dict, self.boxes, index).detach()
        return view.clone(memory_format=torch.contiguous_format) if view.is_cuda or view.untyped_storage().nbytes() \
            != view.numel() * view.element_size() else view  # torch.save writes a view's whole storage


class BoxLoadPlanner(dcp.DefaultLoadPlanner):
    """Reads into each tensor of the flat state dict the box ``boxes[name]`` of its full tensor (or all of it), its
    size and dtype checked against the checkpoint's metadata before."""

    def __init__(self, boxes: Mapping[str, Box]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes

    def create_local_plan(self) -> dcp.LoadPlan:
        assert self.metadata is not None
        items: list[dcp.ReadItem] = []
        for name, tensor in self.state_dict.items():
            chunks = [box.chunk() for _, _, box in _parts(name, tensor, self.boxes, False)]
            stored = cast(dcp.TensorStorageMetadata, self.metadata.state_dict_metadata[name])
            items += create_read_items_for_chunk_list(name, stored, chunks)
        return dcp.LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _view(self.state_dict, self.boxes, index)
