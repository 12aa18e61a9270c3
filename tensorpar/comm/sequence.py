"""Sequence parallelism: Megatron's regions along the tokens (Korthikanti et al., 2022).

Outside its matmuls a transformer block (LayerNorm, dropout, residual adds) is
replicated by plain tensor parallelism. Sequence parallelism splits those
regions along the sequence instead, a balanced split of the ``T`` tokens
(``dim=-2`` of a ``(..., T, C)`` activation; 17 tokens at tp=4 → 5/4/4/4, and
fewer tokens than ranks leave some ranks none). The conjugate operators become:

* ``ḡ`` where ``g`` was: the row layer's partial sums are **reduce-scattered**
  into sequence shards (:func:`sequence_parallel_row_linear`);
* ``f̄`` where ``f`` was: sequence shards are **all-gathered** before a column
  layer, and its input gradient reduce-scattered in backward
  (:func:`sequence_parallel_column_linear`, or :func:`gather_sequence`
  shared by several column maps).

A reduce-scatter and an all-gather move what one all-reduce moves, so the
traffic is Megatron's; what a rank keeps for backward falls to ``1/tp``.
The gathered input of a column layer is not kept: each rank keeps its own
tokens and gathers them again in backward, as Megatron does (in the fused
map, overlapped with the input-gradient matmul; :func:`save_sequence_shard`
for a gather shared by several column maps): one all-gather per column region
more in backward, for ``(tp - 1) / tp`` of its input's memory.

Overlap: the column forward multiplies this rank's own tokens while the
others' arrive (collective matmul), its backward reduce-scatters the input
gradient while computing the weight gradient, and the row forward
reduce-scatters its output in column chunks, each on its way while the next
is computed. Chunks change no result beyond round-off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from ..mesh import exchange_ints, group_rank_size, tp_group
from ..sharding import check_int
from . import traced
from .collectives import in_background, start_all_gather_along, start_reduce_scatter_along
from .counter import active_counters, record
from .linear import _autocast, _check, _weight_grads
from .regions import _AllGather, _ReduceScatter, _ScatterToTP

SEQ_DIM = -2  # tokens: (..., T, C)
ROW_CHUNKS = 2  # column chunks of a row layer's output, each reduce-scattered while the next is computed


def sequence_sizes(seq_len: int, tp: int) -> list[int]:
    """Tokens per rank of the balanced split of ``seq_len`` tokens over ``tp`` ranks (larger shards
    first; ranks past ``seq_len`` hold none). ``sequence_sizes(17, 4) == [5, 4, 4, 4]``."""
    check_int(seq_len, "sequence length")
    base, extra = divmod(seq_len, tp)
    return [base + (r < extra) for r in range(tp)]


def sequence_length(x: torch.Tensor, seq_len: int | None, group: ProcessGroup | None = None) -> int:
    """The full sequence length of sequence shards ``x`` (``(..., T_r, C)``): ``seq_len`` when given,
    else found from every rank's shard (one small collective), which must be a balanced split."""
    if seq_len is not None:
        check_int(seq_len, "seq_len")
        return seq_len
    group = tp_group(group)
    _check_tokens("sequence_length", x)
    if group_rank_size(group)[1] == 1:
        return x.shape[SEQ_DIM]
    held = [row[0] for row in exchange_ints([x.shape[SEQ_DIM]], group, x.device)]
    if held != sequence_sizes(sum(held), len(held)):
        raise ValueError(f"the ranks hold {held} tokens, which is not the balanced split of {sum(held)} tokens "
                         f"over {len(held)} ranks ({sequence_sizes(sum(held), len(held))})")
    return sum(held)


def _check_tokens(op: str, x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op} expects a tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{op} expects tokens along dim -2, (..., T, C); got shape {tuple(x.shape)}")


def gather_sequence(x: torch.Tensor, seq_len: int | None = None, group: ProcessGroup | None = None) -> torch.Tensor:
    """``f̄``: every rank's tokens ``(..., T_r, C)`` concatenated, ``(..., T, C)``; backward
    reduce-scatters the gradient. ``seq_len``: as in :func:`sequence_length`."""
    _check_tokens("gather_sequence", x)
    group, _, n = _tp(group)
    seq_len = sequence_length(x, seq_len, group)
    return x if n == 1 else _AllGather.apply(x, SEQ_DIM, sequence_sizes(seq_len, n), group)


def reduce_scatter_sequence(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """``ḡ``: this rank's tokens of the sum of ``x`` ``(..., T, C)`` over the group, ``(..., T_r, C)``;
    backward all-gathers the gradient."""
    _check_tokens("reduce_scatter_sequence", x)
    group, _, n = _tp(group)
    return x if n == 1 else _ReduceScatter.apply(x, SEQ_DIM, sequence_sizes(x.shape[SEQ_DIM], n), group)


def scatter_sequence(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """This rank's tokens of a replicated ``x`` ``(..., T, C)``; backward all-gathers the gradient."""
    _check_tokens("scatter_sequence", x)
    group, _, n = _tp(group)
    sizes = sequence_sizes(x.shape[SEQ_DIM], n)
    return x if n == 1 else _ScatterToTP.apply(x, SEQ_DIM, sizes, group)


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """``f̄`` + linear: all-gather the tokens and multiply; backward, the input gradient reduce-scattered."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int],
                group: ProcessGroup) -> torch.Tensor:
        x, weight, bias = _autocast(x, weight, bias)
        rank = group_rank_size(group)[0]
        ctx.save_for_backward(x, weight)  # this rank's tokens only: gathered again in backward
        ctx.sizes, ctx.group, ctx.counters, ctx.has_bias = sizes, group, active_counters(), bias is not None
        gathering = start_all_gather_along(x, SEQ_DIM, sizes, group)
        with torch.autocast(x.device.type, enabled=False):
            mine = F.linear(x, weight, bias)  # (..., T_r, out / tp), while the other ranks' tokens arrive
            full = gathering.wait()  # (..., T, in)
            offsets = [sum(sizes[:r]) for r in range(len(sizes))]
            parts = [mine if r == rank else F.linear(full.narrow(SEQ_DIM, offsets[r], s), weight, bias)
                     for r, s in enumerate(sizes)]
        return torch.cat(parts, SEQ_DIM)  # (..., T, out / tp)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        sizes, group, counters = ctx.sizes, ctx.group, ctx.counters
        gathering = start_all_gather_along(x, SEQ_DIM, sizes, group, counters) if needs[1] else None
        scattering = None
        if needs[0]:  # the input gradient while the tokens arrive, then reduce-scattered
            scattering = start_reduce_scatter_along(grad @ weight, SEQ_DIM, sizes, group, counters)  # (..., T, in)
        full = gathering.wait() if gathering is not None else x.new_empty(0, x.shape[-1])
        grad_w, grad_b = _weight_grads(grad, full.reshape(-1, x.shape[-1]), needs[1], ctx.has_bias and needs[2])
        return (scattering.wait() if scattering else None), grad_w, grad_b, None, None


class _SequenceParallelRowLinear(torch.autograd.Function):
    """linear + ``ḡ``: partial products reduce-scattered along the tokens, then the bias; backward,
    the output gradient all-gathered."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int],
                group: ProcessGroup) -> torch.Tensor:
        x, weight, bias = _autocast(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.sizes, ctx.group, ctx.counters, ctx.has_bias = sizes, group, active_counters(), bias is not None
        background = not traced.tracing() and in_background(x, group)  # else chunks would only add rounds
        chunks = weight.split(-(-weight.shape[0] // ROW_CHUNKS)) if background else (weight,)
        tokens, n = x[..., :1].numel(), len(sizes)  # (...) * T
        record("reduce_scatter", x.dtype, tokens * weight.shape[0], n,
               padding=tokens // sum(sizes) * (n * max(sizes) - sum(sizes)) * weight.shape[0])
        with torch.autocast(x.device.type, enabled=False):
            pending = [start_reduce_scatter_along(F.linear(x, w), SEQ_DIM, sizes, group, counted=False)
                       for w in chunks]  # (..., T, out / chunks) each, this rank's partial sums
            y = torch.cat([p.wait() for p in pending], -1)  # (..., T_r, out), summed over ranks
        return y if bias is None else y.add_(bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        full = start_all_gather_along(grad.contiguous(), SEQ_DIM, ctx.sizes, ctx.group, ctx.counters).wait()
        grad_x = full @ weight if needs[0] else None  # (..., T, in / tp)
        # every rank has every token's output gradient: the bias gradient is whole, the same on every rank
        grad_w, grad_b = _weight_grads(full, x.reshape(-1, x.shape[-1]), needs[1], ctx.has_bias and needs[2])
        return grad_x, grad_w, grad_b, None, None


def _tp(group: ProcessGroup | None) -> tuple[ProcessGroup, int, int]:
    group = tp_group(group)
    return (group, *group_rank_size(group))


def sequence_parallel_column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                                    seq_len: int | None = None, group: ProcessGroup | None = None) -> torch.Tensor:
    """Column-parallel linear map of sequence shards: ``x`` ``(..., T_r, in)`` this rank's tokens, ``weight``
    this rank's rows ``(out / tp, in)``; returns ``(..., T, out / tp)``, every token.

    Equal to ``F.linear(all_gather(x, -2, seq_len), weight, bias)``. ``seq_len`` is the full
    sequence length (found with one small collective when not given).
    """
    _check("sequence_parallel_column_linear", x, weight, bias)
    _check_tokens("sequence_parallel_column_linear", x)
    group, _, n = _tp(group)
    seq_len = sequence_length(x, seq_len, group)
    if n == 1:
        return F.linear(x, weight, bias)
    return _SequenceParallelColumnLinear.apply(x, weight, bias, sequence_sizes(seq_len, n), group)


def sequence_parallel_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                                 group: ProcessGroup | None = None) -> torch.Tensor:
    """Row-parallel linear map into sequence shards: ``x`` ``(..., T, in / tp)`` every token,
    ``weight`` this rank's columns ``(out, in / tp)``; returns ``(..., T_r, out)``, this rank's tokens
    of the sum over the group, the bias added once.

    Equal to ``reduce_scatter(F.linear(x, weight), -2) + bias``.
    """
    _check("sequence_parallel_row_linear", x, weight, bias)
    _check_tokens("sequence_parallel_row_linear", x)
    group, _, n = _tp(group)
    if n == 1:
        return F.linear(x, weight, bias)
    return _SequenceParallelRowLinear.apply(x, weight, bias, sequence_sizes(x.shape[SEQ_DIM], n), group)


class _Regather:
    """The gathered tokens of one forward's all-gather, gathered again (once) when backward first needs
    them and let go with their last user."""

    def __init__(self, full: torch.Tensor, group: ProcessGroup) -> None:
        self.group, self.counters = group, active_counters()
        self.sizes = sequence_sizes(full.shape[SEQ_DIM], group_rank_size(group)[1])
        self.offset = full.storage_offset()
        self.users, self._full = 0, None

    def full(self, local: torch.Tensor) -> torch.Tensor:
        if self._full is None:  # the forward's call again: the same layout
            self._full = start_all_gather_along(local, SEQ_DIM, self.sizes, self.group, self.counters).wait()
        full = self._full
        self.users -= 1
        if self.users <= 0:  # the last user: let the gathered tokens go with it
            self._full = None
        return full


class _SavedShard:
    """What is saved in place of a view of the gathered tokens: this rank's tokens and the view."""

    def __init__(self, regather: _Regather, local: Any, view: torch.Tensor) -> None:
        self.regather, self.local = regather, local
        self.shape, self.stride, self.offset = view.shape, view.stride(), view.storage_offset()

    def unpack(self, local: torch.Tensor) -> torch.Tensor:
        full = self.regather.full(local)
        return full.as_strided(self.shape, self.stride, full.storage_offset() + self.offset - self.regather.offset)


@contextlib.contextmanager
def save_sequence_shard(full: torch.Tensor, local: torch.Tensor,
                        group: ProcessGroup | None = None) -> Iterator[None]:
    """Inside the block, whatever autograd saves of ``full`` (the all-gather of the sequence shards
    ``local``) is kept as ``local`` and gathered again, once for all its users, when backward first
    needs it. It composes with saved-tensor policies already active (activation checkpointing,
    offloading, measurement hooks): they are handed ``local`` instead of ``full``. While
    ``torch.compile`` traces, it does nothing (the compiler decides what is kept).

    Example::

        x = tensorpar.gather_sequence(shard, seq_len)       # (B, T, C) from (B, T_r, C)
        with tensorpar.save_sequence_shard(x, shard):
            q, k, v = q_proj(x), k_proj(x), v_proj(x)       # each keeps (B, T_r, C) for backward
    """
    group, _, n = _tp(group)
    if n == 1 or not full.requires_grad or traced.tracing():
        yield
        return
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (lambda t: t, lambda t: t)
    regather, storage = _Regather(full, group), full.untyped_storage()
    local = local.detach()

    def pack(t: torch.Tensor) -> Any:
        if t.device == full.device and t.untyped_storage().data_ptr() == storage.data_ptr():
            regather.users += 1
            return _SavedShard(regather, outer_pack(local), t)
        return outer_pack(t)

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _SavedShard):
            return packed.unpack(outer_unpack(packed.local))
        return outer_unpack(packed)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
