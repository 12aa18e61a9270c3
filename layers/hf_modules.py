"""Sharded twins of the pieces of Hugging Face models that our own layers do not cover.

* GPT-2's ``Conv1D`` is ``y = x W + b`` with ``W`` of shape ``(in, out)``: :class:`ColumnParallelConv1D`
  and :class:`RowParallelConv1D` are the column and row maps of :mod:`layers.linear` on ``Wᵀ``, keeping
  GPT-2's layout (its keys and shapes in the full state dict); ``blocks=3`` splits a fused ``[Q | K | V]``.
* :class:`ReplicatedHeadsLinear`: a K or V projection held whole on every rank (fewer KV heads than
  ranks), outputting only the KV heads this rank's query heads read.
* :class:`PaddedVocabParallelEmbedding`: a vocab-parallel embedding whose padding row gets no gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

import tensorpar
from tensorpar.checks import check_int
from tensorpar.sharding import Shard

from . import numerics
from .embedding import VocabParallelEmbedding
from .linear import ReplicatedLinear, check_activation


class _ParallelConv1D(nn.Module):
    """What the column- and row-parallel ``Conv1D`` share: weight ``(nx, nf)`` split along ``split_dim``."""

    split_dim: ClassVar[int]  # 1: output features (nf) are split; 0: input features (nx) are split

    def __init__(self, nf: int, nx: int, *, unit: int, blocks: int, group: ProcessGroup | None,
                 device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        super().__init__()
        for name, value in (("nf", nf), ("nx", nx), ("unit", unit), ("blocks", blocks)):
            check_int(value, f"{type(self).__name__}: {name}")
        self.nf, self.nx, self.unit, self.blocks = nf, nx, unit, blocks
        self.tp_group = tensorpar.tp_group(group)
        self.tp_rank, self.tp = tensorpar.group_rank_size(self.tp_group)
        full = (nx, nf)
        self.placement = Shard(self.split_dim, full[self.split_dim], (unit,) * blocks if blocks > 1 else unit)
        local = list(full)
        local[self.split_dim] = self.placement.sizes(self.tp)[self.tp_rank]
        self.weight = nn.Parameter(torch.empty(local, device=device, dtype=dtype))  # (nx, nf), split
        self.bias = nn.Parameter(torch.empty(local[1], device=device, dtype=dtype))  # (nf,), split with it or whole
        self.reset_parameters()

    def sharding(self) -> dict[str, Shard]:
        """Placements of the split parameters (see :mod:`tensorpar.full`)."""
        split = {"weight": self.placement}
        if self.split_dim == 1:
            split["bias"] = Shard(0, self.nf, self.placement.unit)
        return split

    def reset_parameters(self) -> None:
        """GPT-2's ``Conv1D`` initialisation, weight ``N(0, 0.02²)`` and bias zero, drawn tp-invariantly."""
        tensorpar.tiled_init.normal_(self.weight, 0.0, 0.02, **tensorpar.shard_geometry(self)["weight"])
        nn.init.zeros_(self.bias)

    @classmethod
    def from_conv1d(cls, conv: nn.Module, **options: Any) -> _ParallelConv1D:
        """Shard a Hugging Face ``Conv1D`` (the same on every rank), keeping its weights."""
        weight = getattr(conv, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or getattr(conv, "bias", None) is None:
            raise TypeError(f"{cls.__name__}.from_conv1d expects a Conv1D with a (nx, nf) weight and a bias, "
                            f"got {type(conv).__name__}")
        nx, nf = weight.shape
        module = cls(nf, nx, device="meta", dtype=weight.dtype, **options)
        module.to_empty(device=weight.device)
        tensorpar.load_full_state_dict(module, {"weight": weight.detach(), "bias": conv.bias.detach()})
        return module

    def extra_repr(self) -> str:
        split = ("nx", "nf")[self.split_dim]
        return (f"nf={self.nf}, nx={self.nx}, local {split}={self.weight.shape[self.split_dim]} on tp rank "
                f"{self.tp_rank} of {self.tp}" + (f", unit={self.unit}" if self.unit > 1 else "")
                + (f", blocks={self.blocks}" if self.blocks > 1 else ""))


class ColumnParallelConv1D(_ParallelConv1D):
    """GPT-2's ``Conv1D(nf, nx)`` with its output features split: ``(*, nx) -> (*, nf / tp)``.

    ``blocks=3`` splits a fused ``[Q | K | V]`` output block by block (output ``[Q_r | K_r | V_r]``),
    ``unit`` keeps whole heads together, ``copy_input=False`` leaves ``f`` to a shared ``CopyToTP``.

    Example::

        tensorpar.init(tp=2)
        c_attn = ColumnParallelConv1D.from_conv1d(attn.c_attn, unit=head_dim, blocks=3)
        q, k, v = c_attn(x).split(local_heads * head_dim, dim=-1)
    """

    split_dim = 1

    def __init__(self, nf: int, nx: int, *, unit: int = 1, blocks: int = 1, copy_input: bool = True,
                 group: ProcessGroup | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(nf, nx, unit=unit, blocks=blocks, group=group, device=device, dtype=dtype)
        self.copy_input = copy_input
        # (x, Wᵀ, bias) -> (*, nf / tp): the default product, or the bitwise mode's (chosen once)
        self.product = numerics.column(self._product, self.placement, self.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_activation(x, type(self).__name__)
        return self.product(x, self.weight.t(), self.bias)  # (*, nf / tp)

    def _product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, seq_len: int | None = None
                 ) -> torch.Tensor:
        if self.copy_input:
            return tensorpar.column_parallel_linear(x, weight, bias, self.tp_group)  # (*, nf / tp)
        return F.linear(x, weight, bias)  # f was applied by the caller


class RowParallelConv1D(_ParallelConv1D):
    """GPT-2's ``Conv1D(nf, nx)`` with its input features split: this rank's slice
    ``(*, nx / tp)`` -> ``(*, nf)``, summed over the group by ``g``, the bias added once.

    Example::

        tensorpar.init(tp=2)
        c_proj = RowParallelConv1D.from_conv1d(mlp.c_proj)
        y = c_proj(h)                      # h: (B, T, 4C / 2) -> y: (B, T, C)
    """

    split_dim = 0

    def __init__(self, nf: int, nx: int, *, unit: int = 1, group: ProcessGroup | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(nf, nx, unit=unit, blocks=1, group=group, device=device, dtype=dtype)
        # (x, Wᵀ, bias) -> (*, nf) summed over the group: the default product, or the bitwise mode's (chosen once)
        self.product = numerics.row(self._product, self.placement, self.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_activation(x, type(self).__name__)
        return self.product(x, self.weight.t(), self.bias)  # (*, nf)

    def _product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return tensorpar.row_parallel_linear(x, weight, bias, self.tp_group)  # (*, nf)


class ReplicatedHeadsLinear(ReplicatedLinear):
    """A K or V projection held whole on every rank, outputting the heads ``heads`` of its
    ``out_features / head_dim``: ``(*, in) -> (*, len(heads) * head_dim)``.

    ``heads`` lists, for each head this rank uses, the KV head it is (contiguous, or one per local query
    head, repeated where several read it); ``f`` on the weights sums the ranks' weight gradients (see
    :class:`~layers.linear.ReplicatedLinear`). Parameters keep ``nn.Linear``'s names and full shapes.

    Example::

        # 2 KV heads of 8 features; this rank's query heads read KV head 1 twice, then KV head 2
        k_proj = ReplicatedHeadsLinear.from_linear(dense.k_proj, head_dim=8, heads=[1, 1, 2])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, head_dim: int,
                 heads: Sequence[int], group: ProcessGroup | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        check_int(head_dim, "ReplicatedHeadsLinear: head_dim")
        if out_features % head_dim:
            raise ValueError(f"out_features ({out_features}) is not a whole number of heads of {head_dim}")
        n_heads = out_features // head_dim
        if not heads or any(not 0 <= h < n_heads for h in heads):
            raise ValueError(f"heads {list(heads)} must be a non-empty list of heads in [0, {n_heads})")
        super().__init__(in_features, out_features, bias, group=group, device=device, dtype=dtype)
        self.head_dim, self.heads = head_dim, tuple(heads)
        lo = self.heads[0]
        self._contiguous = self.heads == tuple(range(lo, lo + len(self.heads)))

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options: Any) -> ReplicatedHeadsLinear:
        """Hold an ``nn.Linear`` (the same on every rank) whole, keeping its weights."""
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta",
                     dtype=linear.weight.dtype, **options)
        module.to_empty(device=linear.weight.device)
        module.load_state_dict(linear.state_dict())
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x).unflatten(-1, (-1, self.head_dim))  # (*, n_kv_heads, head_dim)
        y = y.narrow(-2, self.heads[0], len(self.heads)) if self._contiguous else y[..., list(self.heads), :]
        return y.flatten(-2)  # (*, len(heads) * head_dim)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, head_dim={self.head_dim}, heads={list(self.heads)}"


class PaddedVocabParallelEmbedding(VocabParallelEmbedding):
    """:class:`~layers.embedding.VocabParallelEmbedding` with ``nn.Embedding``'s ``padding_idx``:
    the lookups of ``padding_idx`` pass no gradient to its row (other users of the
    weight, a tied LM head, still do). The output is unchanged.

    Example::

        wte = PaddedVocabParallelEmbedding(32000, 4096, padding_idx=0)
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, padding_idx: int, **options: Any) -> None:
        super().__init__(num_embeddings, embedding_dim, **options)
        if not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(f"padding_idx ({padding_idx}) is out of range for num_embeddings {num_embeddings}")
        self.padding_idx = padding_idx % num_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)  # (*, embedding_dim)
        pad = (ids == self.padding_idx).unsqueeze(-1)  # (*, 1)
        return torch.where(pad, out.detach(), out)  # the padding row's lookups are constants

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, padding_idx={self.padding_idx}"
