"""The unsharded gradient's squared norm, the same bits at every tp (the bitwise mode's clipping).

One term per (parameter, canonical segment of its split dim: its module's ``product.placed``, else cut by
its placement), one per replicated parameter. Each rank computes its own segments' terms (every rank the
replicated ones), the ranks all-gather them (one small collective), and every rank adds all terms in one
fixed order with one sum.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..comm.collectives import all_gather_along
from ..full import is_dtensor
from ..mesh import group_rank_size
from ..sharding import Shard
from .linear import fixed
from .segments import PlacedTree, placed_split
from .settings import Bitwise


def _segments(model: nn.Module, mode: Bitwise, placements: Mapping[str, tuple[Shard, ProcessGroup]]
              ) -> dict[str, tuple[int, PlacedTree]]:
    """``{parameter name: (split dim, its segments)}`` for the split parameters ``placements`` of ``model``."""
    found = {}
    for name, (placement, group) in placements.items():
        module = model.get_submodule(name.rpartition(".")[0])
        own = getattr(getattr(module, "product", None), "placed", None)  # attention's follow its heads' layouts
        rank, tp = group_rank_size(group)
        placed = own if isinstance(own, PlacedTree) else placed_split(placement.pieces, placement.size, tp, rank,
                                                                      mode.tp_sizes)
        found[name] = (placement.dim, placed)
    return found


def squared_norm(model: nn.Module, mode: Bitwise, placements: Mapping[str, tuple[Shard, ProcessGroup]],
                 group: ProcessGroup, exclude: Collection[str] = ()) -> torch.Tensor:
    """``Σ_p ‖∇p‖²`` of the unsharded model, whose split parameters are ``placements``
    (:func:`tensorpar.full.placements`): float32, float64 where a gradient is float64 (as torch's norm of
    the unsharded model), the same on every rank of ``group``: a collective."""
    rank, tp = group_rank_size(group)
    split = _segments(model, mode, placements)
    terms: list[tuple[int, torch.Tensor | None]] = []  # (holder: -1 for every rank, value where computed here)
    device, dtype = None, torch.float32
    for name, p in model.named_parameters():
        if p.grad is None or name in exclude:
            continue
        grad = p.grad
        if is_dtensor(grad):
            raise ValueError(f"bitwise gradient norm: {name}'s gradient is a {type(grad).__name__}; the mode "
                             "takes plain tensors (FSDP2's sharding is not supported)")
        device = grad.device
        if grad.dtype == torch.float64:
            dtype = torch.float64
        if name not in split:
            terms.append((-1, _squares(grad)))
            continue
        dim, placed = split[name]
        local = {s: (lo, n) for s, lo, n in placed.local}
        squares = _wide(grad).square() if local else None  # each element's square, once (exact: any layout)
        for s, holders in enumerate(placed.holders):
            if len(holders) not in (1, tp):
                raise ValueError(f"bitwise gradient norm: {name}'s segment {s} is held by ranks {sorted(holders)}")
            holder = -1 if len(holders) == tp else next(iter(holders))
            value = fixed(squares.narrow(dim, *local[s])).sum() if squares is not None and holder in (-1, rank) \
                else None
            terms.append((holder, value))
    if device is None:
        return torch.zeros((), dtype=torch.float32)
    theirs = [sum(1 for holder, _ in terms if holder == r) for r in range(tp)]
    if tp > 1 and any(theirs):  # every rank joins when any rank has terms for the others
        mine = [value for holder, value in terms if holder == rank and value is not None]
        stacked = torch.stack(mine).to(dtype) if mine else torch.zeros(0, dtype=dtype, device=device)
        gathered = all_gather_along(stacked, 0, theirs, group).split(theirs)  # every rank's own terms, in order
        queues = [list(part.unbind(0)) for part in gathered]
        values = [value if holder == -1 else queues[holder].pop(0) for holder, value in terms]
    else:
        values = [value for _, value in terms]
    known = [v.to(dtype) for v in values if v is not None]
    assert len(known) == len(terms), "every term is computed here or received"
    return torch.stack(known).sum()  # one vector, in one order, at every tp


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 (float64 for float64)."""
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


def _squares(t: torch.Tensor) -> torch.Tensor:
    """``Σ t²`` of a contiguous, aligned copy of ``t``, in float32 (float64 for float64)."""
    return fixed(_wide(t).square()).sum()
