"""Full (unsharded) views of sharded tensors and of models built from sharded modules.

A sharded module has ``tp_group`` and ``sharding()`` (``{param_name: Shard}`` of its split parameters; the
others are replicated). :func:`placements` walks a model by them; this is the one place where shards are
gathered into full tensors (:func:`unshard`) or cut from them (:func:`load_full_state_dict`). Under FSDP2 a
``DTensor`` is all-gathered over dp first (:func:`tp_local`); loading cuts the tp shard, then the dp chunk.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn
from torch.distributed import ProcessGroup

from .comm.collectives import all_gather_along
from .mesh import group_rank_size
from .sharding import Shard, join_shards, shard

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

def placements(model: nn.Module) -> dict[str, tuple[Shard, ProcessGroup]]:
    """``{state-dict key: (placement, group)}`` for every split tensor of ``model``."""
    found = {}
    for prefix, module in model.named_modules():
        sharding = getattr(module, "sharding", None)
        if callable(sharding):
            for name, placement in sharding().items():
                found[f"{prefix}.{name}" if prefix else name] = (placement, module.tp_group)
    return found


def is_dtensor(x: object) -> TypeGuard[DTensor]:
    """Whether ``x`` is a ``DTensor``, without loading DTensor's module (until loaded, nothing is one)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(x, dtensor)


def local_part(x: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a ``DTensor``'s local piece, any other tensor itself (no copy)."""
    return x.to_local() if is_dtensor(x) else x


def tp_local(x: torch.Tensor) -> torch.Tensor:
    """The rank's whole tp shard (or replicated copy) of ``x``, detached: a ``DTensor`` is all-gathered over
    its mesh (a collective)."""
    with torch.no_grad():
        return x.full_tensor() if is_dtensor(x) else x.detach()


def unshard(x: torch.Tensor, placement: Shard, group: ProcessGroup) -> torch.Tensor:
    """The full tensor from every rank's shard (a collective, no autograd; every rank gets it)."""
    sizes = placement.sizes(group_rank_size(group)[1])
    gathered = all_gather_along(x.detach(), placement.dim, sizes, group)  # the shards, in rank order
    if len(placement.pieces(len(sizes), 0)) == 1:  # one slice each: the shards in rank order are the tensor
        return gathered
    return join_shards(gathered.split(sizes, placement.dim), placement)


def gather(tensors: Mapping[str, torch.Tensor],
           where: Mapping[str, tuple[Shard, ProcessGroup]]) -> dict[str, torch.Tensor]:
    """``tensors`` with every split one (a key of ``where``) gathered to full size (a collective;
    under FSDP2 over dp first, so every rank of the mesh must call it)."""
    pieces = {k: tp_local(v) for k, v in tensors.items()}  # over dp first (FSDP2), then over tp
    return {k: unshard(v, *where[k]) if k in where else v.clone() for k, v in pieces.items()}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the unsharded model, on every rank (a collective; under FSDP2 over the
    whole mesh)."""
    return gather(model.state_dict(), placements(model))


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients of the unsharded model's parameters, on every rank (a collective)."""
    return gather({k: p.grad for k, p in model.named_parameters() if p.grad is not None}, placements(model))


def shard_geometry(model: nn.Module) -> dict[str, dict[str, Any]]:
    """``{name: {"full_shape": ..., "offset": ...}}`` for every parameter: where this rank's block sits in
    the full tensor (and ``dim`` and ``pieces`` for a shard of several pieces), the keyword arguments of
    :mod:`tensorpar.tiled_init`'s fills, e.g.::

        geometry = tensorpar.shard_geometry(model)
        for name, p in model.named_parameters():
            tensorpar.tiled_init.normal_(p, 0.0, 0.02, **geometry[name])
    """
    where = placements(model)
    geometry: dict[str, dict[str, Any]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shape, offset, pieces = list(p.shape), [0] * p.dim(), []
        if name in where:
            placement, group = where[name]
            rank, n = group_rank_size(group)
            dim = placement.dim % p.dim()
            pieces = placement.pieces(n, rank)
            shape[dim], offset[dim] = placement.size, pieces[0][0]
        several = {"dim": dim, "pieces": tuple(pieces)} if len(pieces) > 1 else {}
        geometry[name] = several | {"full_shape": tuple(shape), "offset": tuple(offset)}
    return geometry


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load an unsharded state dict, keeping each rank's shard of the split tensors (and under
    FSDP2 this rank's dp chunk of that shard, cut locally: no communication)."""
    local = dict(state_dict)
    for key, (placement, group) in placements(model).items():
        if key not in local:
            continue  # load_state_dict reports the missing key
        try:
            rank, n = group_rank_size(group)
            local[key] = shard(local[key], placement, n, rank)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
    for key, current in model.state_dict().items():
        if is_dtensor(current) and key in local and not is_dtensor(local[key]):
            from torch.distributed.tensor import distribute_tensor  # loaded already: current is a DTensor

            if tuple(local[key].shape) != tuple(current.shape):  # before cutting it over dp
                raise ValueError(f"{key}: expected this rank's shard of shape {tuple(current.shape)}, "
                                 f"got {tuple(local[key].shape)}")
            local[key] = distribute_tensor(local[key].to(current.device), current.device_mesh, current.placements,
                                           src_data_rank=None)
    model.load_state_dict(local)
