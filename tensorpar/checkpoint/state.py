"""This rank's part of the model's state from a checkpoint, checked against the model.

A checkpoint holds unsharded tensors; each rank reads only the slice of each
split tensor that its shard covers (see :mod:`tensorpar.full`), after checking
the tensor's full shape and dtype against the model's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..full import Placements, full_shape
from ..mesh import group_rank_size
from ..sharding import Shard
from .manifest import CheckpointError
from .tensors import Reader


def read_local(f: Reader, key: str, placement: Shard | None, group: ProcessGroup | None,
               shape: torch.Size | tuple[int, ...], dtype: torch.dtype, *, cast: bool) -> torch.Tensor:
    """This rank's part of tensor ``key`` of ``f``, whose local shard has ``shape`` and ``dtype``:
    a slice along the placement's dim, or all of it. A full shape other than the model's, or a dtype
    other than ``dtype`` (unless ``cast``), is a CheckpointError naming the file, the key and both."""
    full, stored = f.info(key)
    want = full_shape(shape, placement)
    if full != want:
        raise CheckpointError(f"{f.path}: {key}: the checkpoint holds shape {full}, the model's full shape is {want}")
    if stored != dtype and not cast:
        raise CheckpointError(f"{f.path}: {key} is stored as {stored}, the model's is {dtype} "
                              "(load(..., cast=True) converts it)")
    if placement is None or group is None:
        value = f.read(key)
    else:
        rank, n = group_rank_size(group)
        value = f.read(key, placement.index(len(full), n, rank))
    return value.to(dtype)


def read_model(f: Reader, model: nn.Module, where: Placements, *, cast: bool) -> dict[str, torch.Tensor]:
    """The model's local state dict from ``f`` (the model's keys exactly), checked before returning."""
    state = model.state_dict()
    missing, unexpected = sorted(set(state) - set(f.keys())), sorted(set(f.keys()) - set(state))
    if missing:
        raise CheckpointError(f"{f.path}: the checkpoint lacks {missing}")
    if unexpected:
        raise CheckpointError(f"{f.path}: the checkpoint holds {unexpected}, which the model lacks")
    return {key: read_local(f, key, *where.get(key, (None, None)), value.shape, value.dtype, cast=cast)
            for key, value in state.items()}
