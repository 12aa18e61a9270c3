"""Small integer rows compared across ranks, so that an argument only some ranks can check makes every
rank raise alike (one all-reduce each, nothing pickled)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .world import collective_device

__all__ = ["agree", "exchange_ints"]


def exchange_ints(row: list[int], group: ProcessGroup | None = None,
                  device: torch.device | None = None) -> list[list[int]]:
    """Every rank's ``row`` (the same length on all), in rank order: one all-reduce of a zero matrix in which
    each rank fills its own row. ``device``: the group's."""
    rows = torch.zeros(dist.get_world_size(group), len(row), dtype=torch.int64)
    rows[dist.get_rank(group)] = torch.tensor(row, dtype=torch.int64)
    everyone = rows.to(device)
    dist.all_reduce(everyone, group=group)
    return everyone.tolist()


def agree(row: list[int], what: str, describe: Callable[..., str]) -> None:
    """Compare ``row`` across the world; where the ranks differ every rank raises alike:
    "the ranks {what} (rank 0: {describe(*row_0)}; ...)"."""
    if dist.get_world_size() == 1:
        return
    everyone = exchange_ints(row, device=collective_device())
    if any(other != everyone[0] for other in everyone):
        views = "; ".join(f"rank {r}: {describe(*other)}" for r, other in enumerate(everyone))
        raise ValueError(f"the ranks {what} ({views})")
