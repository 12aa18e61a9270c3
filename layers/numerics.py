"""The numerics a layer computes in, chosen once, when it is built: its default computation, or its twin
in the bitwise mode (:mod:`tensorpar.bitwise`), which computes the same bits at every tp of the mode.

A layer asks here once, in ``__init__``, giving its default computation, and calls what it gets in its
one-path forward. Outside the mode (:func:`tensorpar.current_bitwise` is ``None`` while the layer is
built) each function returns the default; in it, the bitwise twin of :mod:`tensorpar.bitwise`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed import ProcessGroup

import tensorpar
from tensorpar.bitwise import Bitwise
from tensorpar.bitwise.attention import HeadByHead
from tensorpar.bitwise.linear import BySegment, SegmentedColumn, SegmentedRow
from tensorpar.bitwise.norm import TokenwiseNorm
from tensorpar.bitwise.segments import Piece, PlacedTree, placed_split
from tensorpar.checks import check_int
from tensorpar.sharding import Shard

from .heads import head_layout

T = TypeVar("T")
Elementwise = Callable[[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], torch.Tensor]  # (x, fn) -> fn(x)


def chosen(default: T, twin: Callable[[], T]) -> T:
    """``default``, or in the bitwise mode what ``twin()`` builds."""
    return default if tensorpar.current_bitwise() is None else twin()


def mark(model: nn.Module) -> nn.Module:
    """In the bitwise mode, record the mode on ``model`` (built or converted here) as ``model.numerics``, which
    :func:`tensorpar.clip_grad_norm_` reads once. Returns ``model``."""
    mode = tensorpar.current_bitwise()
    if mode is not None:
        model.numerics = mode  # type: ignore[assignment]
    return model


def _placed(placement: Shard, group: ProcessGroup, mode: Bitwise,
            pieces_at: Callable[[int, int], Sequence[Piece]] | None = None) -> PlacedTree:
    """The canonical segments of ``placement``'s dim, cut where ``pieces_at(tp, rank)`` (default: the
    placement's own pieces) has a boundary at any tp of the mode, placed over ``group``."""
    rank, tp = tensorpar.group_rank_size(group)
    return placed_split(pieces_at or placement.pieces, placement.size, tp, rank, mode.tp_sizes)


def column(default: T, placement: Shard, group: ProcessGroup, *, sequence_parallel: bool = False
           ) -> T | SegmentedColumn:
    """A column-parallel layer's product ``(x, weight, bias, seq_len)``: ``default``, or by segments."""
    mode = tensorpar.current_bitwise()
    return default if mode is None else SegmentedColumn(_placed(placement, group, mode), group, sequence_parallel)


def row(default: T, placement: Shard, group: ProcessGroup, *, sequence_parallel: bool = False) -> T | SegmentedRow:
    """A row-parallel layer's product ``(x, weight, bias)``: ``default``, or by segments, summed by their tree."""
    mode = tensorpar.current_bitwise()
    return default if mode is None else SegmentedRow(_placed(placement, group, mode), group, sequence_parallel,
                                                     mode.tp_sizes)


def region_entry(default: T, group: ProcessGroup, *, sequence_parallel: bool = False) -> T | Callable[..., Any]:
    """The entry ``(x, seq_len)`` of a region of column maps (``f``, or ``f̄``): ``default``, or in the mode,
    where the maps sum the input gradient by their tree, the identity (with sequence parallelism the gather
    whose backward keeps this rank's tokens)."""
    if tensorpar.current_bitwise() is None:
        return default
    return functools.partial(tensorpar.gather_sequence, group=group) if sequence_parallel else _identity


def _identity(x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
    return x


def _applied(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return fn(x)


def elementwise(features: int, group: ProcessGroup) -> Elementwise:
    """How an elementwise ``fn`` runs on a column-parallel output of ``features`` full features: ``fn(x)``,
    or in the mode with every element computed by the vector code (CPU kernels compute a tensor's last
    elements with scalar code, whose ``tanh`` and ``exp`` differ from the vector code's in the last bit):
    in one call on one CPU thread, else one segment at a time (:class:`~tensorpar.bitwise.linear.BySegment`)."""
    mode = tensorpar.current_bitwise()
    return _applied if mode is None else BySegment(_placed(Shard(0, features), group, mode))


class SegmentwiseActivation(nn.Module):
    """An elementwise module (an activation) on a column-parallel output of ``features`` full features:
    ``activation(x)``, in the bitwise mode each element by the vector code, by canonical segments of the features
    where threads split the work (:func:`elementwise`).

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


def layer_norm(default: T, norm: nn.LayerNorm | nn.RMSNorm, group: ProcessGroup, *, sequence_parallel: bool
               ) -> T | TokenwiseNorm:
    """A LayerNorm's or RMSNorm's computation ``(x, weight, bias, seq_len)``: ``default``, or its weight and
    bias gradients added over the tokens by segments of the sequence."""
    mode = tensorpar.current_bitwise()
    if mode is None:
        return default
    rms = isinstance(norm, nn.RMSNorm)
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.get_default_dtype()).eps
    return TokenwiseNorm(norm.normalized_shape, eps, group, sequence_parallel, mode.tp_sizes, rms=rms)


def attention(default: T, attn: Any) -> T | HeadByHead:
    """An attention's core ``(q, k, v, p) -> (B, h, T, d)``: ``default``, or one head at a time; in the mode
    ``attn.c_attn`` and ``attn.c_proj`` are also cut where the heads' layout has a boundary at any tp of the
    mode (whole query groups at one tp, query heads alone at another: their own placements do not know)."""
    mode = tensorpar.current_bitwise()
    if mode is None:
        return default
    n_embd, n_head, n_kv, d, heads = attn.n_embd, attn.n_head, attn.n_kv_head, attn.head_dim, attn.heads
    v_rows = n_embd + n_kv * d  # where the V rows start

    def qkv_pieces(tp: int, rank: int) -> list[Piece]:
        at = head_layout(n_head, n_kv, tp, rank)
        kv = (at.kv_held.start * d, len(at.kv_held) * d)
        return [(at.query.start * d, len(at.query) * d), (n_embd + kv[0], kv[1]), (v_rows + kv[0], kv[1])]

    group = attn.tp_group
    tp = tensorpar.group_rank_size(group)[1]
    attn.c_attn.product.placed = _placed(attn.c_attn.placement, group, mode, qkv_pieces)
    attn.c_proj.product.placed = _placed(attn.c_proj.placement, group, mode, lambda t, r: qkv_pieces(t, r)[:1])
    spread = heads.kv_replicated and tp > 1  # a KV head's query heads on several ranks: gather their gradients
    sizes = [len(head_layout(n_head, n_kv, tp, r).query) for r in range(tp)] if spread else None
    return HeadByHead(n_head, heads.query.start, [j - heads.kv_held.start for j in heads.kv_read], n_head // n_kv,
                      sizes, group, mode.key_block)


def check_hf_kv_heads(n_head: int, n_kv: int) -> None:
    """Refuse, in the bitwise mode, a Hugging Face model with fewer KV heads than a tp of the mode."""
    mode = tensorpar.current_bitwise()
    beyond = [t for t in mode.tp_sizes if n_kv < t <= n_head] if mode is not None else []
    if beyond:
        raise ValueError(f"parallelize_hf in bitwise mode needs at least as many KV heads as ranks at every tp of the "
                         f"mode: num_key_value_heads {n_kv} < tp {beyond[0]} (Hugging Face's own code sums a KV "
                         "head's gradient inside each rank); use ParallelSelfAttention (layers.GPT), or "
                         f"Bitwise(tp_sizes=...) up to {n_kv}")
