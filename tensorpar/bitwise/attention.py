"""The bitwise mode's attention: by fixed key blocks (every query the same bits at any tp, batch or cache
length), or one head at a time with a given dropout mask. Each query head gets its own copy of the KV head it
reads, and backward adds a KV head's gradients in head order (gathered from every rank first when every rank
holds every KV head), as at tp = 1.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from ..comm.collectives import all_gather_along
from ..comm.linear import autocast_off
from .linear import MIN_ROWS, WIDTH_MULTIPLE, blockwise, fixed, lanewise

#: the fewest matrices attention's batched products use: CPU ``bmm`` (torch 2.13) gives each of N >= 2 matrices
#: the same bits for any N, but runs N = 1 as ``mm``, whose one-column product (a one-feature head) adds otherwise
MIN_MATRICES = 2


def attention_dropped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """Causal attention whose probabilities are dropped where ``keep`` is False and scaled by ``1 / (1 - p)``:
    ``(B, h, T, d)`` each and ``keep`` ``(B, h, T, T)`` -> ``(B, h, T, d)``."""
    t, d = q.shape[-2:]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(d)  # (B, h, T, T)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return (probs * keep / (1 - p)) @ v


def attention_by_key_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None,
                            key_block: int) -> torch.Tensor:
    """Attention whose every query gets the same bits whatever the number of queries (rows, tokens) beside
    it and however many keys are held past its own: ``(B, h, S, d)`` queries at ``positions`` (B, S)
    (``None``: ``0..S-1``), each reading the keys and values ``(B, h, L, d)`` of slots ``0..position``.

    The keys are taken in blocks of ``key_block`` slots, in order: each block's scores are one product of
    fixed shape (queries padded to :data:`~.linear.MIN_ROWS` rows, a zero head added where ``B * h`` is
    less than :data:`MIN_MATRICES`, the head size and the block's slots zero-padded to a multiple of
    :data:`~.linear.WIDTH_MULTIPLE`), masked past the query's position; the
    maximum is exact in any order; each block's exponentials (:func:`~.linear.lanewise`) are summed alone
    and the blocks' sums, and their products with the values, added block after block. Blocks past a
    query's position add exact zeros, so a query alone (decoding), in a batch, or in a whole sequence
    (training) gets the same bits. Computed in float32 for 16-bit inputs."""
    b, h, s, d = q.shape
    length, dtype = k.shape[2], q.dtype
    rows = max(s, MIN_ROWS)
    heads = h if b * h >= MIN_MATRICES else MIN_MATRICES  # one (B, h) matrix alone gets a zero head beside it
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    width, slots_held = d + -d % WIDTH_MULTIPLE, key_block + -key_block % WIDTH_MULTIPLE
    at = torch.arange(s, device=q.device) if positions is None else positions  # (S,): causal, alike in every row
    at = F.pad(at, (0, rows - s)) if rows > s else at  # padded queries read slot 0
    at = at[:, None] if positions is None else at[:, None, :, None]  # (rows, 1) or (B, 1, rows, 1)
    with autocast_off(q):
        # (B, heads, rows, width): a copy, in the pad's layout
        q = F.pad(q.to(wide), (0, width - d, 0, rows - s, 0, heads - h))
        scale = 1 / math.sqrt(d)
        scores, values = [], []
        for lo in range(0, length, key_block):
            n = min(key_block, length - lo)
            kb, vb = (_blocked((t if n == length else t.narrow(2, lo, n)).to(wide), slots_held - n, heads - h,
                               width - d) for t in (k, v))  # (B, heads, slots_held, width)
            slots = torch.arange(lo, lo + slots_held, device=q.device)
            hidden = (slots > at) | (slots >= lo + n)  # (rows, slots_held) or (B, 1, rows, slots_held)
            # (B, heads, rows, slots_held): the product is fresh, scaled and masked in place
            scores.append(torch.matmul(q, kb.transpose(-2, -1)).mul_(scale).masked_fill_(hidden, -math.inf))
            values.append(vb)
        top = functools.reduce(torch.maximum, [sc.amax(-1) for sc in scores]).detach()  # (B, heads, rows)
        total = y = None
        for sc, vb in zip(scores, values, strict=True):
            e = lanewise(torch.exp, sc - top[..., None])  # (B, heads, rows, slots_held)
            part, weighted = e.sum(-1), e @ vb
            total = part if total is None else total + part
            y = weighted if y is None else y + weighted  # (B, heads, rows, width)
        assert y is not None and total is not None
        y = y / total[..., None]
        return (y if (heads, rows, width) == (h, s, d) else y[:, :h, :s, :d]).to(dtype)


def _blocked(t: torch.Tensor, rows: int, heads: int, columns: int) -> torch.Tensor:
    """``t`` (B, h, n, d) contiguous and aligned, with ``columns`` zero columns, ``rows`` zero rows and ``heads``
    zero heads after it."""
    return F.pad(t, (0, columns, 0, rows, 0, heads)).contiguous() if rows or heads or columns else fixed(t)


class _ExpandKV(torch.autograd.Function):
    """Each local query head's copy of the K (or V) head it reads (``index``, into the held KV heads);
    backward, each KV head's gradient as its ``g`` query heads' added in head order (first gathered from
    every rank, ``query_sizes`` query heads each, when every rank holds every KV head)."""

    @staticmethod
    def forward(ctx: Any, kv: torch.Tensor, index: Sequence[int], g: int, query_sizes: Sequence[int] | None,
                group: ProcessGroup) -> torch.Tensor:
        ctx.g, ctx.query_sizes, ctx.group = g, query_sizes, group
        return kv.index_select(1, torch.tensor(index, device=kv.device))  # (B, h, T, d)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        if ctx.query_sizes is not None:  # a KV head's query heads are spread over the ranks: gather them all
            grad = all_gather_along(grad.contiguous(), 1, ctx.query_sizes, ctx.group)  # (B, n_head, T, d)
        b, h, t, d = grad.shape
        g = ctx.g
        per_kv = grad.view(b, h // g, g, t, d)  # (B, held KV heads, g, T, d): whole groups, in order
        total = per_kv[:, :, 0]
        for i in range(1, g):
            total = total + per_kv[:, :, i]  # query head i of every group, in order
        return total.contiguous(), None, None, None, None  # (B, held KV heads, T, d)


class HeadByHead:
    """Causal attention of this rank's query heads ``q_lo, ...`` of ``n_head``, one head at a time: a callable
    ``(q, k, v, p)`` of ``(B, h, T, d)`` queries and ``(B, held KV heads, T, d)`` keys and values (``kv_index``,
    ``g``, ``query_sizes``: as :class:`_ExpandKV` takes them). Dropout ``p`` draws one mask for all ``n_head``
    heads, of which this rank takes its heads' (the same mask at every tp)."""

    def __init__(self, n_head: int, q_lo: int, kv_index: Sequence[int], g: int, query_sizes: Sequence[int] | None,
                 group: ProcessGroup, key_block: int) -> None:
        self.n_head, self.q_lo, self.kv_index, self.g = n_head, q_lo, tuple(kv_index), g
        self.query_sizes, self.group, self.key_block = query_sizes, group, key_block
        # each query head reads its own KV head, all held here in order: the keys and values as they are
        self.own_kv = g == 1 and query_sizes is None and self.kv_index == tuple(range(len(self.kv_index)))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float,
                 positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Without dropout, by key blocks (:func:`attention_by_key_blocks`): the queries at ``positions``
        (B, T) read the keys of slots up to theirs (``None``: causal, ``L == T``; ``mask``, the same slots
        as a KV cache gives them to the default attention, is not needed here)."""
        if not self.own_kv or k.shape[1] != len(self.kv_index):  # (B, h, L, d)
            k, v = (_ExpandKV.apply(t, self.kv_index, self.g, self.query_sizes, self.group) for t in (k, v))
        if not p:
            return attention_by_key_blocks(q, k, v, positions, self.key_block)
        if positions is not None:
            raise ValueError("attention dropout with a KV cache: generate in eval mode")
        b, h, t, _ = q.shape
        keep = torch.rand(b, self.n_head, t, t, device=q.device)[:, self.q_lo:self.q_lo + h] >= p  # (B, h, T, T)
        return blockwise(functools.partial(attention_dropped, p=p), [q, k, v, keep], 1)
