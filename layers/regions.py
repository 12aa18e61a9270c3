"""Megatron's ``f`` and ``g`` as modules, for models whose region boundaries are their own steps.

A module that feeds one replicated input to several column-parallel layers
(attention's Q, K and V; an MLP's up and gate projections) enters the
tensor-parallel region once with :class:`CopyToTP` (``f``) and builds the layers with
``copy_input=False``: one all-reduce of the summed input gradient serves them
all, and whatever runs inside the region, an adapter wrapped around a
projection included, contributes to that sum as it would in the dense model.
:class:`ReduceFromTP` sums partial results when they leave the region, e.g.
the token and position embeddings' partial lookups, added first and reduced once.

With sequence parallelism (:mod:`tensorpar.comm.sequence`) the same boundaries
move tokens instead: :class:`AllGatherSequence` (``f̄``) all-gathers this rank's
tokens into the region, :class:`ReduceScatterSequence` (``ḡ``) leaves it with
this rank's tokens of the sum. ``CopyToTP(sequence_parallel=True)`` is ``f̄`` at the
entry of a region whose input several column maps share: the module calls its
``copy_in`` whatever its layout, as torchtitan's ``PrepareModuleInput`` prepares
a module's input.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed import ProcessGroup

import tensorpar

from . import numerics


class ReduceFromTP(nn.Module):
    """``g``: the sum of the input over the tp group; backward passes the gradient through."""

    def __init__(self, *, group: ProcessGroup | None = None) -> None:
        super().__init__()
        self.tp_group = tensorpar.tp_group(group)
        self.tp = tensorpar.group_rank_size(self.tp_group)[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp == 1 else tensorpar.reduce_from_tp(x, self.tp_group)  # the identity on a group of one


class AllGatherSequence(nn.Module):
    """``f̄``: every rank's tokens, ``(..., T_r, C) -> (..., T, C)``; backward reduce-scatters the gradient.
    ``forward(x, seq_len=T)`` names the full length (else one small collective finds it)."""

    def __init__(self, *, group: ProcessGroup | None = None) -> None:
        super().__init__()
        self.tp_group = tensorpar.tp_group(group)

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        return tensorpar.all_gather_sequence(x, seq_len, self.tp_group)


class ReduceScatterSequence(nn.Module):
    """``ḡ``: this rank's tokens of the sum over the tp group, ``(..., T, C) -> (..., T_r, C)``;
    backward all-gathers the gradient."""

    def __init__(self, *, group: ProcessGroup | None = None) -> None:
        super().__init__()
        self.tp_group = tensorpar.tp_group(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tensorpar.reduce_scatter_sequence(x, self.tp_group)


class CopyToTP(nn.Module):
    """``f``: the entry of a tensor-parallel region, the input unchanged; backward all-reduces its gradient
    over the tp group. Several column-parallel maps may share it (attention's ``c_attn``, an MLP's up and
    gate projections, built with ``copy_input=False``).

    With ``sequence_parallel=True`` it is ``f̄`` on this rank's tokens ``(..., T_r, C)``: all of them
    ``(..., T, C)``, the gradient reduce-scattered (:class:`AllGatherSequence`; ``forward(x, seq_len=T)``
    names the full length, else one small collective finds it). :meth:`entered` gives the same input to
    the maps run inside its block, which with sequence parallelism keep only this rank's tokens for
    backward (:func:`tensorpar.save_sequence_shard`). In bitwise mode the gradient passes through: the
    column maps behind it sum the input gradient by their segments' tree.

    Example::

        with self.copy_in.entered(x, seq_len) as x:      # (B, T, C)
            up, gate = self.c_fc(x), self.c_gate(x)
    """

    def __init__(self, *, sequence_parallel: bool = False, group: ProcessGroup | None = None) -> None:
        super().__init__()
        self.tp_group = tensorpar.tp_group(group)
        self.tp = tensorpar.group_rank_size(self.tp_group)[1]
        self.sequence_parallel = sequence_parallel
        # f or f̄, or in bitwise mode what stands for them in front of maps that sum by their segments' tree
        self.enter = numerics.region_entry(self._entry, self.tp_group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        return self.enter(x, seq_len)

    def _entry(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        if self.sequence_parallel:
            return tensorpar.all_gather_sequence(x, seq_len, self.tp_group)  # f̄: (..., T, C)
        return x if self.tp == 1 else tensorpar.copy_to_tp(x, self.tp_group)  # f

    def entered(self, x: torch.Tensor, seq_len: int | None = None) -> contextlib.AbstractContextManager[torch.Tensor]:
        """The region's input, ``self(x, seq_len)``, for the block's maps; with sequence parallelism what
        they save of it for backward is kept as ``x``, this rank's tokens, and gathered again there."""
        full = self(x, seq_len)
        return _keeping_shard(full, x, self.tp_group) if self.sequence_parallel else contextlib.nullcontext(full)

    def extra_repr(self) -> str:
        return "sequence_parallel=True" if self.sequence_parallel else ""


@contextlib.contextmanager
def _keeping_shard(full: torch.Tensor, local: torch.Tensor, group: ProcessGroup) -> Iterator[torch.Tensor]:
    with tensorpar.save_sequence_shard(full, local, group):
        yield full


def summed_gradients(params: Iterable[torch.Tensor | None], group: ProcessGroup) -> list[torch.Tensor | None]:
    """``params`` as they are forward, their gradients summed over the tp group backward (``f`` on
    the parameters, one all-reduce for all): for replicated parameters that each rank applies to
    its own part of the data. ``None`` entries stay ``None``."""
    present = [p for p in params if p is not None]
    if not present or tensorpar.group_rank_size(group)[1] == 1:
        return list(params)
    flat = tensorpar.copy_to_tp(torch.cat([p.reshape(-1) for p in present]), group)
    views = iter(part.view_as(p) for part, p in zip(flat.split([p.numel() for p in present]), present, strict=True))
    return [None if p is None else next(views) for p in params]
