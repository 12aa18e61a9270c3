"""Causal self-attention with its heads split across the tp group.

Attention is independent per head, so each rank owns whole heads: the Q, K and
V projections are column-parallel in units of a head (``head_dim`` rows of the
weight), attention runs locally on this rank's heads, and the output
projection is row-parallel over the same heads, summed by ``g``. One ``f``
(``copy_in``) enters the region and the three projections are called on its
output, so one all-reduce of their summed input gradient serves all three; one
``g`` leaves it: one all-reduce of ``(B, T, C)`` forward, one backward.

Grouped-query attention (``n_kv_head < n_head``, ``g = n_head / n_kv_head``
query heads per KV head) shards by query *group* when there are at least
``tp`` KV heads: a rank owns whole KV heads and their ``g`` query heads each,
so nothing changes in the communication. With fewer KV heads than ranks
(multi-query attention at tp > 1, say), query heads are split alone and every
rank holds all KV heads, using those its query heads read; the KV projections
are then :class:`~layers.linear.ReplicatedLinear`, whose gradients (each rank's
share of them) are summed by an ``f`` on the weights: one extra all-reduce of
the weight and bias of K, and one of V, backward.

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
from einops import rearrange
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.utils import skip_init

import tensorpar
from tensorpar.sharding import check_int, partition_bounds

from .linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, check_activation
from .regions import CopyToTP, GatherSequence
from .sequence import ShardedDropout, tp_stream


class ParallelSelfAttention(nn.Module):
    """Multi-head causal self-attention, sharded by head. ``(B, T, C) -> (B, T, C)``, replicated.

    Parameters (full shapes, as the unsharded twin's ``nn.Linear``\\ s): ``q_proj``
    ``(C, C)``, ``k_proj`` and ``v_proj`` ``(n_kv_head * head_dim, C)``, ``c_proj``
    ``(C, C)``. ``dropout`` applies to the attention probabilities (a different
    mask on each rank: the heads differ, drawn from the mesh's tp stream; in a
    ``torch.compile`` graph, this rank's heads of one draw for all heads) and to
    the output (the same mask on every rank: the output is replicated).

    Example::

        tensorpar.init(tp=4)
        attn = ParallelSelfAttention(768, 12, n_kv_head=4)   # 1 KV head and 3 query heads per rank
        y = attn(x)                                          # x, y: (B, T, 768)
    """

    def __init__(self, n_embd: int, n_head: int, *, n_kv_head: int | None = None, bias: bool = True,
                 dropout: float = 0.0, sequence_parallel: bool = False, group: ProcessGroup | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
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
        column = dict(factory, copy_input=False)  # behind copy_in's f

        self.sequence_parallel = sequence_parallel
        self.copy_in = GatherSequence(group=group) if sequence_parallel else CopyToTP(group=group)
        self.kv_replicated = n_kv_head < tp
        if self.kv_replicated:  # query heads split alone; every rank holds all KV heads
            q_unit, (q_lo, self.local_heads) = d, partition_bounds(n_head, tp, rank, name="n_head")
            self.kv_lo, kv_hi = q_lo // g, (q_lo + self.local_heads - 1) // g + 1
            self.k_proj = skip_init(ReplicatedLinear, n_embd, n_kv_head * d, bias, **factory)
            self.v_proj = skip_init(ReplicatedLinear, n_embd, n_kv_head * d, bias, **factory)
        else:  # whole query groups per rank: a KV head and its g query heads stay together
            kv_lo, kv_heads = partition_bounds(n_kv_head, tp, rank, name="n_kv_head")
            q_unit, q_lo, self.local_heads = g * d, g * kv_lo, g * kv_heads
            self.kv_lo, kv_hi = 0, kv_heads  # local indices: this rank's KV weights are its own heads only
            self.k_proj = skip_init(ColumnParallelLinear, n_embd, n_kv_head * d, bias, unit=d, **column)
            self.v_proj = skip_init(ColumnParallelLinear, n_embd, n_kv_head * d, bias, unit=d, **column)
        self.local_kv_heads, self.q_lo = kv_hi - self.kv_lo, q_lo
        # local KV head read by each local query head (None: the trivial 1:1 map)
        kv_of_q = [(q_lo + i) // g - (q_lo // g) for i in range(self.local_heads)]
        self._kv_index = None if kv_of_q == list(range(self.local_kv_heads)) else kv_of_q
        self.q_proj = skip_init(ColumnParallelLinear, n_embd, n_embd, bias, unit=q_unit, **column)
        self.c_proj = skip_init(RowParallelLinear, n_embd, n_embd, bias, unit=q_unit,
                                sequence_parallel=sequence_parallel, **factory)
        self.resid_dropout = ShardedDropout(dropout, group=group) if sequence_parallel else nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default for every projection, drawn tp-invariantly in a fixed order."""
        bound = 1 / math.sqrt(self.n_embd)  # every projection has n_embd input features
        geometry = tensorpar.shard_geometry(self)
        for name, p in self.named_parameters():
            tensorpar.tiled_init.uniform_(p, -bound, bound, **geometry[name])

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """``(B, T, C)``, or with sequence parallelism this rank's tokens ``(B, T_r, C)`` of ``seq_len``
        (found with one small collective when not given)."""
        check_activation(x, type(self).__name__)
        if x.dim() != 3 or x.shape[-1] != self.n_embd:
            raise ValueError(f"{type(self).__name__} expects (B, T, {self.n_embd}), got {tuple(x.shape)}")
        saving: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self.sequence_parallel:
            seq_len = tensorpar.sequence_length(x, seq_len, self.tp_group)
            shard, x = x, self.copy_in(x, seq_len)  # f̄: (B, T, C), shared by the three projections
            saving = tensorpar.save_sequence_shard(x, shard, self.tp_group)  # they keep (B, T_r, C)
        else:
            x = self.copy_in(x)  # f, shared by the three projections
        kv_used = slice(self.kv_lo * self.head_dim, (self.kv_lo + self.local_kv_heads) * self.head_dim)
        with saving:
            projected = (self.q_proj(x), self.k_proj(x)[..., kv_used], self.v_proj(x)[..., kv_used])
        q, k, v = (rearrange(t, "b t (h d) -> b h t d", d=self.head_dim)  # h: this rank's (query or KV) heads
                   for t in projected)
        if self._kv_index is not None:  # grouped-query: each query head reads its group's KV head
            k, v = k[:, self._kv_index], v[:, self._kv_index]  # (B, h, T, d)
        p = self.dropout if self.training else 0.0
        if p and torch.compiler.is_compiling():  # no stream can be swapped in a graph: see below
            y = _attention_dropping_heads_of_one_draw(q, k, v, p, self.n_head, self.q_lo)
        elif p:
            with self.rng.fork(x.device):  # heads differ per rank: so do their masks
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            with _compiled_sdpa_kernel(q):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, h, T, d)
        y = self.c_proj(rearrange(y, "b h t d -> b t (h d)"))  # (B, T, C) summed over ranks, or (B, T_r, C)
        return self.resid_dropout(y, seq_len) if self.sequence_parallel else self.resid_dropout(y)

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
    b, h, t, d = q.shape
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(d)  # (B, h, T, T)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    keep = torch.rand(b, n_head, t, t, device=q.device)[:, lo:lo + h] >= p  # (B, h, T, T) of one full draw
    return (probs * keep / (1 - p)) @ v
