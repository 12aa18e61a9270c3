"""Sequence parallelism: Megatron's regions along the tokens (Korthikanti et al., 2022).

The regions outside a block's matmuls (LayerNorm, dropout, residual adds) are split along the sequence,
a balanced split of the ``T`` tokens (dim -2 of ``(..., T, C)``; 17 tokens at tp=4 → 5/4/4/4; fewer tokens
than ranks leave some none). ``ḡ`` replaces ``g``: the row layer's partial sums are **reduce-scattered**
into sequence shards; ``f̄`` replaces ``f``: the shards are **all-gathered** before a column layer, its
input gradient reduce-scattered. Gathers are named by their backward as in :mod:`tensorpar.comm.regions`.

The traffic is Megatron's (a reduce-scatter and an all-gather move what one all-reduce moves). A column
layer keeps only this rank's tokens for backward and gathers them again there (``save_sequence_shard``
for a gather shared by several maps), while computing the input gradient, which it reduce-scatters while
computing the weight gradient. Its forward multiplies all the tokens after the gather (overlapping the
gather with this rank's tokens' matmul measured 3-6% slower at GPT-2 widths on gloo).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from ..checks import check_int
from ..mesh import tp_group
from ..sharding import partition_sizes
from ..world import exchange_ints
from .collectives import start_all_gather_along, start_reduce_scatter_along
from .linear import add_bias, autocast_inputs, autocast_off, check_linear_args, weight_grads
from .regions import Region, tp_group_rank_size

SEQ_DIM = -2  # tokens: (..., T, C)


def sequence_sizes(seq_len: int, tp: int) -> list[int]:
    """Tokens per rank of the balanced split of ``seq_len`` tokens over ``tp`` ranks (larger shards
    first; ranks past ``seq_len`` hold none). ``sequence_sizes(17, 4) == [5, 4, 4, 4]``."""
    return partition_sizes(seq_len, tp, name="sequence length", allow_empty=True)


def sequence_length(x: torch.Tensor, seq_len: int | None, group: ProcessGroup | None = None) -> int:
    """The full sequence length of sequence shards ``x`` (``(..., T_r, C)``): ``seq_len`` when given,
    else found from every rank's shard (one small collective), which must be a balanced split. A
    given ``seq_len`` is trusted: a rank whose shard does not fit it raises in the collective that
    follows, or the collective mismatches (see :mod:`tensorpar.comm.collectives`)."""
    if seq_len is not None:
        check_int(seq_len, "seq_len")
        return seq_len
    group = tp_group(group)
    check_tokens("sequence_length", x)
    if group.size() == 1:
        return x.shape[SEQ_DIM]
    held = [row[0] for row in exchange_ints([x.shape[SEQ_DIM]], group, x.device)]
    if held != sequence_sizes(sum(held), len(held)):
        raise ValueError(f"the ranks hold {held} tokens, which is not the balanced split of {sum(held)} tokens "
                         f"over {len(held)} ranks ({sequence_sizes(sum(held), len(held))})")
    return sum(held)


def check_tokens(op: str, x: object) -> None:
    """Raise unless ``x`` is a tensor with tokens along dim -2."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op} expects a tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{op} expects tokens along dim -2, (..., T, C); got shape {tuple(x.shape)}")


def _sequence_region(op: str, forward: str, backward: str, x: torch.Tensor, group: ProcessGroup | None,
                     seq_len: int | None = None, *, gathered: bool = False, cast: bool = False) -> torch.Tensor:
    """``x`` through :class:`~tensorpar.comm.regions.Region` along the tokens (``x`` itself at tp = 1),
    split as the gathered ``seq_len`` (see :func:`sequence_length`) or as ``x``'s own tokens; ``cast``:
    cast first as autocast would."""
    check_tokens(op, x)
    group, _, n = tp_group_rank_size(group)
    seq_len = sequence_length(x, seq_len, group) if gathered else x.shape[SEQ_DIM]
    if n == 1:
        return x
    x = autocast_inputs(x)[0] if cast else x  # the matmuls after a gather would cast it anyway: half the bytes
    return Region.apply(x, forward, backward, SEQ_DIM, sequence_sizes(seq_len, n), group)


def all_gather_sequence(x: torch.Tensor, seq_len: int | None = None, group: ProcessGroup | None = None
                        ) -> torch.Tensor:
    """``f̄``: every rank's tokens ``(..., T_r, C)`` concatenated, ``(..., T, C)``; backward
    reduce-scatters the gradient (the conjugate of :func:`reduce_scatter_sequence`). ``seq_len``: as in
    :func:`sequence_length`. Under autocast the tokens are cast to its dtype first, as the column maps
    after the gather would."""
    return _sequence_region("all_gather_sequence", "all_gather", "reduce_scatter", x, group, seq_len,
                            gathered=True, cast=True)


def gather_sequence(x: torch.Tensor, seq_len: int | None = None, group: ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's tokens ``(..., T_r, C)`` concatenated, ``(..., T, C)``; backward keeps this rank's tokens
    of a gradient already summed over the group (by the bitwise mode's column maps), the conjugate of
    :func:`scatter_sequence`. Under autocast the tokens travel in their own dtype."""
    return _sequence_region("gather_sequence", "all_gather", "slice", x, group, seq_len, gathered=True)


def reduce_scatter_sequence(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """``ḡ``: this rank's tokens of the sum of ``x`` ``(..., T, C)`` over the group, ``(..., T_r, C)``;
    backward all-gathers the gradient."""
    return _sequence_region("reduce_scatter_sequence", "reduce_scatter", "all_gather", x, group)


def scatter_sequence(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """This rank's tokens of a replicated ``x`` ``(..., T, C)``; backward all-gathers the gradient."""
    return _sequence_region("scatter_sequence", "slice", "all_gather", x, group)


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """``f̄`` + linear: all-gather the tokens and multiply; backward, the input gradient reduce-scattered."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int],
                group: ProcessGroup) -> torch.Tensor:
        x, weight, bias = autocast_inputs(x, weight, bias)
        ctx.save_for_backward(x, weight)  # this rank's tokens only: gathered again in backward
        ctx.sizes, ctx.group, ctx.has_bias = sizes, group, bias is not None
        full = start_all_gather_along(x, SEQ_DIM, sizes, group).wait()  # (..., T, in)
        with autocast_off(x):
            return F.linear(full, weight, bias)  # (..., T, out / tp)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        sizes, group = ctx.sizes, ctx.group
        gathering = start_all_gather_along(x, SEQ_DIM, sizes, group) if needs[1] else None
        scattering = None
        if needs[0]:  # the input gradient while the tokens arrive, then reduce-scattered
            scattering = start_reduce_scatter_along(grad @ weight, SEQ_DIM, sizes, group)  # (..., T, in)
        full = gathering.wait() if gathering is not None else x.new_empty(0, x.shape[-1])
        grad_w, grad_b = weight_grads(grad, full.reshape(-1, x.shape[-1]), needs[1], ctx.has_bias and needs[2])
        return (scattering.wait() if scattering else None), grad_w, grad_b, None, None


class _SequenceParallelRowLinear(torch.autograd.Function):
    """linear + ``ḡ``: partial products reduce-scattered along the tokens, then the bias; backward,
    the output gradient all-gathered."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int],
                group: ProcessGroup) -> torch.Tensor:
        x, weight, bias = autocast_inputs(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.sizes, ctx.group, ctx.has_bias = sizes, group, bias is not None
        with autocast_off(x):  # (..., T, out) partial sums, then this rank's tokens
            y = start_reduce_scatter_along(F.linear(x, weight), SEQ_DIM, sizes, group).wait()  # (..., T_r, out)
        return add_bias(y, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        full = start_all_gather_along(grad.contiguous(), SEQ_DIM, ctx.sizes, ctx.group).wait()
        grad_x = full @ weight if needs[0] else None  # (..., T, in / tp)
        # every rank has every token's output gradient: the bias gradient is whole, the same on every rank
        grad_w, grad_b = weight_grads(full, x.reshape(-1, x.shape[-1]), needs[1], ctx.has_bias and needs[2])
        return grad_x, grad_w, grad_b, None, None


def sequence_parallel_column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                                    seq_len: int | None = None, group: ProcessGroup | None = None) -> torch.Tensor:
    """``F.linear(all_gather_sequence(x, seq_len), weight, bias)``: ``x`` ``(..., T_r, in)`` this rank's tokens,
    ``weight`` this rank's rows ``(out / tp, in)``; returns ``(..., T, out / tp)``, every token."""
    check_linear_args("sequence_parallel_column_linear", x, weight, bias)
    check_tokens("sequence_parallel_column_linear", x)
    group, _, n = tp_group_rank_size(group)
    seq_len = sequence_length(x, seq_len, group)
    if n == 1:
        return F.linear(x, weight, bias)
    return _SequenceParallelColumnLinear.apply(x, weight, bias, sequence_sizes(seq_len, n), group)


def sequence_parallel_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                                 group: ProcessGroup | None = None) -> torch.Tensor:
    """``reduce_scatter(F.linear(x, weight), -2) + bias``: ``x`` ``(..., T, in / tp)`` every token, ``weight``
    this rank's columns ``(out, in / tp)``; returns ``(..., T_r, out)``, this rank's tokens, the bias added once."""
    check_linear_args("sequence_parallel_row_linear", x, weight, bias)
    check_tokens("sequence_parallel_row_linear", x)
    group, _, n = tp_group_rank_size(group)
    if n == 1:
        return F.linear(x, weight, bias)
    return _SequenceParallelRowLinear.apply(x, weight, bias, sequence_sizes(x.shape[SEQ_DIM], n), group)
