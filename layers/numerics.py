"""The numerics a layer computes in, chosen once, when it is built: its default computation, or the
bitwise mode's twin of it (:mod:`tensorpar.bitwise`), which computes the same bits at every tp of the mode.

A layer asks here once, in ``__init__``, giving its default computation; it keeps what it gets and
calls it in its forward, which has one path whatever the mode. Outside the mode
(:func:`tensorpar.current_bitwise` is ``None`` while the layer is built) every function here returns
the default unchanged. In the mode:

* column- and row-parallel products run one product per canonical segment of the split dim, their
  sums (the row product, the column's input gradient) added by the segments' tree in place of ``g``
  and ``f`` (:class:`SegmentedColumn`, :class:`SegmentedRow`); a region entry in front of column maps
  is then the identity, or with sequence parallelism a gather whose backward keeps this rank's tokens;
* elementwise activations run one segment at a time (:class:`SegmentwiseActivation`), attention one
  head at a time (:class:`HeadByHead`), and LayerNorm adds its weight and bias gradients over the
  tokens by segments of the sequence (:class:`TokenwiseNorm`);
* a model built in the mode says so (``model.numerics``, see :func:`mark`): its gradient norm
  (:func:`tensorpar.clip_grad_norm_`) and its loss follow.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

import tensorpar
from tensorpar.bitwise import Bitwise
from tensorpar.bitwise.linear import blockwise, by_segment, segmented_column_linear, segmented_row_linear
from tensorpar.bitwise.norm import tokenwise_layer_norm
from tensorpar.bitwise.segments import Piece, PlacedTree, placed_split, placed_tokens
from tensorpar.checks import check_int
from tensorpar.comm.collectives import all_gather_along
from tensorpar.sharding import Shard

from .heads import HeadLayout, attention_dropped, head_layout

T = TypeVar("T")
#: every rank's pieces ``(offset, length)`` of a split dim at a tp: ``pieces_at(tp, rank)``
PiecesAt = Callable[[int, int], Sequence[Piece]]


def _mode() -> Bitwise | None:
    return tensorpar.current_bitwise()


def chosen(default: T, twin: Callable[[], T]) -> T:
    """``default``, or in the bitwise mode what ``twin()`` builds."""
    return default if _mode() is None else twin()


def adds_tokens_by_segments() -> bool:
    """Whether layers built now add their sums over tokens by segments of the sequence (the bitwise mode)."""
    return _mode() is not None


def mark(model: nn.Module) -> nn.Module:
    """Record on ``model`` (a model built or converted here) the bitwise mode it computes in, as
    ``model.numerics``, where :func:`tensorpar.clip_grad_norm_` and the loss read it (once)."""
    mode = _mode()
    if mode is not None:
        model.numerics = mode
    return model


# ---------------------------------------------------------------- linear maps


class SegmentedColumn:
    """Column-parallel ``x Wᵀ + b`` by the segments ``placed`` of the output features, a callable
    ``(x, weight, bias, seq_len)``; backward, the input gradient's tree sum over the group stands for
    ``f``, whether the layer applies ``f`` itself or a region entry in front of it would (which is then
    the identity: :func:`region_entry`). With sequence parallelism the tokens are all-gathered first,
    backward keeping this rank's. Replicated rows must be given whole gradients (attention sums its
    key/value gradients by the tree before they reach here)."""

    def __init__(self, placed: PlacedTree, group: ProcessGroup, sequence_parallel: bool) -> None:
        self.placed, self.group, self.sequence_parallel = placed, group, sequence_parallel

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 seq_len: int | None = None) -> torch.Tensor:
        if self.sequence_parallel:  # (..., T_r, in) -> (..., T, in); backward keeps this rank's tokens
            x = tensorpar.all_gather_sequence(x, seq_len, self.group)
        return segmented_column_linear(x, weight, bias, self.placed, self.group)  # (*, out / tp)


class SegmentedRow:
    """Row-parallel ``Σ_ranks x Wᵀ + b`` by the segments ``placed`` of the input features, summed by their
    tree, a callable ``(x, weight, bias)``; the bias gradient by segments of the tokens (every token is
    here: no collective). With sequence parallelism each rank keeps its tokens of the sum."""

    def __init__(self, placed: PlacedTree, group: ProcessGroup, sequence_parallel: bool, tp_sizes: Sequence[int]
                 ) -> None:
        self.placed, self.group, self.sequence_parallel, self.tp_sizes = placed, group, sequence_parallel, tp_sizes

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        tokens = placed_tokens(x.shape[-2] if x.dim() > 1 else 1, self.placed.tp, self.placed.rank, self.tp_sizes,
                               split=False)
        y = segmented_row_linear(x, weight, bias, self.placed, tokens, self.group)  # (*, out)
        return tensorpar.scatter_sequence(y, self.group) if self.sequence_parallel else y


def _placed(placement: Shard, group: ProcessGroup, mode: Bitwise, pieces_at: PiecesAt | None) -> PlacedTree:
    rank, tp = tensorpar.group_rank_size(group)
    return placed_split(pieces_at or placement.pieces, placement.size, tp, rank, mode.tp_sizes)


def column(default: T, placement: Shard, group: ProcessGroup, *,
           sequence_parallel: bool = False) -> T | SegmentedColumn:
    """A column-parallel layer's product: ``default``, or by the canonical segments of ``placement``."""
    mode = _mode()
    return default if mode is None else SegmentedColumn(_placed(placement, group, mode, None), group,
                                                        sequence_parallel)


def row(default: T, placement: Shard, group: ProcessGroup, *, sequence_parallel: bool = False) -> T | SegmentedRow:
    """A row-parallel layer's product: ``default``, or by the canonical segments of ``placement``."""
    mode = _mode()
    return default if mode is None else SegmentedRow(_placed(placement, group, mode, None), group,
                                                     sequence_parallel, mode.tp_sizes)


def region_entry(default: T, group: ProcessGroup, *, sequence_parallel: bool = False) -> T | Callable[..., Any]:
    """The entry of a region of column maps (``f``, or ``f̄`` with sequence parallelism): ``default``, or
    in the bitwise mode, where the maps sum the input gradient by their segments' tree, the identity (with
    sequence parallelism, the gather whose backward keeps this rank's tokens)."""
    if _mode() is None:
        return default
    if sequence_parallel:
        return functools.partial(_gathered_tokens, group=group)
    return _identity


def _gathered_tokens(x: torch.Tensor, seq_len: int | None = None, *, group: ProcessGroup) -> torch.Tensor:
    return tensorpar.all_gather_sequence(x, seq_len, group)  # (..., T_r, C) -> (..., T, C)


def _identity(x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
    return x


# ---------------------------------------------------------------- elementwise maps and norms


def _applied(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return fn(x)


class BySegment:
    """``fn(x)`` one canonical segment of the features at a time (see
    :func:`tensorpar.bitwise.linear.by_segment`): a callable ``(x, fn)``."""

    def __init__(self, placed: PlacedTree) -> None:
        self.placed = placed

    def __call__(self, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return by_segment(x, self.placed, fn)


def elementwise(features: int, group: ProcessGroup) -> Callable[[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]],
                                                                 torch.Tensor]:
    """How an elementwise ``fn`` runs on a column-parallel output of ``features`` full features, a callable
    ``(x, fn)``: ``fn(x)``, or in the bitwise mode one segment at a time (CPU kernels compute the last
    elements of a tensor with scalar code, whose ``tanh`` and ``exp`` differ from the vector code's in the
    last bit, and which elements are last depends on how many features a rank holds)."""
    mode = _mode()
    return _applied if mode is None else BySegment(_placed(Shard(0, features), group, mode, None))


class SegmentwiseActivation(nn.Module):
    """An elementwise module (an activation) on a column-parallel output of ``features`` full features:
    ``activation(x)``, in the bitwise mode one canonical segment of the features at a time (see
    :func:`elementwise`).

    Example::

        mlp.act = SegmentwiseActivation(mlp.act, 4 * n_embd)   # between c_fc (column) and c_proj (row)
    """

    def __init__(self, activation: nn.Module, features: int, *, group: ProcessGroup | None = None) -> None:
        super().__init__()
        check_int(features, f"{type(self).__name__}: features")
        self.activation, self.features = activation, features
        self.applied = elementwise(features, tensorpar.tp_group(group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.applied(x, self.activation)

    def extra_repr(self) -> str:
        return f"features={self.features}" + (", by segment" if isinstance(self.applied, BySegment) else "")


def segmentwise(activation: nn.Module, features: int, group: ProcessGroup) -> nn.Module:
    """``activation`` itself, or in the bitwise mode a :class:`SegmentwiseActivation` of it."""
    return chosen(activation, lambda: SegmentwiseActivation(activation, features, group=group))


class TokenwiseNorm:
    """LayerNorm whose weight and bias gradients add the tokens by canonical segments of the sequence
    (:func:`tensorpar.bitwise.norm.tokenwise_layer_norm`), a callable ``(x, weight, bias, seq_len)``: the
    same bits with or without sequence parallelism (``forward(x, seq_len=T)`` names the full length,
    else with sequence parallelism one small collective finds it)."""

    def __init__(self, shape: Sequence[int], eps: float, group: ProcessGroup, sequence_parallel: bool,
                 tp_sizes: Sequence[int]) -> None:
        self.shape, self.eps, self.group, self.sequence_parallel = list(shape), eps, group, sequence_parallel
        self.tp_sizes = tp_sizes

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 seq_len: int | None = None) -> torch.Tensor:
        rank, tp = tensorpar.group_rank_size(self.group)
        if self.sequence_parallel:
            seq_len = tensorpar.sequence_length(x, seq_len, self.group)
        tokens = placed_tokens(x.shape[-2] if not self.sequence_parallel and x.dim() > 1 else seq_len or 1,
                               tp, rank, self.tp_sizes, split=self.sequence_parallel)
        return tokenwise_layer_norm(x, self.shape, weight, bias, self.eps, tokens,
                                    self.group if self.sequence_parallel else None)


def layer_norm(default: T, norm: nn.LayerNorm, group: ProcessGroup, *, sequence_parallel: bool) -> T | TokenwiseNorm:
    """A LayerNorm's computation ``(x, weight, bias, seq_len)``: ``default``, or :class:`TokenwiseNorm`."""
    mode = _mode()
    return default if mode is None else TokenwiseNorm(norm.normalized_shape, norm.eps, group, sequence_parallel,
                                                      mode.tp_sizes)


# ---------------------------------------------------------------- attention


class _ExpandKV(torch.autograd.Function):
    """Each local query head's copy of the K (or V) head it reads; backward, every KV head's gradient as
    the sum of its ``g`` query heads' gradients, added in head order (the same bits at every tp)."""

    @staticmethod
    def forward(ctx: Any, kv: torch.Tensor, heads: HeadLayout, n_head: int, n_kv_head: int,
                group: ProcessGroup) -> torch.Tensor:
        ctx.heads, ctx.n_head, ctx.n_kv_head, ctx.group = heads, n_head, n_kv_head, group
        index = torch.tensor([j - heads.kv_held.start for j in heads.kv_read], device=kv.device)
        return kv.index_select(1, index)  # (B, h, T, d)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        heads, n_head, n_kv_head = ctx.heads, ctx.n_head, ctx.n_kv_head
        tp = tensorpar.group_rank_size(ctx.group)[1]
        if heads.kv_replicated and tp > 1:  # a KV head's query heads are spread over the ranks: gather them all
            sizes = [len(head_layout(n_head, n_kv_head, tp, r).query) for r in range(tp)]
            grad = all_gather_along(grad.contiguous(), 1, sizes, ctx.group)  # (B, n_head, T, d)
        b, h, t, d = grad.shape
        g = n_head // n_kv_head
        per_kv = grad.view(b, h // g, g, t, d)  # (B, held KV heads, g, T, d): whole groups, in order
        total = per_kv[:, :, 0]
        for i in range(1, g):
            total = total + per_kv[:, :, i]  # query head i of every group, in order
        return total.contiguous(), None, None, None, None  # (B, held KV heads, T, d)


class HeadByHead:
    """Causal attention of this rank's heads one head at a time, a callable ``(q, k, v, p)`` of
    ``(B, h, T, d)`` queries and ``(B, held KV heads, T, d)`` keys and values: each head's kernel sees the
    same shapes at every tp (CPU SDPA with one-feature heads batches its backward over the heads), each
    query head with its own copy of its KV head (backward adds a KV head's gradients in head order,
    gathering them from every rank first when the KV heads are replicated: the same bits as at tp = 1,
    where SDPA's grouped kernel would add them in an order of its own), dropout ``p`` drawing one mask for
    all ``n_head`` heads, of which this rank's heads take theirs (the same mask at every tp)."""

    def __init__(self, heads: HeadLayout, n_head: int, n_kv_head: int, group: ProcessGroup) -> None:
        self.heads, self.n_head, self.n_kv_head, self.group = heads, n_head, n_kv_head, group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
        k, v = (_ExpandKV.apply(t, self.heads, self.n_head, self.n_kv_head, self.group) for t in (k, v))  # (B, h, T, d)
        if not p:
            return blockwise(functools.partial(F.scaled_dot_product_attention, is_causal=True), [q, k, v], 1)
        b, h, t, _ = q.shape
        lo = self.heads.query.start
        keep = torch.rand(b, self.n_head, t, t, device=q.device)[:, lo:lo + h] >= p  # (B, h, T, T)
        return blockwise(functools.partial(attention_dropped, p=p), [q, k, v, keep], 1)


def attention(default: T, attn: Any) -> T | HeadByHead:
    """An attention's core ``(q, k, v, p) -> (B, h, T, d)``: ``default``, or :class:`HeadByHead`; in the
    mode its projections ``c_attn`` and ``c_proj`` are also cut where the heads' layout has a boundary at
    any tp of the mode (the layout of whole query groups or of query heads alone changes with tp, which
    their own placements do not know)."""
    mode = _mode()
    if mode is None:
        return default
    n_embd, n_head, n_kv, d = attn.n_embd, attn.n_head, attn.n_kv_head, attn.head_dim
    v_rows = n_embd + n_kv * d  # where the V rows start

    def qkv_pieces(tp: int, rank: int) -> list[Piece]:
        at = head_layout(n_head, n_kv, tp, rank)
        kv = (at.kv_held.start * d, len(at.kv_held) * d)
        return [(at.query.start * d, len(at.query) * d), (n_embd + kv[0], kv[1]), (v_rows + kv[0], kv[1])]

    group = attn.tp_group
    attn.c_attn.product.placed = _placed(attn.c_attn.placement, group, mode, qkv_pieces)
    attn.c_proj.product.placed = _placed(attn.c_proj.placement, group, mode, lambda tp, rank: qkv_pieces(tp, rank)[:1])
    return HeadByHead(attn.heads, n_head, n_kv, group)


def check_hf_kv_heads(n_head: int, n_kv: int) -> None:
    """Refuse, in the bitwise mode, a Hugging Face model with fewer KV heads than a tp of the mode."""
    mode = _mode()
    beyond = [t for t in mode.tp_sizes if n_kv < t <= n_head] if mode is not None else []
    if beyond:
        raise ValueError(f"parallelize_hf in bitwise mode needs at least as many KV heads as ranks at every tp of the "
                         f"mode: num_key_value_heads {n_kv} < tp {beyond[0]} (Hugging Face's own code sums a KV "
                         "head's gradient inside each rank); use ParallelSelfAttention (layers.GPT), or "
                         f"Bitwise(tp_sizes=...) up to {n_kv}")
