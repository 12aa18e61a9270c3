"""Linear maps fused with their tensor-parallel communication (Megatron's ``f`` and ``g``).

Fusing lets the communication work on buffers the op owns: the column-parallel
backward reduces its freshly computed input gradient in place while the weight
gradient is computed, and the row-parallel forward reduces its freshly
computed partial product in place and adds the bias once, after the sum. No
autograd input is ever written to. Both equal the unfused compositions
``F.linear(copy_to_tp(x), W, b)`` and ``reduce_from_tp(F.linear(x, W)) + b``.
Several column-parallel maps of one input (Q, K and V) share one ``f``: their
input gradients are summed locally and all-reduced once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from .collectives import start_all_reduce_
from .counter import active_counters
from .mesh import group_rank_size, tp_group

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]


def _autocast(x: torch.Tensor, *tensors: torch.Tensor | None) -> list[Any]:
    """Cast as autocast would (a custom Function's body is not autocast)."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return [x, *tensors]
    dtype = torch.get_autocast_dtype(device)
    # autocast leaves float64 alone
    return [t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
            for t in (x, *tensors)]


def _weight_grads(grad: torch.Tensor, x2: torch.Tensor, needs_weight: bool,
                  needs_bias: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    g2 = grad.reshape(-1, grad.shape[-1])  # (N, out)
    grad_w = g2.t() @ x2 if needs_weight else None  # (out, in)
    grad_b = g2.sum(0) if needs_bias else None
    return grad_w, grad_b


class _ColumnParallelLinears(torch.autograd.Function):
    """``f`` + linear maps of one input: identity-input forward; backward, one all-reduce of
    the summed input gradient, overlapped with the weight gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, n: int, *params: torch.Tensor | None) -> Any:
        x, *params = _autocast(x, *params)
        weights, biases = params[:n], params[n:]
        ctx.save_for_backward(x, *weights)
        ctx.group, ctx.counters, ctx.n = group, active_counters(), n
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no work for it
        with torch.autocast(x.device.type, enabled=False):
            return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))  # each (*, out_i / tp)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        n, needs = ctx.n, ctx.needs_input_grad
        used = [(g.reshape(-1, g.shape[-1]), w) for g, w in zip(grads, weights) if g is not None]
        pending = None
        if needs[0] and used:
            grad_x = used[0][0] @ used[0][1]  # (N, in)
            for g2, w in used[1:]:
                grad_x.addmm_(g2, w)
            pending = start_all_reduce_(grad_x, ctx.group, ctx.counters)
        x2 = x.reshape(-1, x.shape[-1])
        grad_ws, grad_bs = [], []
        for i, g in enumerate(grads):  # while the input gradient is summed
            grad_w, grad_b = (None, None) if g is None else _weight_grads(g, x2, needs[3 + i], needs[3 + n + i])
            grad_ws.append(grad_w)
            grad_bs.append(grad_b)
        grad_x = pending.wait().view(x.shape) if pending else None
        return (grad_x, None, None, *grad_ws, *grad_bs)


class _RowParallelLinear(torch.autograd.Function):
    """linear + ``g``: all-reduce of the partial products, then the bias, forward; local backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: ProcessGroup) -> torch.Tensor:
        x, weight, bias = _autocast(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(x, weight)  # (*, out), this rank's partial sum
        y = start_all_reduce_(y, group).wait()
        return y if bias is None else y.add_(bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> Grads:
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_x = grad @ weight if needs[0] else None  # (*, in / tp)
        return (grad_x, *_weight_grads(grad, x.reshape(-1, x.shape[-1]), needs[1], ctx.has_bias and needs[2]), None)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           group: ProcessGroup | None = None) -> torch.Tensor:
    """Column-parallel linear map: ``x`` (*, in) replicated, ``weight`` this rank's rows (out / tp, in).

    Equal to ``F.linear(copy_to_tp(x), weight, bias)``; the backward all-reduce
    of the input gradient overlaps the weight-gradient computation.
    """
    group = tp_group(group)
    if group_rank_size(group)[1] == 1:
        return F.linear(x, weight, bias)
    return _ColumnParallelLinears.apply(x, group, 1, weight, bias)[0]


def column_parallel_linears(x: torch.Tensor, weights: Sequence[torch.Tensor],
                            biases: Sequence[torch.Tensor | None] | None = None,
                            group: ProcessGroup | None = None) -> tuple[torch.Tensor, ...]:
    """Several column-parallel maps of one replicated input ``x`` (*, in), behind one ``f``.

    ``F.linear(copy_to_tp(x), w_i, b_i)`` for each weight (e.g. Q, K and V, or
    an MLP's up and gate projections), with no copy of the weights: one
    all-reduce of the summed input gradient backward instead of one per map.

    Example::

        q, k, v = tensorpar.column_parallel_linears(x, [wq, wk, wv], [bq, bk, bv])
    """
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"{len(weights)} weights but {len(biases)} biases")
    group = tp_group(group)
    if group_rank_size(group)[1] == 1:
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
    return _ColumnParallelLinears.apply(x, group, len(weights), *weights, *biases)


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
