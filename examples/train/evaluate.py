"""Validation loss of a tp x dp model: the mean loss over fixed batches of held-out tokens."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tensorpar.mesh import Mesh

from .data import TokenData


def autocast_for(device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """Autocast to ``dtype`` on ``device`` (the CPU's too), nothing for float32; by default bf16 on a
    GPU and float32 on the CPU."""
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)


def validation_loss(model: nn.Module, data: TokenData, *, iters: int, batch_size: int, block_size: int,
                    mesh: Mesh, loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                    dtype: torch.dtype | None = None) -> float:
    """The mean of ``model(x, y)`` (a mean loss over tokens; ``loss_of(x, y)`` when given, such as a
    pipeline's ``evaluate``) over ``data``'s batches ``0 .. iters - 1``, each of ``batch_size`` rows
    over all dp ranks; a collective over dp.

    Every dp rank computes its own ``batch_size / dp`` rows of each batch, and
    as the parts are equal, the mean of the ranks' means is the mean over the
    whole batch: ``L = (1 / (iters * dp)) * sum_i sum_r L_ir``. ``dtype``: as in
    :func:`autocast_for`. The batches are
    the same at every call, so successive values compare the model, not the
    draw. The model runs in eval mode (no dropout) without gradients, and is
    put back in the mode it was in.

    Example::

        val = validation_loss(model, val_data, iters=20, batch_size=16, block_size=64, mesh=mesh)
    """
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=mesh.device, dtype=torch.float32)
    try:
        with torch.no_grad():
            for i in range(iters):
                x, y = data.batch(i, batch_size=batch_size, block_size=block_size, dp=mesh.dp, dp_rank=mesh.dp_rank)
                with autocast_for(mesh.device, dtype):
                    total += (loss_of or model)(x.to(mesh.device), y.to(mesh.device)).float()
    finally:
        model.train(was_training)
    if mesh.dp > 1:
        dist.all_reduce(total, group=mesh.dp_group)
    return total.item() / (iters * mesh.dp)
