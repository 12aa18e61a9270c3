"""Balanced partitions of a dimension across tensor-parallel ranks.

A dimension of ``size`` elements made of ``size // unit`` units (a unit is one
feature, or one attention head of ``unit`` features) is split over ``parts``
ranks so that shard sizes differ by at most one unit: the first
``units % parts`` ranks get one unit more. For 10 features over 4 ranks the
shards are 3, 3, 2, 2 at offsets 0, 3, 6, 8. Nothing is padded, so a sharded
computation sees exactly the elements the unsharded one does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def partition_sizes(size: int, parts: int, *, unit: int = 1, name: str = "size") -> list[int]:
    """Sizes of ``parts`` balanced shards of ``size`` elements, in whole units.

    Example::

        >>> partition_sizes(10, 4)
        [3, 3, 2, 2]
        >>> partition_sizes(12 * 64, 5, unit=64)  # 12 heads of 64 over 5 ranks
        [192, 192, 128, 128, 128]
    """
    if parts < 1:
        raise ValueError(f"cannot split {name} into {parts} parts")
    if unit < 1 or size % unit:
        raise ValueError(f"{name} ({size}) is not a whole number of units of {unit}")
    units = size // unit
    if units < parts:  # ``name`` counts units: "out_features", or "n_head" for heads
        raise ValueError(f"{name} ({units}) is smaller than tp ({parts})")
    base, extra = divmod(units, parts)
    return [(base + (r < extra)) * unit for r in range(parts)]


def partition_offsets(size: int, parts: int, *, unit: int = 1, name: str = "size") -> list[int]:
    """Start offsets of the shards given by :func:`partition_sizes`."""
    offsets, start = [], 0
    for s in partition_sizes(size, parts, unit=unit, name=name):
        offsets.append(start)
        start += s
    return offsets


@dataclass(frozen=True)
class Shard:
    """Placement of a parameter split along ``dim`` of a full ``size``, in units of ``unit``.

    Sharded modules describe their parameters with a ``sharding()`` method
    returning ``{param_name: Shard(...)}``; parameters it omits are replicated.
    """

    dim: int
    size: int
    unit: int = 1

    def sizes(self, parts: int) -> list[int]:
        return partition_sizes(self.size, parts, unit=self.unit)

    def bounds(self, parts: int, index: int) -> tuple[int, int]:
        """``(offset, length)`` of shard ``index`` of ``parts``."""
        sizes = self.sizes(parts)
        return sum(sizes[:index]), sizes[index]


def shard(tensor: torch.Tensor, placement: Shard, parts: int, index: int) -> torch.Tensor:
    """Shard ``index`` of ``parts`` of a full tensor (a view; clone before writing in place)."""
    if tensor.shape[placement.dim] != placement.size:
        raise ValueError(
            f"expected size {placement.size} in dim {placement.dim}, got tensor of shape {tuple(tensor.shape)}"
        )
    offset, length = placement.bounds(parts, index)
    return tensor.narrow(placement.dim, offset, length)
