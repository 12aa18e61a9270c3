"""The gradient norm of a tensor-parallel model, and clipping by it.

The gradient norm of a sharded model is the norm of the *unsharded* model's
gradient: each split parameter contributes its shard on every tp rank (summed
over the group), each replicated parameter (LayerNorms, row-parallel biases)
once, however many ranks hold a copy::

    ‖g‖² = Σ_r Σ_{p split} ‖g_p,r‖²  +  Σ_{p replicated} ‖g_p‖²

(a split parameter's replicated tail, such as the K and V rows of a ``c_attn``
held whole by every rank, counts once too).

Without FSDP that is one all-reduce of a scalar over the tp group: data-parallel
replicas hold the same (averaged) gradients and need nothing more.

Under FSDP2 (:func:`tensorpar.fully_shard_dp`) a gradient is a ``DTensor``
whose global tensor is the rank's tp shard (or replicated copy), split
``Shard(0)`` over the dp sub-mesh: the dp ranks hold disjoint pieces of it, so
their squares are summed over dp as well (one more scalar all-reduce). A
``DTensor`` dimension placed ``Replicate`` holds copies, each counted
``1 / size`` so that the sum over it counts one.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .comm.collectives import all_reduce_sum
from .full import local_part, placements
from .mesh import group_rank_size, tp_group
from .sharding import Shard


def _replicas(x: DTensor, name: str) -> int:
    """How many ranks of ``x``'s mesh hold each element of it (1 when every dim is sharded)."""
    copies = 1
    for placement, size in zip(x.placements, x.device_mesh.shape):
        if placement.is_partial():
            raise ValueError(f"{name}: its gradient is a DTensor with a pending reduction ({placement}) "
                             f"over a mesh of shape {tuple(x.device_mesh.shape)}: reduce it before taking norms")
        if placement.is_replicate():
            copies *= size
    return copies


def grad_norm(model: nn.Module, group: ProcessGroup | None = None, *, pp_group: ProcessGroup | None = None,
              exclude: Collection[str] = ()) -> torch.Tensor:
    """The 2-norm of the unsharded model's gradient, the same on every rank (float32).

    A collective over the tp group, and under FSDP2 over the dp sub-mesh too (every rank calls it).
    ``model`` may be one pipeline stage (or a rank's stages) of a larger model: then its squares are
    summed over ``pp_group`` too, leaving out the parameters named in ``exclude`` (copies of a
    parameter that another stage counts, such as a tied head).
    """
    split = placements(model)
    group = next(iter(split.values()))[1] if group is None and split else tp_group(group)
    _, n = group_rank_size(group)
    grads = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None and name not in exclude]
    device = local_part(grads[0][1]).device if grads else local_part(next(model.parameters())).device
    zero = torch.zeros((), dtype=torch.float32, device=device)
    sums: dict[DeviceMesh | None, torch.Tensor] = {None: zero}  # by the mesh the gradients are sharded over
    for name, grad in grads:
        copies = n if name not in split else 1  # a replica counts 1/n on each of the n tp ranks
        mesh = None
        if isinstance(grad, DTensor):
            mesh, copies = grad.device_mesh, copies * _replicas(grad, name)
        sq = _squares(grad, split[name][0] if name in split else None, n)
        sums[mesh] = sums.get(mesh, zero) + (sq if copies == 1 else sq / copies)
    if len(sums) == 1:  # no DTensor: one scalar over tp, as it always was
        return _over_stages(all_reduce_sum(sums[None], group), pp_group).sqrt()
    meshes = [mesh for mesh in sums if mesh is not None]
    totals = all_reduce_sum(torch.stack([sums[None], *(sums[m] for m in meshes)]), group)  # one over tp
    total = totals[0]
    for mesh, part in zip(meshes, totals[1:]):
        for dim in range(mesh.ndim):  # sharded pieces (and 1/size of each replica) summed over the mesh
            part = all_reduce_sum(part, mesh.get_group(dim))
        total = total + part
    return _over_stages(total, pp_group).sqrt()


def _squares(grad: torch.Tensor, placement: Shard | None, n: int) -> torch.Tensor:
    """The sum of squares of this rank's part of ``grad``, its share of a replicated tail (held by all ``n``
    tp ranks, see :class:`~tensorpar.sharding.Shard`) counted ``1 / n``."""
    local = local_part(grad).detach().float()
    sq = local.pow(2).sum()
    if placement is None or not placement.replicated or n == 1:
        return sq
    dim = placement.dim % local.dim()
    start = grad.__create_chunk_list__()[0].offsets[dim] if isinstance(grad, DTensor) else 0  # FSDP2's dp chunk
    lo = min(max(grad.shape[dim] - placement.replicated - start, 0), local.shape[dim])  # the tail's first local row
    tail = local.narrow(dim, lo, local.shape[dim] - lo).pow(2).sum()
    return sq - tail + tail / n


def _over_stages(squares: torch.Tensor, pp_group: ProcessGroup | None) -> torch.Tensor:
    """The sum of every pipeline stage's squares (``squares`` itself without pipelining)."""
    return squares if pp_group is None or group_rank_size(pp_group)[1] == 1 else all_reduce_sum(squares, pp_group)


def clip_grad_norm_(model: nn.Module, max_norm: float, group: ProcessGroup | None = None, *,
                    pp_group: ProcessGroup | None = None, exclude: Collection[str] = ()) -> torch.Tensor:
    """Scale the gradients so that the unsharded model's gradient norm is at most ``max_norm``
    (as ``torch.nn.utils.clip_grad_norm_`` would on the unsharded model); return the norm before.

    Works alike on plain tp models (with DDP or ``ZeroRedundancyOptimizer`` over dp) and on
    models sharded over dp with :func:`tensorpar.fully_shard_dp`, and on pipeline stages (``pp_group``,
    ``exclude``: see :func:`grad_norm`).

    Example::

        loss.backward()
        norm = tensorpar.clip_grad_norm_(model, 1.0)
        optimizer.step()
    """
    norm = grad_norm(model, group, pp_group=pp_group, exclude=exclude)
    coef = max_norm / (norm.item() + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            grads = [local_part(p.grad) for p in model.parameters() if p.grad is not None]
            torch._foreach_mul_(grads, coef)
    return norm
