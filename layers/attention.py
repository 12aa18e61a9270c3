"""Causal self-attention with its heads split across the tp group.

Attention is independent per head, so each rank owns whole heads. Q, K and V
come from ONE column-parallel projection, ``c_attn``, whose full weight is
nanoGPT's: ``(n_head * d + 2 * n_kv_head * d, C)`` rows ``[Q | K | V]``
(``d = head_dim``; ``3C`` rows without grouped-query attention). Each rank holds
and computes, in one GEMM, its heads' Q rows, then their K rows, then their V
rows; attention runs locally on those heads, and the output projection
``c_proj`` is row-parallel over the same heads, summed by ``g``. One ``f``
(``copy_in``) enters the region and one ``g`` leaves it: one all-reduce of
``(B, T, C)`` forward, one backward.

The partition (:func:`~layers.heads.head_layout`), with ``g = n_head / n_kv_head`` query heads per KV head:

* ``n_kv_head >= tp``: the unit is a query *group*, ``g`` query heads and the KV
  head they read, so ``c_attn`` is three blocks with ``n_kv_head`` units each,
  of ``g * d``, ``d`` and ``d`` rows (``Shard(unit=(g*d, d, d))``), split
  balanced: a rank with groups ``[lo, hi)`` holds Q rows ``[lo*g*d, hi*g*d)``,
  K rows ``C + [lo*d, hi*d)`` and V rows ``C + n_kv_head*d + [lo*d, hi*d)``. Its
  query head ``i`` reads its KV head ``i // g`` (SDPA's ``enable_gqa``: no copy).
* ``n_kv_head < tp`` (multi-query attention at tp > 1, say): the query heads are
  split alone (``d`` rows each) and every rank holds all of K and V after them
  (``Shard(unit=d, replicated=2*n_kv_head*d)``). A rank's query heads
  ``[lo, hi)`` read KV heads ``lo // g`` to ``(hi - 1) // g``; their weight
  gradients cover its own reads, so ``c_attn`` sums the K/V rows' gradients over
  the group backward (``f`` on those rows, one all-reduce). Where the local query
  heads read their KV heads unevenly (query heads 1-3 of groups of 2 read KV
  heads 0, 1, 1), each query head's KV head is gathered by index.

Either way the full state dict has the same keys and shapes at every tp
(``attn.c_attn.weight``, GPT-2's fused projection transposed).

With ``sequence_parallel=True`` the input and output are this rank's tokens,
``(B, T_r, C)``: ``copy_in`` all-gathers them (``f̄``, keeping only this
rank's tokens for backward), the output projection reduce-scatters its sums
(``ḡ``) and the output dropout draws a mask per rank.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.utils import skip_init

import tensorpar
from tensorpar.bitwise.attention import attention_dropped
from tensorpar.checks import check_int

from . import numerics
from .heads import head_layout
from .kv_cache import LayerCache
from .linear import ColumnParallelLinear, RowParallelLinear, check_activation
from .regions import CopyToTP
from .rotary import RotaryEmbedding, rotate
from .sequence import ShardedDropout, tp_stream


class ParallelSelfAttention(nn.Module):
    """Multi-head causal self-attention, sharded by head. ``(B, T, C) -> (B, T, C)``, replicated.

    Parameters (full shapes, as nanoGPT's ``nn.Linear``\\ s): ``c_attn``
    ``(C + 2 * n_kv_head * head_dim, C)`` (rows ``[Q | K | V]``), ``c_proj``
    ``(C, C)``. ``dropout`` applies to the attention probabilities (a different
    mask on each rank: the heads differ, drawn from the mesh's tp stream; in a
    ``torch.compile`` graph, this rank's heads of one draw for all heads) and to
    the output (the same mask on every rank: the output is replicated). ``rotary`` (a
    :class:`~layers.rotary.RotaryEmbedding`) rotates the query and key heads by their positions (RoPE).

    Example::

        tensorpar.init(tp=4)
        attn = ParallelSelfAttention(768, 12, n_kv_head=4)   # 1 KV head and 3 query heads per rank
        y = attn(x)                                          # x, y: (B, T, 768)
    """

    def __init__(self, n_embd: int, n_head: int, *, n_kv_head: int | None = None, bias: bool = True,
                 dropout: float = 0.0, sequence_parallel: bool = False, rotary: RotaryEmbedding | None = None,
                 group: ProcessGroup | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        for name, value in (("n_embd", n_embd), ("n_head", n_head), ("n_kv_head", n_kv_head)):
            check_int(value, f"{type(self).__name__}: {name}")
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) is not divisible by n_head ({n_head})")
        if n_head % n_kv_head:
            raise ValueError(f"n_head ({n_head}) is not divisible by n_kv_head ({n_kv_head})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.n_embd, self.n_head, self.n_kv_head, self.dropout = n_embd, n_head, n_kv_head, dropout
        self.head_dim = d = n_embd // n_head
        group = tensorpar.tp_group(group)
        self.tp_group = group
        rank, tp = tensorpar.group_rank_size(group)
        self.rng = tp_stream(group)
        g = n_head // n_kv_head
        device = torch.get_default_device() if device is None else torch.device(device)  # skip_init needs one
        factory = dict(group=group, device=device, dtype=dtype)

        self.sequence_parallel = sequence_parallel
        self.copy_in = CopyToTP(sequence_parallel=sequence_parallel, group=group)
        self.heads = heads = head_layout(n_head, n_kv_head, tp, rank)
        self.kv_replicated = heads.kv_replicated
        self.q_lo, self.local_heads = heads.query.start, len(heads.query)
        self.held_kv_heads = len(heads.kv_held)
        # the held KV heads the local query heads read, from local index kv_lo
        self.kv_lo, self.local_kv_heads = heads.kv_reads.start - heads.kv_held.start, len(heads.kv_reads)
        # the held KV head each local query head reads; None where SDPA's grouping pairs them up
        self._kv_index = None if heads.group_size else [kv - heads.kv_held.start for kv in heads.kv_read]
        if self.kv_replicated:  # query heads split alone; every rank holds all KV heads
            q_unit, layout = d, dict(unit=d, replicated=2 * n_kv_head * d)
        else:  # whole query groups per rank: a KV head and its g query heads stay together
            q_unit, layout = g * d, dict(unit=(g * d, d, d))
        self.c_attn = skip_init(ColumnParallelLinear, n_embd, n_embd + 2 * n_kv_head * d, bias, copy_input=False,
                                **layout, **factory)  # behind copy_in's f
        self.c_proj = skip_init(RowParallelLinear, n_embd, n_embd, bias, unit=q_unit,
                                sequence_parallel=sequence_parallel, **factory)
        self.resid_dropout = ShardedDropout(dropout, group=group) if sequence_parallel else nn.Dropout(dropout)
        self.rotary = rotary  # rotates this rank's query and key heads by position (RoPE), or None
        # (q, k, v, p) -> (B, h, T, d): the default (SDPA on this rank's heads), or the bitwise mode's (chosen once)
        self.attend = numerics.attention(self._attention, self)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default for every projection, drawn tp-invariantly in a fixed order."""
        bound = 1 / math.sqrt(self.n_embd)  # every projection has n_embd input features
        geometry = tensorpar.shard_geometry(self)
        for name, p in self.named_parameters():
            tensorpar.tiled_init.uniform_(p, -bound, bound, **geometry[name])

    def forward(self, x: torch.Tensor, seq_len: int | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        """``(B, T, C)``, or with sequence parallelism this rank's tokens ``(B, T_r, C)`` of ``seq_len``
        (found with one small collective when not given). With a ``cache`` (:mod:`layers.kv_cache`) the ``T``
        tokens follow those it holds: their keys and values are stored in it, and each token attends to its
        row's tokens up to itself."""
        check_activation(x, type(self).__name__)
        if x.dim() != 3 or x.shape[-1] != self.n_embd:
            raise ValueError(f"{type(self).__name__} expects (B, T, {self.n_embd}), got {tuple(x.shape)}")
        with self.copy_in.entered(x, seq_len) as x:  # f, or f̄ (B, T, C) whose (B, T_r, C) c_attn keeps
            qkv = self.c_attn(x)  # (B, T, (h + 2 * hk) * d): this rank's Q heads, then its K, then its V heads
        d, h, hk = self.head_dim, self.local_heads, self.held_kv_heads
        q, k, v = qkv.unflatten(-1, (-1, d)).transpose(1, 2).split_with_sizes([h, hk, hk], 1)  # (B, *, T, d) views
        p = self.dropout if self.training else 0.0
        if self.rotary is not None:  # at 0..T-1, or at the cache's positions (B, T); keys cached rotated
            angles = self.rotary(q.shape[2], None if cache is None else cache.cache.positions)
            q, k = rotate(q, angles), rotate(k, angles)
        if cache is None:
            y = self.attend(q, k, v, p)  # (B, h, T, d)
        else:  # every token of the rows so far: (B, held KV heads, L, d), the queries at positions (B, T)
            k, v = cache.write(k, v)
            y = self.attend(q, k, v, p, cache.cache.positions, cache.cache.mask)
        y = self.c_proj(y.transpose(1, 2).flatten(2))  # (B, T, h * d) -> (B, T, C) summed over ranks, or (B, T_r, C)
        return self.resid_dropout(y, x.shape[-2]) if self.sequence_parallel else self.resid_dropout(y)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float,
                   positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """SDPA on this rank's heads: ``(B, h, T, d)`` queries, ``(B, held KV heads, L, d)`` keys and values,
        dropout ``p`` on the probabilities -> ``(B, h, T, d)``. Causal (``L == T``), or with the queries'
        ``positions`` (B, T) (a KV cache's) each query reads the keys of slots ``0..position``: those of
        ``mask`` (B, 1, T, L), or where it is ``None``, causally from slot 0 (``T > 1``) or every key."""
        h = self.local_heads
        if self._kv_index is not None:  # each local query head's KV head, gathered (uneven readers only)
            k, v = k[:, self._kv_index], v[:, self._kv_index]  # (B, h, T, d)
        elif self.kv_replicated:  # the KV heads this rank's query heads read, per_kv query heads each (a view)
            k, v = (t.narrow(1, self.kv_lo, self.local_kv_heads) for t in (k, v))  # (B, h_kv, T, d)
        grouped = k.shape[1] != h
        if positions is not None:  # keys read: slot <= the query's position
            causal = mask is None and q.shape[2] > 1
            with self.rng.fork(q.device) if p else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal,
                                                      enable_gqa=grouped)
        if p and torch.compiler.is_compiling():  # no stream can be swapped in a graph: see below
            if grouped:
                k, v = (t.repeat_interleave(h // t.shape[1], 1) for t in (k, v))  # (B, h, T, d)
            y = _attention_dropping_heads_of_one_draw(q, k, v, p, self.n_head, self.q_lo)
        elif p:
            with self.rng.fork(q.device):  # heads differ per rank: so do their masks
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=grouped)
        else:
            with _compiled_sdpa_kernel(q):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)  # (B, h, T, d)
        return y

    def extra_repr(self) -> str:
        return (f"n_embd={self.n_embd}, n_head={self.n_head}, n_kv_head={self.n_kv_head}, "
                f"local heads={self.local_heads}, local kv heads={self.local_kv_heads}"
                + (" (replicated)" if self.kv_replicated else "") + f", dropout={self.dropout}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))


#: torch 2.11 compiles the backward of the CPU flash-attention kernel wrongly in float64 (it raises
#: "expected scalar type Double but found Float"); 2.13 and 2.14 compile it.
_FLOAT64_FLASH_COMPILES = torch.__version__ >= "2.13"


def _compiled_sdpa_kernel(q: torch.Tensor) -> contextlib.AbstractContextManager[None]:
    """The SDPA kernels to allow for ``q``: all of them, except in a graph compiled by a torch that
    cannot compile the float64 CPU flash kernel, where the math kernel runs."""
    if _FLOAT64_FLASH_COMPILES or q.dtype != torch.float64 or q.device.type != "cpu" \
            or not torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.MATH)


def _attention_dropping_heads_of_one_draw(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float,
                                          n_head: int, lo: int) -> torch.Tensor:
    """Causal attention of this rank's heads ``lo:lo + h`` with dropout ``p`` on the probabilities,
    inside a ``torch.compile`` graph.

    A graph cannot swap the tp stream in and out around SDPA, so the mask is drawn
    instead for *all* ``n_head`` heads from the default generator, which every rank
    keeps in step, and this rank keeps its own heads' slice: each head still gets
    its own mask, the ranks' generators stay in step, and the masks are those an
    unsharded model drawing one ``(B, n_head, T, T)`` mask would use. The draw is
    tp times this rank's share. ``(B, h, T, d)`` each -> ``(B, h, T, d)``.
    """
    b, h, t, _ = q.shape
    keep = torch.rand(b, n_head, t, t, device=q.device)[:, lo:lo + h] >= p  # (B, h, T, T) of one full draw
    return attention_dropped(q, k, v, keep, p)
