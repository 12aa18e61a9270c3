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
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .boxes import Box
from .manifest import CheckpointError


def _chunk(box: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))


class BoxSavePlanner(DefaultSavePlanner):
    """Writes each tensor of the (flat) state dict as the box ``boxes[name]`` of its full tensor."""

    def __init__(self, boxes: Mapping[str, Box]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = dict(boxes)

    def create_local_plan(self) -> SavePlan:
        items = []
        for name, tensor in self.state_dict.items():
            box = self.boxes[name]
            assert tuple(tensor.shape) == box.sizes, (name, tensor.shape, box)
            items.append(WriteItem(index=MetadataIndex(name, box.offsets), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=_chunk(box), size=torch.Size(box.size),
                                                               properties=TensorProperties.create_from_tensor(tensor))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


class BoxLoadPlanner(DefaultLoadPlanner):
    """Reads into each tensor of the (flat) state dict the box ``boxes[name]`` of its full tensor, from
    the chunks the checkpoint holds (the full size and dtype are checked before, see :mod:`.state`)."""

    def __init__(self, boxes: Mapping[str, Box]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = dict(boxes)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for name in self.state_dict:
            stored = self.metadata.state_dict_metadata.get(name)
            box = self.boxes[name]
            if not isinstance(stored, TensorStorageMetadata) or tuple(stored.size) != box.size:
                raise CheckpointError(f"{name}: the checkpoint holds no tensor of size {list(box.size)}")
            if 0 in box.sizes:
                continue  # nothing to read
            items += create_read_items_for_chunk_list(name, stored, [_chunk(box)])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]
