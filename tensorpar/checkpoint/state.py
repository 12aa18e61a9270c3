"""The model's part of a checkpoint: the chunks this rank writes, and, on load, this rank's boxes of
each tensor, checked against the model before anything is read.

Tensors are named ``model.<state-dict key>``. Each rank holds a box of each
full tensor (see :mod:`.boxes`); it writes the boxes that fall to it and, on
load, reads its own boxes whatever layout wrote the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..full import is_dtensor, placements
from ..mesh import Mesh
from .boxes import Box, locate, written
from .index import Entry
from .manifest import CheckpointError
from .meta import MODEL


def pieces(model: nn.Module, mesh: Mesh) -> tuple[dict[str, torch.Tensor], dict[str, Box]]:
    """``(tensors, boxes)``: the model's chunks that this rank writes, by name."""
    where = placements(model)
    tensors, boxes = {}, {}
    for key, value in model.state_dict().items():
        placement, group = where.get(key, (None, None))
        local, box, dp_split = locate(value, placement, group)
        name = MODEL + key
        mine = written(box, name, tp_split=placement is not None, dp_split=dp_split, mesh=mesh)
        if mine is not None:
            tensors[name], boxes[name] = local.detach(), mine
    return tensors, boxes


def check_entry(name: str, entry: Entry, box: Box, dtype: torch.dtype, where: Path, *, cast: bool) -> None:
    """Raise unless the checkpoint's tensor ``name`` has the full shape of ``box`` and, unless ``cast``,
    ``dtype``."""
    if entry.size != box.size:
        raise CheckpointError(f"{where}: {name}: the checkpoint holds shape {entry.size}, "
                              f"the model's full shape is {box.size}")
    if entry.dtype != dtype and not cast:
        raise CheckpointError(f"{where}: {name} is stored as {entry.dtype}, the model's is {dtype} "
                              "(load(..., cast=True) converts it)")


def destinations(model: nn.Module, entries: Mapping[str, Entry], where: Path, *, cast: bool,
                 stage: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Box]]:
    """``(tensors to read into, their boxes)`` for the model's state, by name, after checking that the
    checkpoint holds exactly the model's keys (all of them, and no others unless the model is one
    pipeline ``stage`` of the whole), each of the model's full shape and dtype."""
    state = model.state_dict()
    stored = {k.removeprefix(MODEL) for k in entries if k.startswith(MODEL)}
    missing, unexpected = sorted(set(state) - stored), sorted(stored - set(state))
    if missing:
        raise CheckpointError(f"{where}: the checkpoint lacks {missing}")
    if unexpected and not stage:
        raise CheckpointError(f"{where}: the checkpoint holds {unexpected}, which the model lacks")
    found = placements(model)
    tensors, boxes = {}, {}
    for key, value in state.items():
        local, box, _ = locate(value, *found.get(key, (None, None)))
        name = MODEL + key
        check_entry(name, entries[name], box, local.dtype, where, cast=cast)
        tensors[name], boxes[name] = torch.empty(box.sizes, dtype=entries[name].dtype), box
    return tensors, boxes


def like(value: torch.Tensor, current: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``value`` (this rank's local part) on the device and of the kind of ``current`` (a DTensor of the
    same mesh and placements where ``current`` is one), in ``dtype`` (default: ``current``'s)."""
    dtype = dtype or current.dtype
    if is_dtensor(current):
        local = value.to(dtype=dtype, device=current.to_local().device)
        return DTensor.from_local(local, current.device_mesh, current.placements, run_check=False,
                                  shape=current.shape, stride=current.stride())
    return value.to(dtype=dtype, device=current.device)


def apply(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Load the local parts read by :func:`destinations` into ``model``."""
    state = model.state_dict()
    model.load_state_dict({key: like(tensors[MODEL + key], value) for key, value in state.items()})
