"""Megatron's regions: the autograd collectives over the tensor-parallel group.

Megatron-LM (Shoeybi et al., 2019) names two conjugate operators: ``f`` = :func:`copy_to_tp` (identity
forward, all-reduce backward) enters a region whose input is replicated; ``g`` = :func:`reduce_from_tp`
(all-reduce forward, identity backward) leaves it, each rank holding a partial sum.

Scatter/gather move a tensor between replicated and sharded along ``dim``; reduce-scatter/all-gather do
the same where the replicated side holds partial sums. Each gather is named by its backward, here and in
:mod:`tensorpar.comm.sequence`: ``gather_*`` (the conjugate of ``scatter_*``) keeps this rank's slice of
a gradient already whole on every rank; ``all_gather*`` (the conjugate of ``reduce_scatter*``)
reduce-scatters it. Every function takes ``group=None`` (the default mesh's tp group), is the identity at
tp = 1, checks its arguments alike on every rank before any collective, and is first-order only (a double
backward raises).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from ..checks import check_int
from ..mesh import tp_group
from ..sharding import partition_sizes
from .collectives import all_gather_along, all_reduce_sum, reduce_scatter_along


def _move(op: str, x: torch.Tensor, dim: int, sizes: list[int], group: ProcessGroup) -> torch.Tensor:
    """``x`` after ``op``: ``"identity"``, ``"all_reduce"``, ``"slice"`` (this rank's ``sizes[rank]`` along
    ``dim``, a view), ``"all_gather"`` or ``"reduce_scatter"`` (along ``dim``, split as ``sizes``)."""
    if op == "all_reduce":
        return all_reduce_sum(x, group)
    if op == "slice":
        rank = group.rank()
        return x.narrow(dim, sum(sizes[:rank]), sizes[rank])
    if op == "all_gather":
        return all_gather_along(x, dim, sizes, group)
    if op == "reduce_scatter":
        return reduce_scatter_along(x, dim, sizes, group)
    return x


class Region(torch.autograd.Function):
    """``forward`` on the input, ``backward`` on its gradient (two ops of :func:`_move`): ``f`` is
    ``("identity", "all_reduce")``, ``g`` ``("all_reduce", "identity")``, scatter ``("slice", "all_gather")``,
    gather ``("all_gather", "slice")``, reduce-scatter and all-gather each other's conjugate."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward: str, backward: str, dim: int, sizes: list[int],
                group: ProcessGroup) -> torch.Tensor:
        ctx.backward_op, ctx.dim, ctx.sizes, ctx.group = backward, dim, sizes, group
        y = _move(forward, x, dim, sizes, group)
        return y.clone(memory_format=torch.contiguous_format) if forward == "slice" else y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _move(ctx.backward_op, grad, ctx.dim, ctx.sizes, ctx.group), None, None, None, None, None


def tp_group_rank_size(group: ProcessGroup | None) -> tuple[ProcessGroup, int, int]:
    """The tp group (``group``, or the default mesh's) with this rank in it and its size."""
    group = tp_group(group)
    return group, group.rank(), group.size()


def _region(op: str, forward: str, backward: str, x: torch.Tensor, group: ProcessGroup | None,
            dim: int | None = None, size: int | None = None, unit: int = 1) -> torch.Tensor:
    """``x`` through :class:`Region` (``x`` itself at tp = 1) after checks alike on every rank, split along
    ``dim`` as ``x``'s own size there (in whole units of ``unit``) or, given (a gather), as ``size``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op} expects a tensor, got {type(x).__name__}")
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
        raise TypeError(f"{op}: dim must be an integer, got {dim!r}")
    if dim is not None and not -x.dim() <= dim < x.dim():
        raise ValueError(f"{op}: dim {dim} is out of range for a {x.dim()}-d tensor "
                         f"(expected a dim in [{-x.dim()}, {x.dim()}))")
    check_int(unit, f"{op}: unit")
    group, _, n = tp_group_rank_size(group)
    sizes: list[int] = []
    if dim is not None and size is None:  # the balanced split of a full (replicated or summed) x
        sizes = partition_sizes(x.shape[dim], n, unit=unit, name=f"size of dim {dim}")
    elif dim is not None and size is not None:  # the balanced split of the gathered size
        check_int(size, f"{op}: size")
        if n == 1 and x.shape[dim] != size:
            raise ValueError(f"{op}: size {size} does not match dim {dim} of a tensor of shape "
                             f"{tuple(x.shape)} at tp 1")
        sizes = partition_sizes(size, n, name="gathered size")
    if n == 1 or (forward == "identity" and not torch.is_grad_enabled()):  # f without gradients: x itself
        return x
    return Region.apply(x, forward, backward, dim or 0, sizes, group)


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Megatron's ``f``: ``x`` unchanged; backward all-reduces the gradient over the tp group."""
    return _region("copy_to_tp", "identity", "all_reduce", x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Megatron's ``g``: the sum of ``x`` over the tp group; backward passes the gradient through."""
    return _region("reduce_from_tp", "all_reduce", "identity", x, group)


def scatter_to_tp(x: torch.Tensor, dim: int = -1, group: ProcessGroup | None = None, *,
                  unit: int = 1) -> torch.Tensor:
    """This rank's balanced slice (in whole units of ``unit``) of a replicated ``x`` along ``dim``;
    backward all-gathers."""
    return _region("scatter_to_tp", "slice", "all_gather", x, group, dim, unit=unit)


def gather_from_tp(x: torch.Tensor, dim: int, size: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's balanced shard along ``dim`` into the full ``size``; backward keeps this
    rank's slice. ``size`` is required: shards need not be equal."""
    return _region("gather_from_tp", "all_gather", "slice", x, group, dim, size)


def reduce_scatter(x: torch.Tensor, dim: int = 0, group: ProcessGroup | None = None) -> torch.Tensor:
    """This rank's balanced slice along ``dim`` of the sum of ``x``; backward all-gathers."""
    return _region("reduce_scatter", "reduce_scatter", "all_gather", x, group, dim)


def all_gather(x: torch.Tensor, dim: int, size: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's shard along ``dim`` into the full ``size`` (as :func:`gather_from_tp`);
    backward reduce-scatters the gradient."""
    return _region("all_gather", "all_gather", "reduce_scatter", x, group, dim, size)
