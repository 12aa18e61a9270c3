"""``torch.distributed.checkpoint`` planners for tensors that know their box in the full tensor.

DCP describes a ``DTensor``'s part of the full tensor by ``torch.chunk``'s rule
(10 rows over 4 ranks: 3, 3, 3, 1); tensorpar's shards are balanced (3, 3, 2, 2)
and, under FSDP2, chunked again over dp. Rather than dressing them as DTensors,
the planners here take plain local tensors together with their
:class:`~.boxes.Box` and state the real offsets to DCP: a save plan of one
``WriteItem`` per box, and a load plan from DCP's own resharding
(``create_read_items_for_chunk_list``), which reads, for each local box, the
overlapping parts of whatever chunks the checkpoint holds, whatever (tp, dp)
wrote them.

Example::

    boxes = {"model.w": Box(offsets=(6, 0), sizes=(2, 4), size=(10, 4))}
    dcp.save({"model.w": local}, storage_writer=writer, planner=BoxSavePlanner(boxes), no_dist=True)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .boxes import Box
from .manifest import CheckpointError


def _chunk(box: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))


def _parts(name: str, tensor: torch.Tensor, box: Box) -> list[tuple[tuple[str, tuple[int, ...]], torch.Tensor, Box]]:
    """``((name, offsets), view of tensor, single box)`` of each part of ``tensor`` (see :meth:`Box.parts`)."""
    return [((name, part.offsets), tensor.narrow(box.dim, local, part.sizes[box.dim]) if box.pieces else tensor, part)
            for local, part, _ in box.parts()]


class BoxSavePlanner(DefaultSavePlanner):
    """Writes each tensor of the (flat) state dict as the box ``boxes[name]`` of its full tensor."""

    def __init__(self, boxes: Mapping[str, Box]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = dict(boxes)
        self.views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}  # each part of each tensor

    def create_local_plan(self) -> SavePlan:
        items, self.views = [], {}
        for name, tensor in self.state_dict.items():
            assert tuple(tensor.shape) == self.boxes[name].sizes, (name, tensor.shape, self.boxes[name])
            for key, view, box in _parts(name, tensor, self.boxes[name]):
                self.views[key] = view
                items.append(WriteItem(index=MetadataIndex(name, box.offsets), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=_chunk(box), size=torch.Size(box.size),
                                                                   properties=TensorProperties.create_from_tensor(view))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self.views[index.fqn, tuple(index.offset or ())]


class BoxLoadPlanner(DefaultLoadPlanner):
    """Reads into each tensor of the (flat) state dict the box ``boxes[name]`` of its full tensor, from
    the chunks the checkpoint holds (the full size and dtype are checked before, see :mod:`.state`)."""

    def __init__(self, boxes: Mapping[str, Box]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = dict(boxes)
        self.views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}  # each part of each tensor

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        self.views = {}
        for name in self.state_dict:
            stored = self.metadata.state_dict_metadata.get(name)
            box = self.boxes[name]
            if not isinstance(stored, TensorStorageMetadata) or tuple(stored.size) != box.size:
                raise CheckpointError(f"{name}: the checkpoint holds no tensor of size {list(box.size)}")
            if 0 in box.sizes:
                continue  # nothing to read
            parts = _parts(name, self.state_dict[name], box)
            self.views |= {key: view for key, view, _ in parts}
            items += create_read_items_for_chunk_list(name, stored, [_chunk(part) for _, _, part in parts])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.views[index.fqn, tuple(index.offset or ())]
