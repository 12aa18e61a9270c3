"""Balanced partitions of a dimension across tensor-parallel ranks.

A dimension of ``size`` elements made of ``size // unit`` units (a unit is one
feature, or one attention head of ``unit`` features) is split over ``parts``
ranks so that shard sizes differ by at most one unit: the first
``units % parts`` ranks get one unit more. For 10 features over 4 ranks the
shards are 3, 3, 2, 2 at offsets 0, 3, 6, 8. Nothing is padded, so a sharded
computation sees exactly the elements the unsharded one does.

Every shard offset in tensorpar comes from :func:`partition_bounds` (directly
or through :meth:`Shard.bounds`); gathering shards back into a full tensor is
a collective and lives in :mod:`tensorpar.full`. Every size, count and unit
is checked by :func:`check_int` (the modules built on this core use it too): a ``bool``
is never taken for ``1``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


def check_int(value: object, name: str, *, minimum: int = 1, optional: bool = False) -> None:
    """Raise unless ``value`` is an ``int`` of at least ``minimum`` (or ``None`` when ``optional``).

    A ``bool`` is no size or count, though Python makes it an ``int``: ``True``
    raises a ``TypeError``, as any other non-integer does; an integer below
    ``minimum`` raises a ``ValueError``. The message names ``name`` and the value.

    Example::

        >>> check_int(0, "n_head")
        Traceback (most recent call last):
        ValueError: n_head must be a positive integer, got 0
    """
    if optional and value is None:
        return
    is_int = isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)
    if is_int and value >= minimum:  # type: ignore[operator]
        return
    kind = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
    if optional:
        kind += " or None"
    raise (ValueError if is_int else TypeError)(f"{name} must be {kind}, got {value!r}")


def check_ids(ids: torch.Tensor, limit: int, what: str, detail: str, *, allowed: int | None = None) -> None:
    """Raise unless every id in ``ids`` is in ``[0, limit)`` (or equals ``allowed``).

    Eagerly a ``ValueError`` names the first id out of range (a host sync):
    ``"{what} {id} is out of range for {detail}"``. In a ``torch.compile``
    graph, where a data-dependent branch would break the graph, the same check
    is an in-graph assertion (a ``RuntimeError`` without the id).
    """
    bad = (ids < 0) | (ids >= limit)  # (*)
    if allowed is not None:
        bad &= ids != allowed
    if torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), f"a {what} is out of range for {detail}")
    elif bad.any():
        raise ValueError(f"{what} {ids[bad][0].item()} is out of range for {detail}")

def partition_sizes(size: int, parts: int, *, unit: int = 1, name: str = "size") -> list[int]:
    """Sizes of ``parts`` balanced shards of ``size`` elements, in whole units.

    Example::

        >>> partition_sizes(10, 4)
        [3, 3, 2, 2]
        >>> partition_sizes(12 * 64, 5, unit=64)  # 12 heads of 64 over 5 ranks
        [192, 192, 128, 128, 128]
    """
    check_int(size, name)
    check_int(parts, "parts")
    check_int(unit, "unit")
    if size % unit:
        raise ValueError(f"{name} ({size}) is not a whole number of units of {unit}")
    units = size // unit
    if units < parts:  # ``name`` counts units: "out_features", or "n_head" for heads
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
        return partition_bounds(self.size, parts, index, unit=self.unit)

    def index(self, ndim: int, parts: int, index: int) -> tuple[slice, ...]:
        """The subscript that takes shard ``index`` out of a full ``ndim``-dimensional tensor
        (or out of anything indexed like one, such as a lazily read checkpoint tensor)."""
        offset, length = self.bounds(parts, index)
        subscript = [slice(None)] * ndim
        subscript[self.dim] = slice(offset, offset + length)
        return tuple(subscript)


def shard(tensor: torch.Tensor, placement: Shard, parts: int, index: int) -> torch.Tensor:
    """Shard ``index`` of ``parts`` of a full tensor (a view; clone before writing in place)."""
    shape = tuple(tensor.shape)
    if not -len(shape) <= placement.dim < len(shape) or shape[placement.dim] != placement.size:
        raise ValueError(f"expected size {placement.size} in dim {placement.dim}, got a tensor of shape {shape}")
    return tensor[placement.index(len(shape), parts, index)]
