"""Linear maps fused with their tensor-parallel communication (Megatron's ``f`` and ``g``).

The column-parallel backward all-reduces its fresh input gradient while the weight gradient is computed;
the row-parallel forward reduces its fresh partial product and adds the bias once, after the sum. Both
equal ``F.linear(copy_to_tp(x), W, b)`` and ``reduce_from_tp(F.linear(x, W)) + b``. Several column maps of
one input (Q, K, V) share one ``f`` instead (:func:`~tensorpar.copy_to_tp` once, in front of them all), so
autograd sums their input gradients before the single all-reduce, which then cannot overlap them.
Without gradients (decoding) the forward runs outside the autograd Function, and autocast is switched off
only where it is on: the same computation, with less Python on a rank just woken from a collective.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from ..mesh import tp_group
from .collectives import start_all_reduce_


def autocast_inputs(x: torch.Tensor, *tensors: torch.Tensor | None) -> list[Any]:
    """Cast as autocast would (a custom Function's body is not autocast)."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return [x, *tensors]
    dtype = torch.get_autocast_dtype(device)
    # autocast leaves float64 alone
    return [t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
            for t in (x, *tensors)]


def autocast_off(x: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """A region with autocast off for ``x``'s device: ``torch.autocast(enabled=False)`` where autocast is on,
    else nothing to enter (its Python costs ~30 µs a call on a rank just woken from a collective)."""
    device = x.device.type
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()


def weight_grads(grad: torch.Tensor, x2: torch.Tensor, needs_weight: bool,
                  needs_bias: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A linear map's weight and bias gradients (those needed) from its output gradient ``grad``
    ``(*, out)`` and its input ``x2`` ``(N, in)``."""
    g2 = grad.reshape(-1, grad.shape[-1])  # (N, out)
    grad_w = g2.t() @ x2 if needs_weight else None  # (out, in)
    grad_b = g2.sum(0) if needs_bias else None
    return grad_w, grad_b


def add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y + bias``, a new tensor (torch 2.11 compiles a Function returning a tensor it wrote in place to zero
    gradients)."""
    return y if bias is None else y + bias


def _column_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The column-parallel forward of inputs cast as autocast would: ``(*, in) -> (*, out / tp)``."""
    with autocast_off(x):
        return F.linear(x, weight, bias)


def _row_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 group: ProcessGroup) -> torch.Tensor:
    """The row-parallel forward of inputs cast as autocast would: ``(*, in / tp) -> (*, out)``, summed."""
    with autocast_off(x):
        y = start_all_reduce_(F.linear(x, weight), group).wait()  # (*, out), summed over the group
    return add_bias(y, bias)


class _ColumnParallelLinear(torch.autograd.Function):
    """``f`` + linear: identity-input forward; backward, the all-reduce of the input gradient,
    overlapped with the weight gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: ProcessGroup) -> torch.Tensor:
        x, weight, bias = autocast_inputs(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return _column_product(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        pending = start_all_reduce_(grad @ weight, ctx.group) if needs[0] else None  # (*, in)
        # while the input gradient is summed
        grad_w, grad_b = weight_grads(grad, x.reshape(-1, x.shape[-1]), needs[1], ctx.has_bias and needs[2])
        return (pending.wait() if pending else None), grad_w, grad_b, None


class _RowParallelLinear(torch.autograd.Function):
    """linear + ``g``: all-reduce of the partial products, then the bias, forward; local backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: ProcessGroup) -> torch.Tensor:
        x, weight, bias = autocast_inputs(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _row_product(x, weight, bias, group)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_x = grad @ weight if needs[0] else None  # (*, in / tp)
        return (grad_x, *weight_grads(grad, x.reshape(-1, x.shape[-1]), needs[1], ctx.has_bias and needs[2]), None)


def check_linear_args(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """A clear error, before any collective, for arguments ``F.linear`` would reject."""
    for what, t in (("x", x), ("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor) and (t is not None or what != "bias"):
            raise TypeError(f"{name}: {what} must be a tensor, got {type(t).__name__}")
        if t is not None and not t.dtype.is_floating_point:
            raise TypeError(f"{name}: {what} dtype {t.dtype} is not a floating-point dtype")
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}: input of shape {tuple(x.shape)} does not fit a weight of shape "
                         f"{tuple(weight.shape)} (its last dim must equal the weight's second)")


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           group: ProcessGroup | None = None) -> torch.Tensor:
    """Column-parallel linear map, ``F.linear(copy_to_tp(x), weight, bias)``: ``x`` (*, in) replicated,
    ``weight`` this rank's rows (out / tp, in)."""
    check_linear_args("column_parallel_linear", x, weight, bias)
    group = tp_group(group)
    if group.size() == 1:
        return F.linear(x, weight, bias)
    if not torch.is_grad_enabled():  # the forward alone (decoding): no autograd Function to enter
        x, weight, bias = autocast_inputs(x, weight, bias)
        return _column_product(x, weight, bias)
    return _ColumnParallelLinear.apply(x, weight, bias, group)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        group: ProcessGroup | None = None) -> torch.Tensor:
    """Row-parallel linear map, ``reduce_from_tp(F.linear(x, weight)) + bias``: ``x`` (*, in / tp) this
    rank's slice, ``weight`` its columns (out, in / tp)."""
    check_linear_args("row_parallel_linear", x, weight, bias)
    group = tp_group(group)
    if group.size() == 1:
        return F.linear(x, weight, bias)
    if not torch.is_grad_enabled():  # the forward alone (decoding): no autograd Function to enter
        x, weight, bias = autocast_inputs(x, weight, bias)
        return _row_product(x, weight, bias, group)
    return _RowParallelLinear.apply(x, weight, bias, group)
