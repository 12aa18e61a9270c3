"""The modules of sequence-parallel regions, which run on this rank's tokens only.

With sequence parallelism (``GPTConfig(sequence_parallel=True)``, see
:mod:`tensorpar.comm.sequence`) LayerNorm, dropout and the residual adds see
``(B, T_r, C)``, this rank's balanced share of the tokens:

* :class:`SequenceParallelLayerNorm` (a :class:`ParallelLayerNorm` over this
  rank's tokens): ``nn.LayerNorm`` whose weight and bias are replicated but
  whose gradients, each rank's over its own tokens, are summed over the tp
  group in backward; :class:`ParallelRMSNorm` likewise for ``nn.RMSNorm``;
* :class:`ShardedDropout`: ``nn.Dropout`` with a different mask on each rank
  (they hold different tokens), drawn from the mesh's tp stream as attention
  dropout is (Megatron's choice). The masks therefore differ from those of
  the same model without sequence parallelism at the same seed: the loss
  curves agree in distribution, not step by step.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

import tensorpar
from tensorpar.mesh import current_mesh_or_none

from . import numerics
from .regions import summed_gradients


def tp_stream(group: ProcessGroup) -> tensorpar.RNGStatesTracker:
    """The default mesh's tp stream when a module uses its group, else a stream of the module's own."""
    mesh = current_mesh_or_none()
    if mesh is not None and mesh.tp_group is group:
        return tensorpar.random.tracker(mesh)
    return tensorpar.RNGStatesTracker(tensorpar.group_rank_size(group)[0])


class ParallelLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` in a tensor-parallel model: its weight and bias are replicated, and its gradients
    add every token's part.

    With ``sequence_parallel=True`` it normalises this rank's tokens ``(..., T_r, C)``, and the gradients
    of its weight and bias, each rank's over its own tokens, are summed over the tp group (one all-reduce
    of both together; without that sum each rank would step its copy with a different part of the
    gradient and the copies would drift apart). In bitwise mode (:class:`tensorpar.bitwise.norm.TokenwiseNorm`)
    both are tree sums over canonical segments of the sequence, the same bits with or without sequence
    parallelism.
    ``forward(x, seq_len=T)`` names the full length (else, with sequence parallelism in bitwise mode, one
    small collective finds it).

    Example::

        ln = ParallelLayerNorm(768, sequence_parallel=True)
        y = ln(x)            # x, y: (B, T_r, 768); ln.weight.grad: every token's, on every rank
    """

    def __init__(self, normalized_shape: int | list[int] | torch.Size, eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, *, sequence_parallel: bool = False,
                 group: ProcessGroup | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device=device, dtype=dtype)
        self.tp_group = tensorpar.tp_group(group)
        self.sequence_parallel = sequence_parallel
        # (x, weight, bias, seq_len) -> normalised x: the default, or the bitwise mode's (chosen once)
        self.norm = numerics.layer_norm(self._norm, self, self.tp_group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        return self.norm(x, self.weight, self.bias, seq_len)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
              seq_len: int | None = None) -> torch.Tensor:
        if self.sequence_parallel:  # every token's gradients, summed over the group
            weight, bias = summed_gradients([weight, bias], self.tp_group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", sequence_parallel=True" if self.sequence_parallel else "")


class ParallelRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` in a tensor-parallel model (Llama's norm: a scale, no bias), as
    :class:`ParallelLayerNorm`: with ``sequence_parallel=True`` over this rank's tokens, its weight's
    gradient summed over the tp group; in bitwise mode added by canonical segments of the sequence.

    Example::

        norm = ParallelRMSNorm(768, eps=1e-6, sequence_parallel=True)
        y = norm(x)          # x, y: (B, T_r, 768); norm.weight.grad: every token's, on every rank
    """

    def __init__(self, normalized_shape: int | list[int] | torch.Size, eps: float = 1e-6,
                 elementwise_affine: bool = True, *, sequence_parallel: bool = False,
                 group: ProcessGroup | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        self.tp_group = tensorpar.tp_group(group)
        self.sequence_parallel = sequence_parallel
        self.norm = numerics.layer_norm(self._norm, self, self.tp_group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        return self.norm(x, self.weight, None, seq_len)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None, bias: None = None,
              seq_len: int | None = None) -> torch.Tensor:
        if self.sequence_parallel:  # every token's gradient, summed over the group
            weight = summed_gradients([weight], self.tp_group)[0]
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", sequence_parallel=True" if self.sequence_parallel else "")


class SequenceParallelLayerNorm(ParallelLayerNorm):
    """:class:`ParallelLayerNorm` over this rank's tokens (``sequence_parallel=True``).

    Example::

        ln = SequenceParallelLayerNorm(768)
        y = ln(x)            # x, y: (B, T_r, 768); ln.weight.grad: every token's, on every rank
    """

    def __init__(self, normalized_shape: int | list[int] | torch.Size, eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, *, group: ProcessGroup | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, sequence_parallel=True, group=group,
                         device=device, dtype=dtype)

    def extra_repr(self) -> str:
        return nn.LayerNorm.extra_repr(self)


def layer_norm(n_embd: int, *, bias: bool, sequence_parallel: bool, group: ProcessGroup | None,
               device: torch.device | str | None, dtype: torch.dtype | None, kind: str = "layernorm",
               eps: float = 1e-5) -> nn.LayerNorm | nn.RMSNorm:
    """A block's or the GPT's norm (``kind``: ``"layernorm"`` or ``"rmsnorm"``, which has no bias):
    ``nn.LayerNorm`` / ``nn.RMSNorm``, or where the tokens its gradients add are split (sequence
    parallelism) or added by segments (bitwise mode), a :class:`ParallelLayerNorm` / :class:`ParallelRMSNorm`."""
    if kind == "rmsnorm":
        parallel = functools.partial(ParallelRMSNorm, sequence_parallel=sequence_parallel, group=group)
        rms = parallel if sequence_parallel else numerics.chosen(nn.RMSNorm, lambda: parallel)
        return rms(n_embd, eps, device=device, dtype=dtype)
    if sequence_parallel:
        return SequenceParallelLayerNorm(n_embd, eps, bias=bias, group=group, device=device, dtype=dtype)
    cls = numerics.chosen(nn.LayerNorm, lambda: functools.partial(ParallelLayerNorm, sequence_parallel=False,
                                                                  group=group))
    return cls(n_embd, eps, bias=bias, device=device, dtype=dtype)


class ShardedDropout(nn.Dropout):
    """``nn.Dropout`` for a tensor split across the tp group: each rank draws its own mask from the
    tp stream (``rng``), leaving the default generator, which replicated regions share, in step.

    In a ``torch.compile`` graph no stream can be swapped in, so the mask is instead one draw of the
    default generator for the whole sequence, ``seq_len`` tokens, of which this rank keeps its own; so it
    is in the bitwise mode, where every tp must drop the same elements (chosen once, when it is built).
    """

    def __init__(self, p: float = 0.5, *, group: ProcessGroup | None = None) -> None:
        super().__init__(p)
        self.tp_group = tensorpar.tp_group(group)
        self.rng = tp_stream(self.tp_group)
        self.drop = numerics.chosen(self._own_mask, lambda: self._one_draw)  # (x, seq_len) -> x dropped

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if torch.compiler.is_compiling():  # no stream can be swapped in a graph
            return self._one_draw(x, seq_len)
        return self.drop(x, seq_len)

    def _own_mask(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """This rank's mask, from the tp stream."""
        with self.rng.fork(x.device):
            return super().forward(x)

    def _one_draw(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """This rank's tokens of one draw of the default generator for the whole sequence."""
        rank, tp = tensorpar.group_rank_size(self.tp_group)
        t = tensorpar.sequence_length(x, seq_len, self.tp_group)
        lo, n = sum(tensorpar.sequence_sizes(t, tp)[:rank]), x.shape[-2]
        keep = torch.rand(*x.shape[:-2], t, x.shape[-1], device=x.device).narrow(-2, lo, n) >= self.p
        return x * keep / (1 - self.p)
