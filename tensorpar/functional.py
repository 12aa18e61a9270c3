"""Linear maps fused with their tensor-parallel communication (Megatron's ``f`` and ``g``).

Fusing lets the communication work on buffers the op owns: the column-parallel
backward reduces its freshly computed input gradient in place while the weight
gradient is computed, and the row-parallel forward reduces its freshly
computed partial product in place and adds the bias once, after the sum. No
autograd input is ever written to. Both equal the unfused compositions
``F.linear(copy_to_tp(x), W, b)`` and ``reduce_from_tp(F.linear(x, W)) + b``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from .collectives import start_all_reduce_
from .counter import active_counters
from .mesh import group_rank_size, tp_group

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]


def _autocast(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Cast as autocast would (a custom Function's body is not autocast), and remember for backward."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)

        def cast(t: torch.Tensor | None) -> Any:  # autocast leaves float64 alone
            return t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t

        x, weight, bias = cast(x), cast(weight), cast(bias)
    ctx.save_for_backward(x, weight)
    ctx.has_bias, ctx.counters = bias is not None, active_counters()
    return x, weight, bias


def _weight_grads(ctx: Any, grad: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    g2 = grad.reshape(-1, grad.shape[-1])  # (N, out)
    grad_w = g2.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None  # (out, in)
    grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_w, grad_b


class _ColumnParallelLinear(torch.autograd.Function):
    """``f`` + linear: identity-input forward; all-reduce of the input gradient, overlapped, backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: ProcessGroup) -> torch.Tensor:
        x, weight, bias = _autocast(ctx, x, weight, bias)
        ctx.group = group
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, weight, bias)  # (*, out / tp)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> Grads:
        x, weight = ctx.saved_tensors
        pending = start_all_reduce_(grad @ weight, ctx.group, ctx.counters) if ctx.needs_input_grad[0] else None
        grad_w, grad_b = _weight_grads(ctx, grad, x)  # while the input gradient (*, in) is summed
        return (pending.wait() if pending else None), grad_w, grad_b, None


class _RowParallelLinear(torch.autograd.Function):
    """linear + ``g``: all-reduce of the partial products, then the bias, forward; local backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: ProcessGroup) -> torch.Tensor:
        x, weight, bias = _autocast(ctx, x, weight, bias)
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(x, weight)  # (*, out), this rank's partial sum
        y = start_all_reduce_(y, group).wait()
        return y if bias is None else y.add_(bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> Grads:
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None  # (*, in / tp)
        return (grad_x, *_weight_grads(ctx, grad, x), None)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           group: ProcessGroup | None = None) -> torch.Tensor:
    """Column-parallel linear map: ``x`` (*, in) replicated, ``weight`` this rank's rows (out / tp, in).

    Equal to ``F.linear(copy_to_tp(x), weight, bias)``; the backward all-reduce
    of the input gradient overlaps the weight-gradient computation.
    """
    group = tp_group(group)
    if group_rank_size(group)[1] == 1:
        return F.linear(x, weight, bias)
    return _ColumnParallelLinear.apply(x, weight, bias, group)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        group: ProcessGroup | None = None) -> torch.Tensor:
    """Row-parallel linear map: ``x`` (*, in / tp) this rank's slice, ``weight`` its columns (out, in / tp).

    Equal to ``reduce_from_tp(F.linear(x, weight)) + bias``: the output
    (*, out) is summed over the group, the bias added once.
    """
    group = tp_group(group)
    if group_rank_size(group)[1] == 1:
        return F.linear(x, weight, bias)
    return _RowParallelLinear.apply(x, weight, bias, group)
