"""Full (unsharded) views of models built from sharded modules.

A sharded module describes its parameters with two members: ``tp_group`` (the
group it is split over) and ``sharding()`` returning ``{param_name: Shard}`` for
its split parameters (the others are replicated). Everything here walks a model
by that description, so it works for any model built from such modules.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.distributed import ProcessGroup

from .collectives import unshard
from .mesh import group_rank_size
from .sharding import Shard, shard


def sharded_entries(model: nn.Module) -> Iterator[tuple[str, Shard, ProcessGroup]]:
    """``(state-dict key, placement, group)`` for every split tensor of ``model``."""
    for prefix, module in model.named_modules():
        sharding = getattr(module, "sharding", None)
        if callable(sharding):
            for name, placement in sharding().items():
                yield (f"{prefix}.{name}" if prefix else name), placement, module.tp_group


def _gathered(tensors: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    out = {k: v.detach().clone() for k, v in tensors.items()}
    for key, placement, group in sharded_entries(model):
        if key in out:
            out[key] = unshard(out[key], placement, group)
    return out


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the unsharded model, on every rank (a collective)."""
    return _gathered(model.state_dict(), model)


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients of the unsharded model's parameters, on every rank (a collective)."""
    return _gathered({k: p.grad for k, p in model.named_parameters() if p.grad is not None}, model)


def shard_geometry(model: nn.Module) -> dict[str, dict[str, tuple[int, ...]]]:
    """``{name: {"full_shape": ..., "offset": ...}}`` for every parameter of ``model``:
    where this rank's block sits in the full tensor (replicated: the whole of it).

    The values are the keyword arguments of :mod:`tensorpar.tiled_init`'s fills,
    so a model initialises tp-invariantly with, e.g.::

        geometry = tensorpar.shard_geometry(model)
        for name, p in model.named_parameters():
            tensorpar.tiled_init.normal_(p, 0.0, 0.02, **geometry[name])
    """
    geometry = {name: {"full_shape": tuple(p.shape), "offset": (0,) * p.dim()}
                for name, p in model.named_parameters(remove_duplicate=False)}
    for key, placement, group in sharded_entries(model):
        if key in geometry:
            rank, n = group_rank_size(group)
            full, offset = list(geometry[key]["full_shape"]), list(geometry[key]["offset"])
            offset[placement.dim], _ = placement.bounds(n, rank)
            full[placement.dim] = placement.size
            geometry[key] = {"full_shape": tuple(full), "offset": tuple(offset)}
    return geometry


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load an unsharded state dict, keeping each rank's shard of the split tensors."""
    local = dict(state_dict)
    for key, placement, group in sharded_entries(model):
        if key not in local:
            continue  # load_state_dict reports the missing key
        rank, n = group_rank_size(group)
        try:
            local[key] = shard(local[key], placement, n, rank)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
    model.load_state_dict(local)
