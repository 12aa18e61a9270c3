"""The modules of sequence-parallel regions, which run on this rank's tokens only.

With sequence parallelism (``GPTConfig(sequence_parallel=True)``, see
:mod:`tensorpar.comm.sequence`) LayerNorm, dropout and the residual adds see
``(B, T_r, C)``, this rank's balanced share of the tokens:

* :class:`SequenceParallelLayerNorm`: ``nn.LayerNorm`` whose weight and bias
  are replicated but whose gradients, each rank's over its own tokens, are
  summed over the tp group in backward (one all-reduce of both together);
  without that sum each rank would step its copy with a different part of
  the gradient and the copies would drift apart;
* :class:`ShardedDropout`: ``nn.Dropout`` with a different mask on each rank
  (they hold different tokens), drawn from the mesh's tp stream as attention
  dropout is (Megatron's choice). The masks therefore differ from those of
  the same model without sequence parallelism at the same seed: the loss
  curves agree in distribution, not step by step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

import tensorpar
from tensorpar.mesh import current_mesh_or_none

from .regions import summed_gradients


def tp_stream(group: ProcessGroup) -> tensorpar.RNGStatesTracker:
    """The default mesh's tp stream when a module uses its group, else a stream of the module's own."""
    mesh = current_mesh_or_none()
    if mesh is not None and mesh.tp_group is group:
        return mesh.rng
    return tensorpar.RNGStatesTracker(tensorpar.group_rank_size(group)[0])


class SequenceParallelLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` over this rank's tokens, its parameter gradients summed over the tp group.

    Example::

        ln = SequenceParallelLayerNorm(768)
        y = ln(x)            # x, y: (B, T_r, 768); ln.weight.grad: every token's, on every rank
    """

    def __init__(self, normalized_shape: int | list[int] | torch.Size, eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, *, group: ProcessGroup | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device=device, dtype=dtype)
        self.tp_group = tensorpar.tp_group(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = summed_gradients([self.weight, self.bias], self.tp_group)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class ShardedDropout(nn.Dropout):
    """``nn.Dropout`` for a tensor split across the tp group: each rank draws its own mask from the
    tp stream (``rng``), leaving the default generator, which replicated regions share, in step.

    In a ``torch.compile`` graph no stream can be swapped in, so the mask is instead one draw of the
    default generator for the whole sequence, ``seq_len`` tokens, of which this rank keeps its own.
    """

    def __init__(self, p: float = 0.5, *, group: ProcessGroup | None = None) -> None:
        super().__init__(p)
        self.tp_group = tensorpar.tp_group(group)
        self.rng = tp_stream(self.tp_group)

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if torch.compiler.is_compiling():
            rank, tp = tensorpar.group_rank_size(self.tp_group)
            t = tensorpar.sequence_length(x, seq_len, self.tp_group)
            lo, n = sum(tensorpar.sequence_sizes(t, tp)[:rank]), x.shape[-2]
            keep = torch.rand(*x.shape[:-2], t, x.shape[-1], device=x.device).narrow(-2, lo, n) >= self.p
            return x * keep / (1 - self.p)
        with self.rng.fork(x.device):
            return super().forward(x)
