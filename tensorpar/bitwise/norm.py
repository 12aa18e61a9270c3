"""LayerNorm or RMSNorm whose weight and bias gradients add the tokens by canonical segments (bitwise mode).

A LayerNorm's output and input gradient are computed row by row, the same whatever rows a rank
holds. Its weight and bias gradients add every token's part, ``Σ_t dy_t · x̂_t`` and ``Σ_t dy_t``;
with sequence parallelism each rank holds some tokens and the parts are summed over the group. Here
both are tree sums over the canonical segments of the sequence (:func:`~.linear.token_sum`), with or
without sequence parallelism, so the gradients are the same bits either way and at every tp.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from ..comm.linear import autocast_off
from ..comm.sequence import sequence_length
from ..mesh import group_rank_size
from .linear import token_sum
from .segments import PlacedTree, placed_tokens


class _TokenwiseLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                shape: list[int], eps: float, tokens: PlacedTree, group: ProcessGroup | None, rms: bool
                ) -> torch.Tensor:
        ctx.dims = tuple(range(-len(shape), 0))
        with autocast_off(x):  # autocast leaves a LayerNorm's dtype alone
            if rms:  # RMSNorm: x / sqrt(mean(x²) + eps) * weight, no mean saved
                mean, rstd = None, torch.rsqrt(x.pow(2).mean(ctx.dims, keepdim=True) + eps)
                y = x * rstd * weight if weight is not None else x * rstd
            else:
                y, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.shape, ctx.tokens, ctx.group = shape, tokens, group
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, bias, mean, rstd = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_x = None
        normalized = x * rstd if mean is None else (x - mean) * rstd  # (..., T_r, C)
        if needs[0] and mean is None:  # row by row: rstd (dy w - x̂ mean(dy w x̂))
            dy = grad * weight if weight is not None else grad
            grad_x = rstd * (dy - normalized * (dy * normalized).mean(ctx.dims, keepdim=True))
        elif needs[0]:
            grad_x = torch.ops.aten.native_layer_norm_backward(grad, x, ctx.shape, mean, rstd, weight, bias,
                                                               [True, False, False])[0]
        grad_w = grad_b = None
        if weight is not None and needs[1]:
            grad_w = token_sum(grad * normalized, ctx.tokens, ctx.group).to(weight.dtype)
        if bias is not None and needs[2]:
            grad_b = token_sum(grad, ctx.tokens, ctx.group).to(bias.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class TokenwiseNorm:
    """``F.layer_norm`` (``F.rms_norm`` with ``rms``) of ``shape`` and ``eps``, a callable ``(x, weight, bias,
    seq_len)`` of ``x`` ``(..., T_r, C)`` whose weight and bias gradients add the tokens by their canonical
    segments: this rank's share of them with ``sequence_parallel`` (then summed over the group; ``seq_len``
    names the full length, else one small collective finds it), else every token."""

    def __init__(self, shape: Sequence[int], eps: float, group: ProcessGroup, sequence_parallel: bool,
                 tp_sizes: Sequence[int], *, rms: bool = False) -> None:
        self.shape, self.eps, self.group, self.sequence_parallel = list(shape), eps, group, sequence_parallel
        self.tp_sizes, self.rms = tp_sizes, rms

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 seq_len: int | None = None) -> torch.Tensor:
        rank, tp = group_rank_size(self.group)
        if self.sequence_parallel:
            seq_len = sequence_length(x, seq_len, self.group)
        tokens = placed_tokens(x.shape[-2] if not self.sequence_parallel and x.dim() > 1 else seq_len or 1,
                               tp, rank, self.tp_sizes, split=self.sequence_parallel)
        return _TokenwiseLayerNorm.apply(x, weight, bias, self.shape, self.eps, tokens,
                                         self.group if self.sequence_parallel else None, self.rms)
