"""The gradient norm of a tensor-parallel model, and clipping by it.

The gradient norm of a sharded model is the norm of the *unsharded* model's
gradient: each split parameter contributes its shard on every tp rank (summed
over the group), each replicated parameter (LayerNorms, row-parallel biases)
once, however many ranks hold a copy::

    ‖g‖² = Σ_r Σ_{p split} ‖g_p,r‖²  +  Σ_{p replicated} ‖g_p‖²

One all-reduce of a scalar over the tp group; data-parallel replicas hold the
same (averaged) gradients and need nothing more.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from .comm.collectives import all_reduce_sum
from .full import placements
from .mesh import group_rank_size, tp_group


def grad_norm(model: nn.Module, group: ProcessGroup | None = None) -> torch.Tensor:
    """The 2-norm of the unsharded model's gradient, the same on every rank (float32)."""
    split = placements(model)
    group = next(iter(split.values()))[1] if group is None and split else tp_group(group)
    _, n = group_rank_size(group)
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
