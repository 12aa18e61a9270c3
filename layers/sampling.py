"""The next token from vocab-sharded logits, with one all-gather of a few numbers per rank.

Rank ``r`` holds the logits of vocabulary rows ``[lo_r, hi_r)``. Nothing of the size of the vocabulary
travels:

* greedy: each rank sends its best logit and its global index; the first of the largest wins (the
  full ``argmax``'s pick);
* sampling (Gumbel-max): ``argmax_v z_v / τ + G_v`` is a draw from ``softmax(z / τ)`` when the ``G_v`` are
  independent Gumbel noise, ``G_v = -log(-log(U_v))``. Every rank draws the same uniforms ``U`` ``(B, V)``
  for the whole vocabulary from the default generator (which the ranks keep in step) and perturbs its own
  rows: each sends its best perturbed logit and its index. The noise of a token depends only on its
  global index, so the draw is reproducible from ``torch.manual_seed`` and the same at every tp (given the
  same logits);
* top-k: the global top k lie in the union of the ranks' own top k, so each rank sends those (value,
  index); every rank then keeps the k largest and perturbs them with their tokens' noise;
* log-probabilities (default numerics): each rank also sends its largest logit ``m_r`` and
  ``s_r = Σ exp(z / τ - m_r)`` over its rows (and the winner's logit), so that ``log p = z_t / τ - M -
  log Σ_r s_r exp(m_r - M)`` needs no other collective. (The bitwise mode scores the token with the
  training path's cross-entropy instead, for its bits.)

Every rank computes the same result from the same gathered numbers: no broadcast. Decoding, the same
gather also carries each rank's candidate's row of the token embedding (and its share of the position
table's lookup), so the next step's input needs no all-reduce of its own. A group of one gathers nothing:
its own pick and statistics are the whole vocabulary's (the same bits), and the winner's row is read from
its table.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from tensorpar.comm.collectives import all_gather_along
from tensorpar.sharding import partition_bounds, partition_sizes


def _gathered(rows: torch.Tensor, sizes: list[int], group: ProcessGroup) -> torch.Tensor:
    """Every rank's ``rows`` (B, sizes[r], F) side by side along dim 1: (B, Σ sizes, F), float64."""
    return rows if group.size() == 1 else all_gather_along(rows, 1, sizes, group)


def gumbel_noise(uniform: torch.Tensor) -> torch.Tensor:
    """Gumbel noise ``-log(-log(U))`` of uniforms ``U`` in [0, 1) (``U = 0``: ``-inf``, never drawn)."""
    return -torch.log(-torch.log(uniform))


def sample(logits: torch.Tensor, vocab_size: int, temperature: float, top_k: int | None, group: ProcessGroup,
           scored: bool, embedding: tuple[torch.Tensor, torch.Tensor | None] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The next token of each row (B,), the same on every rank, from this rank's logits (B, V / tp): the
    most likely at ``temperature == 0``, else a draw from ``softmax(logits / temperature)`` (over the top
    ``top_k``). With ``scored`` its log-probability (B,) under that distribution (greedy: at temperature
    1), float32 for 16-bit logits; else ``None``.

    ``embedding``: this rank's rows of the token embedding table (V / tp, C) and its share (B, C) of the
    other lookups the next token adds (a vocab-parallel position table's: zero off this rank's rows), or
    ``None``. The same gather then carries the winner's row and the shares, and the third result is the
    next token's embedding (B, C), the sum the embeddings' all-reduce would give (no top-k: ``None``)."""
    rank, tp = group.rank(), group.size()
    lo, n = (0, vocab_size) if tp == 1 else partition_bounds(vocab_size, tp, rank, name="vocab_size")
    b = logits.shape[0]
    wide = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype  # the loss's dtype
    z = (logits if temperature in (0, 1) else logits / temperature).to(wide)  # (B, V / tp)
    uniform = None  # (B, V): the same on every rank
    if temperature != 0:
        uniform = torch.rand(b, vocab_size, device=logits.device, dtype=torch.float32)
    if top_k is not None and uniform is not None:
        return (*_sample_top_k(z, lo, vocab_size, min(top_k, vocab_size), uniform, group, scored), None)
    if uniform is None:
        best, at = z.max(-1)  # (B,) the first largest
        key = best
    else:
        key, at = (z + gumbel_noise(uniform[:, lo:lo + n]).to(wide)).max(-1)  # (B,) the best perturbed
        best = z.gather(-1, at[:, None])[:, 0]
    top = z.amax(-1) if scored else None  # (B,)
    if tp == 1:  # one rank: its pick, its sum and its rows are the whole vocabulary's
        return at, None if top is None else best - top - (z - top[:, None]).exp().sum(-1).log(), \
            None if embedding is None else _looked_up(at, *embedding)
    fields = [key, at + lo, best]
    if top is not None:
        fields += [top, (z - top[:, None]).exp().sum(-1)]
    mine = torch.stack([f.double() for f in fields], -1)  # (B, F)
    if embedding is not None:  # the candidate's row of the table (zero where another rank's), and the shares
        table, share = embedding
        rows = [table[at], *([] if share is None else [share])]  # (B, C) each
        mine = torch.cat([mine, *(r.double() for r in rows)], -1)  # (B, F + C or F + 2C)
    every = _gathered(mine[:, None], [1] * tp, group)  # (B, tp, ...)
    winner = every[..., 0].argmax(-1, keepdim=True)  # (B, 1) the first rank with the largest key
    chosen = every.gather(1, winner[..., None].expand(b, 1, every.shape[-1]))[:, 0]  # (B, ...)
    token = chosen[:, 1].long()
    embedded = None
    if embedding is not None:
        table, share = embedding
        c, f = table.shape[-1], len(fields)
        embedded = chosen[:, f:f + c].to(table.dtype)  # (B, C): the winner's row
        if share is not None:  # every rank's share added in rank order, as the all-reduce adds the lookups
            shares = every[..., f + c:].to(share.dtype).unbind(1)
            total = shares[0]
            for part in shares[1:]:
                total = total + part
            embedded = embedded + total
    if not scored:
        return token, None, embedded
    m, s = every[..., 3].to(wide), every[..., 4].to(wide)  # (B, tp)
    top = m.amax(-1)  # (B,)
    total = (s * (m - top[:, None]).exp()).sum(-1)
    return token, chosen[:, 2].to(wide) - top - total.log(), embedded


def _looked_up(token: torch.Tensor, table: torch.Tensor, share: torch.Tensor | None) -> torch.Tensor:
    """The embedding (B, C) of ``token`` (B,) in the whole ``table`` (V, C), plus ``share``: the lookups' sum."""
    return table[token] if share is None else table[token] + share


def _sample_top_k(z: torch.Tensor, lo: int, vocab_size: int, k: int, uniform: torch.Tensor, group: ProcessGroup,
                  scored: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`sample` over the ``k`` largest of ``z / τ`` (this rank's ``z`` (B, V / tp), from row ``lo``)."""
    tp = group.size()
    sizes = [min(k, n) for n in partition_sizes(vocab_size, tp, name="vocab_size")]
    values, at = z.topk(sizes[group.rank()], -1)  # (B, k_r) this rank's largest
    mine = torch.stack([values.double(), (at + lo).double()], -1)  # (B, k_r, 2)
    every = _gathered(mine, sizes, group)  # (B, Σ k_r, 2): the global top k among them
    values, ids = every[..., 0].to(z.dtype), every[..., 1].long()  # (B, Σ k_r)
    kth = values.topk(k, -1).values[:, -1:]  # (B, 1)
    kept = values.masked_fill(values < kth, -torch.inf)  # ties with the k-th kept, as a full top-k mask keeps them
    pick = (kept + gumbel_noise(uniform.gather(-1, ids)).to(z.dtype)).argmax(-1, keepdim=True)  # (B, 1)
    token = ids.gather(-1, pick)[:, 0]
    if not scored:
        return token, None
    return token, kept.log_softmax(-1).gather(-1, pick)[:, 0]
