"""Pieces of a tensor-parallel training loop: the global gradient norm and the LR schedule.

The gradient norm of a sharded model is the norm of the *unsharded* model's
gradient: each split parameter contributes its shard on every tp rank (summed
over the group), each replicated parameter (LayerNorms, row-parallel biases)
once, however many ranks hold a copy::

    ‖g‖² = Σ_r Σ_{p split} ‖g_p,r‖²  +  Σ_{p replicated} ‖g_p‖²

One all-reduce of a scalar over the tp group; data-parallel replicas hold the
same (averaged) gradients and need nothing more.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed import ProcessGroup

from .collectives import all_reduce_sum
from .mesh import group_rank_size, tp_group
from .state import sharded_entries


def grad_norm(model: nn.Module, group: ProcessGroup | None = None) -> torch.Tensor:
    """The 2-norm of the unsharded model's gradient, the same on every rank (float32)."""
    entries = list(sharded_entries(model))
    group = entries[0][2] if group is None and entries else tp_group(group)
    _, n = group_rank_size(group)
    split = {key for key, _, _ in entries}
    grads = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    device = grads[0][1].device if grads else next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for name, grad in grads:
        sq = grad.detach().float().pow(2).sum()
        total += sq if name in split else sq / n  # a replica counts 1/n on each of the n ranks
    return all_reduce_sum(total, group).sqrt()


def clip_grad_norm_(model: nn.Module, max_norm: float, group: ProcessGroup | None = None) -> torch.Tensor:
    """Scale the gradients so that the unsharded model's gradient norm is at most ``max_norm``
    (as ``torch.nn.utils.clip_grad_norm_`` would on the unsharded model); return the norm before.

    Example::

        loss.backward()
        norm = tensorpar.clip_grad_norm_(model, 1.0)
        optimizer.step()
    """
    norm = grad_norm(model, group)
    coef = max_norm / (norm.item() + 1e-6)
    if coef < 1.0:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, coef)
    return norm


def cosine_lr(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``min_lr`` at step ``total`` (nanoGPT's)."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step >= total:
        return min_lr
    ratio = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
