"""Megatron's ``f`` and ``g`` as modules, for models whose region boundaries are their own steps.

A module that feeds one replicated input to several column-parallel layers
(attention's Q, K and V; an MLP's up and gate projections) enters the
tensor-parallel region once with :class:`CopyToTP` and builds the layers with
``copy_input=False``: one all-reduce of the summed input gradient serves them
all, and whatever runs inside the region, an adapter wrapped around a
projection included, contributes to that sum as it would in the dense model.
:class:`ReduceFromTP` sums partial results when they leave the region, e.g.
the token and position embeddings' partial lookups, added first and reduced once.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

import tensorpar


class CopyToTP(nn.Module):
    """``f``: the input unchanged; backward all-reduces its gradient over the tp group."""

    def __init__(self, *, group: ProcessGroup | None = None) -> None:
        super().__init__()
        self.tp_group = tensorpar.tp_group(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tensorpar.copy_to_tp(x, self.tp_group)


class ReduceFromTP(nn.Module):
    """``g``: the sum of the input over the tp group; backward passes the gradient through."""

    def __init__(self, *, group: ProcessGroup | None = None) -> None:
        super().__init__()
        self.tp_group = tensorpar.tp_group(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tensorpar.reduce_from_tp(x, self.tp_group)
