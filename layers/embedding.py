"""Vocab-parallel embedding: the rows of the table split across the tp group.

Rank ``r`` holds rows ``[lo_r, hi_r)`` of the ``(num_embeddings, embedding_dim)``
table (a balanced split, no padding rows). A lookup is a sum over ranks::

    E[id] = Σ_r  (E_r[id − lo_r] if lo_r ≤ id < hi_r else 0)

so each rank looks up the ids it owns, writes zeros for the others, and ``g``
(:func:`reduce_from_tp`) all-reduces the partial results: one all-reduce of
``(*, embedding_dim)`` forward, nothing backward (each row's gradient stays on
the rank that owns it). With ``reduce_output=False`` the module returns its
unreduced term instead, so that several tables (token and position
embeddings) can be summed first and reduced once (a
:class:`~layers.regions.ReduceFromTP` after the sum).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

import tensorpar
from tensorpar.checks import check_ids, check_int
from tensorpar.sharding import Shard, partition_bounds


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with its rows split across the tp group; output identical on every rank
    (or, with ``reduce_output=False``, this rank's term of it: the rows it owns, zeros elsewhere).

    Example::

        tensorpar.init(tp=4)
        wte = VocabParallelEmbedding(50257, 768)   # 12565 or 12564 rows per rank
        x = wte(idx)                               # (B, T) -> (B, T, 768)
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, reduce_output: bool = True,
                 group: ProcessGroup | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            check_int(value, f"VocabParallelEmbedding: {name}")
        self.num_embeddings, self.embedding_dim, self.reduce_output = num_embeddings, embedding_dim, reduce_output
        self.tp_group = tensorpar.tp_group(group)
        self.tp_rank, self.tp = tensorpar.group_rank_size(self.tp_group)
        self.local_offset, self.local_rows = partition_bounds(num_embeddings, self.tp, self.tp_rank,
                                                              name="num_embeddings")
        self.weight = nn.Parameter(torch.empty(self.local_rows, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def sharding(self) -> dict[str, Shard]:
        return {"weight": Shard(0, self.num_embeddings)}

    def reset_parameters(self) -> None:
        """``nn.Embedding``'s default, ``N(0, 1)``, drawn tp-invariantly."""
        tensorpar.tiled_init.normal_(self.weight, **tensorpar.shard_geometry(self)["weight"])

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, **options: object) -> VocabParallelEmbedding:
        """Shard an ``nn.Embedding`` (the same on every rank), keeping its weights."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"{cls.__name__}.from_embedding expects an nn.Embedding, got {type(embedding).__name__}")
        unsupported = [k for k in ("padding_idx", "max_norm") if getattr(embedding, k) is not None]
        if unsupported or embedding.sparse or embedding.scale_grad_by_freq:
            raise ValueError(f"{cls.__name__}.from_embedding supports plain embeddings only; this one sets "
                             f"{unsupported + [k for k in ('sparse', 'scale_grad_by_freq') if getattr(embedding, k)]}")
        module = cls(embedding.num_embeddings, embedding.embedding_dim, device="meta",
                     dtype=embedding.weight.dtype, **options)  # type: ignore[arg-type]
        module.to_empty(device=embedding.weight.device)
        tensorpar.load_full_state_dict(module, embedding.state_dict())
        return module

    def to_embedding(self) -> nn.Embedding:
        """The full ``nn.Embedding``, gathered on every rank (a collective)."""
        embedding = nn.Embedding(self.num_embeddings, self.embedding_dim, device="meta", dtype=self.weight.dtype)
        embedding.to_empty(device=self.weight.device)
        embedding.load_state_dict(tensorpar.full_state_dict(self))
        return embedding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``(*)`` integer ids ``->`` ``(*, embedding_dim)``."""
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex \
                or ids.dtype == torch.bool:
            raise TypeError(f"VocabParallelEmbedding expects a tensor of integer ids, got "
                            f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        n = self.num_embeddings
        check_ids(ids, n, "token id", f"num_embeddings {n} (ids must be in [0, {n}))")
        return self._lookup(ids)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` ``(*)``, known to be in range: ``(*, embedding_dim)``."""
        if self.tp == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.local_offset
        foreign = (local < 0) | (local >= self.local_rows)  # (*) rows another rank owns
        out = F.embedding(local.masked_fill(foreign, 0), self.weight)  # (*, C), this rank's term
        out = out.masked_fill(foreign.unsqueeze(-1), 0.0)
        return tensorpar.reduce_from_tp(out, self.tp_group) if self.reduce_output else out  # (*, C)

    def extra_repr(self) -> str:
        lo, hi = self.local_offset, self.local_offset + self.local_rows
        return (f"{self.num_embeddings}, {self.embedding_dim}, local rows={self.local_rows} [{lo}:{hi}] "
                f"on tp rank {self.tp_rank} of {self.tp}" + ("" if self.reduce_output else ", reduce_output=False"))


class PositionEmbedding(VocabParallelEmbedding):
    """A :class:`VocabParallelEmbedding` of the positions ``0..num_embeddings-1`` a model gives its tokens: it
    makes the ids itself, in range (a GPT refuses sequences longer than ``block_size`` before), so the lookup
    skips the range check a token id gets.

    Example::

        wpe = PositionEmbedding(1024, 768)
        x = wte(idx) + wpe(torch.arange(idx.shape[1]))   # (B, T, 768)
    """

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``(*)`` positions ``->`` ``(*, embedding_dim)``."""
        return self._lookup(ids)
