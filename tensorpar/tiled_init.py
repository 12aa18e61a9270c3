"""Initialisation that does not depend on the tp size.

The full tensor is cut into a fixed grid of ``TILE``-sized tiles, each drawn from its own generator seeded
from the tile's grid coordinates and one base seed drawn from torch's global RNG. A rank draws only the
tiles overlapping its shard and keeps the overlap: the full tensor is bitwise the same at every tp, no rank
materialises more than one tile beyond its shard, and every rank takes one global draw per tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from .random import mix_seed

TILE = 256


@torch.no_grad()
def fill_tiled_(tensor: torch.Tensor, sample: Callable[[torch.Tensor, torch.Generator], object], *,
                full_shape: Sequence[int] | None = None, offset: Sequence[int] | None = None,
                dim: int = 0, pieces: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """Fill ``tensor``, the block at ``offset`` of a ``full_shape`` tensor, tile by tile.

    ``sample(tile, generator)`` fills one tile in place (e.g. ``tile.uniform_(a, b, generator=g)``).
    With ``pieces``, ``tensor`` is instead several blocks of the full tensor laid end to end
    along ``dim`` (a fused projection's shard, :meth:`tensorpar.Shard.pieces`): ``(offset, length)``
    of each in the full ``dim``, ``offset[dim]`` being unused.
    """
    full_shape = tuple(tensor.shape) if full_shape is None else tuple(full_shape)
    offset = (0,) * tensor.dim() if offset is None else tuple(offset)
    boxes = [(tensor, offset)]  # (part of tensor, its offset in the full tensor)
    if pieces is not None:
        if sum(n for _, n in pieces) != tensor.shape[dim]:
            raise ValueError(f"pieces {list(pieces)} do not make up the {tensor.shape[dim]} elements of dim {dim} "
                             f"of a {tuple(tensor.shape)} block")
        dim %= tensor.dim()
        boxes = [(part, (*offset[:dim], start, *offset[dim + 1:]))
                 for part, (start, _) in zip(tensor.split([n for _, n in pieces], dim), pieces, strict=True)]
    for part, at in boxes:
        if len(full_shape) != part.dim() or len(at) != part.dim() or any(
                o < 0 or o + s > f for o, s, f in zip(at, part.shape, full_shape, strict=True)):
            raise ValueError(f"a {tuple(part.shape)} block at offset {at} does not fit in {full_shape}")
    if tensor.is_meta:  # nothing to fill, and no draw: from_linear builds on meta first
        return tensor
    base = int(torch.randint(0, 2**62, ()).item())  # the one draw from the global RNG
    for part, at in boxes:  # every tile overlapping the box ``part`` at ``at`` of the full tensor
        ranges = [range(o // TILE, (o + s - 1) // TILE + 1) for o, s in zip(at, part.shape, strict=True)]
        for index in itertools.product(*ranges):
            lo = [i * TILE for i in index]
            hi = [min(f, t + TILE) for f, t in zip(full_shape, lo, strict=True)]
            tile = torch.empty([h - t for h, t in zip(hi, lo, strict=True)], dtype=part.dtype)
            sample(tile, torch.Generator().manual_seed(mix_seed(base, *index)))
            # overlap of this tile with the box, in full coordinates
            start = [max(t, o) for t, o in zip(lo, at, strict=True)]
            stop = [min(h, o + s) for h, o, s in zip(hi, at, part.shape, strict=True)]
            src = tile[tuple(slice(a - t, b - t) for a, b, t in zip(start, stop, lo, strict=True))]
            part[tuple(slice(a - o, b - o) for a, b, o in zip(start, stop, at, strict=True))] = src
    return tensor


def uniform_(tensor: torch.Tensor, a: float, b: float, *, full_shape: Sequence[int] | None = None,
             offset: Sequence[int] | None = None, dim: int = 0,
             pieces: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """Tp-invariant ``U(a, b)`` fill of a shard (see :func:`fill_tiled_`)."""
    return fill_tiled_(tensor, lambda t, g: t.uniform_(a, b, generator=g), full_shape=full_shape, offset=offset,
                       dim=dim, pieces=pieces)


def normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, full_shape: Sequence[int] | None = None,
            offset: Sequence[int] | None = None, dim: int = 0,
            pieces: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """Tp-invariant ``N(mean, std²)`` fill of a shard (see :func:`fill_tiled_`)."""
    return fill_tiled_(tensor, lambda t, g: t.normal_(mean, std, generator=g), full_shape=full_shape, offset=offset,
                       dim=dim, pieces=pieces)
