"""Balanced partitions of a dimension across tensor-parallel ranks.

A dimension of ``size // unit`` units (a unit is one feature, or one attention head of ``unit``
features) is split over ``parts`` ranks so that shard sizes differ by at most one unit: the first
``units % parts`` ranks get one unit more. 10 features over 4 ranks: 3, 3, 2, 2 at offsets 0, 3, 6, 8.
Nothing is padded. Every shard size and offset in tensorpar comes from :func:`partition_sizes`;
gathering shards back is a collective, in :mod:`tensorpar.full`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .checks import check_int


def partition_sizes(size: int, parts: int, *, unit: int = 1, name: str = "size",
                    allow_empty: bool = False) -> list[int]:
    """Sizes of ``parts`` balanced shards of ``size`` elements, in whole units. Fewer units than parts is
    an error, unless ``allow_empty`` (the tokens of sequence parallelism): the last shards are then empty.

    Example (10 features over 4 ranks: see the module's docstring)::

        >>> partition_sizes(12 * 64, 5, unit=64)  # 12 heads of 64 over 5 ranks
        [192, 192, 128, 128, 128]
        >>> partition_sizes(2, 4, allow_empty=True)
        [1, 1, 0, 0]
    """
    check_int(size, name)
    check_int(parts, "parts")
    check_int(unit, "unit")
    if size % unit:
        raise ValueError(f"{name} ({size}) is not a whole number of units of {unit}")
    units = size // unit
    if units < parts and not allow_empty:  # ``name`` counts units: "out_features", or "n_head" for heads
        raise ValueError(f"{name} ({units}) is smaller than tp ({parts})")
    base, extra = divmod(units, parts)
    return [(base + (r < extra)) * unit for r in range(parts)]


def partition_offsets(size: int, parts: int, *, unit: int = 1, name: str = "size") -> list[int]:
    """Start offsets of the shards given by :func:`partition_sizes`."""
    return [0, *itertools.accumulate(partition_sizes(size, parts, unit=unit, name=name)[:-1])]


def partition_bounds(size: int, parts: int, index: int, *, unit: int = 1, name: str = "size") -> tuple[int, int]:
    """``(offset, length)`` of shard ``index`` of ``parts`` (see :func:`partition_sizes`)."""
    sizes = partition_sizes(size, parts, unit=unit, name=name)
    check_int(index, "shard index", minimum=0)
    if index >= parts:
        raise ValueError(f"shard index {index} is out of range for {parts} parts")
    return sum(sizes[:index]), sizes[index]


@dataclass(frozen=True)
class Shard:
    """Placement of a parameter split along ``dim`` of a full ``size``, in units of ``unit``; sharded
    modules return ``{param_name: Shard(...)}`` from ``sharding()`` (parameters it omits are replicated).

    A tuple ``unit=(u_0, u_1, ...)`` is a dim of consecutive *blocks* of ``n`` units each, block ``b``'s
    ``u_b`` elements long (``size - replicated == n * sum(unit)``): the ``n`` units are split as usual and
    a rank holds its units of every block, end to end (Megatron's partition stride). GPT-2's fused
    ``[Q | K | V]`` is ``unit=(d, d, d)`` (rank 0 of 2 holds ``[Q_0 | K_0 | V_0]``); grouped-query
    ``[Q | K | V]`` by whole query groups is ``unit=(g * d, d, d)``. The last ``replicated`` elements are
    held whole by every rank, after its shard of the rest. Such a shard is several :meth:`pieces`.
    """

    dim: int
    size: int
    unit: int | tuple[int, ...] = 1
    replicated: int = 0

    @property
    def units(self) -> tuple[int, ...]:
        """The unit of each block (one block when ``unit`` is an int)."""
        return self.unit if isinstance(self.unit, tuple) else (self.unit,)

    def count(self) -> int:
        """Units in each block: the number that is split over the ranks."""
        if not self.units:
            raise ValueError("unit must name at least one block")
        for u in self.units:
            check_int(u, "unit")
        check_int(self.replicated, "replicated", minimum=0)
        split, stride = self.size - self.replicated, sum(self.units)
        if split <= 0 or split % stride:
            what = f"size ({self.size})" + (f" less replicated ({self.replicated})" if self.replicated else "")
            raise ValueError(f"{what} is not a whole number of units of {stride}"
                             + (f" (blocks of units {self.units})" if len(self.units) > 1 else ""))
        return split // stride

    def sizes(self, parts: int, *, name: str = "units") -> list[int]:
        """Every rank's shard size along ``dim`` (its pieces together); ``name`` names the units in errors."""
        stride = sum(self.units)
        return [n * stride + self.replicated for n in partition_sizes(self.count(), parts, name=name)]

    def pieces(self, parts: int, index: int, *, name: str = "units") -> list[tuple[int, int]]:
        """``(offset, length)`` in the full dim of each piece of shard ``index`` of ``parts``, in the
        order the shard holds them: one per block, then the replicated tail (if any).

        Example::

            >>> Shard(0, 16, unit=(4, 2, 2)).pieces(2, 1)  # [Q | K | V] of 2 query groups: rank 1's
            [(4, 4), (10, 2), (14, 2)]
        """
        n = self.count()
        lo, length = partition_bounds(n, parts, index, name=name)
        found, start = [], 0
        for u in self.units:
            found.append((start + lo * u, length * u))
            start += n * u
        return found + ([(start, self.replicated)] if self.replicated else [])


def shard(tensor: torch.Tensor, placement: Shard, parts: int, index: int) -> torch.Tensor:
    """Shard ``index`` of ``parts`` of a full tensor (a view; a copy for a shard of several pieces)."""
    shape = tuple(tensor.shape)
    if not -len(shape) <= placement.dim < len(shape) or shape[placement.dim] != placement.size:
        raise ValueError(f"expected size {placement.size} in dim {placement.dim}, got a tensor of shape {shape}")
    pieces = placement.pieces(parts, index)
    at: list[slice | list[int]] = [slice(None)] * len(shape)  # a slice, or the positions of several pieces
    at[placement.dim] = (slice(pieces[0][0], sum(pieces[0])) if len(pieces) == 1
                         else [i for offset, length in pieces for i in range(offset, offset + length)])
    return tensor[tuple(at)]


def join_shards(shards: Sequence[torch.Tensor], placement: Shard) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order: the inverse of :func:`shard` (a replicated
    tail is taken from the first rank)."""
    placed: dict[int, torch.Tensor] = {}  # full offset -> piece
    for r, local in enumerate(shards):
        pieces = placement.pieces(len(shards), r)
        for (offset, _), piece in zip(pieces, local.split([n for _, n in pieces], placement.dim), strict=True):
            placed.setdefault(offset, piece)
    return torch.cat([placed[offset] for offset in sorted(placed)], placement.dim)
