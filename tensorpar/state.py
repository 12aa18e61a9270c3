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
