"""The gradient norm of a tensor-parallel model, and clipping by it.

The norm is the *unsharded* model's: each split parameter contributes its shard on every tp rank,
each replicated one (LayerNorms, row-parallel biases, a split parameter's replicated tail) once::

    ‖g‖² = Σ_r Σ_{p split} ‖g_p,r‖²  +  Σ_{p replicated} ‖g_p‖²

Without FSDP that is one scalar all-reduce over tp (dp replicas hold the same averaged gradients).
Under FSDP2 a gradient is a ``DTensor`` over the dp sub-mesh whose global tensor is the rank's tp shard:
its ``Shard(0)`` pieces are summed over dp too, and each copy along a ``Replicate`` dim counts ``1 / size``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed import ProcessGroup

from .bitwise.grad_norm import squared_norm
from .bitwise.settings import Bitwise
from .comm.collectives import all_reduce_sum
from .full import is_dtensor, local_part, placements
from .mesh import group_rank_size, tp_group
from .sharding import Shard

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

def _replicas(x: DTensor, name: str) -> int:
    """How many ranks of ``x``'s mesh hold each element of it (1 when every dim is sharded)."""
    copies = 1
    for placement, size in zip(x.placements, x.device_mesh.shape, strict=True):
        if placement.is_partial():
            raise ValueError(f"{name}: its gradient is a DTensor with a pending reduction ({placement}) "
                             f"over a mesh of shape {tuple(x.device_mesh.shape)}: reduce it before taking norms")
        if placement.is_replicate():
            copies *= size
    return copies

def grad_norm(model: nn.Module, group: ProcessGroup | None = None, *, pp_group: ProcessGroup | None = None,
              exclude: Collection[str] = ()) -> torch.Tensor:
    """The 2-norm of the unsharded model's gradient, the same on every rank: float64 where a gradient is
    float64 (as ``torch.nn.utils.get_total_norm``), else float32 (16-bit gradients accumulate in float32).

    A collective over tp (under FSDP2 over dp too). For a pipeline stage (or a rank's stages) the squares
    are summed over ``pp_group`` too, leaving out ``exclude`` (copies another stage counts, such as a tied
    head). torch's foreach norms, one launch per bucket of gradients sharing a mesh, replica count, device
    and dtype; a model built in bitwise mode (``model.numerics``) sums by canonical segments
    (:mod:`tensorpar.bitwise.grad_norm`), the same bits at every tp.
    """
    split = placements(model)
    group = next(iter(split.values()))[1] if group is None and split else tp_group(group)
    _, n = group_rank_size(group)
    mode = getattr(model, "numerics", None)  # the numerics the model was built in
    if isinstance(mode, Bitwise):
        with torch.no_grad():
            return _summed(squared_norm(model, mode, split, group, exclude), pp_group).sqrt()
    buckets: dict[tuple[DeviceMesh | None, int, torch.device, torch.dtype], list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is None or name in exclude:
            continue
        copies = n if name not in split else 1  # a replica counts 1/n on each of the n tp ranks
        mesh = None
        if is_dtensor(p.grad):
            mesh, copies = p.grad.device_mesh, copies * _replicas(p.grad, name)
        for grad, held in _parts(p.grad, split[name][0] if name in split else None, n):
            buckets.setdefault((mesh, copies * held, grad.device, grad.dtype), []).append(grad)
    device = next(iter(buckets))[2] if buckets else local_part(next(model.parameters())).device
    total_dtype = torch.float64 if any(key[3] == torch.float64 for key in buckets) else torch.float32
    with torch.no_grad():  # 16-bit gradients' norms in float32; float64's in float64
        norms = {key: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(
            grads, 2.0, dtype=torch.float32 if key[3].itemsize < 4 else None))).to(device, total_dtype)
            for key, grads in buckets.items()}  # () each
    alone = n == 1 and (pp_group is None or group_rank_size(pp_group)[1] == 1)
    if alone and len(norms) == 1 and next(iter(norms))[0] is None:
        return next(iter(norms.values()))  # one bucket of whole, unreplicated gradients: nothing to sum
    zero = torch.zeros((), dtype=total_dtype, device=device)
    sums: dict[DeviceMesh | None, torch.Tensor] = {None: zero}  # squares, by the mesh the gradients are sharded over
    for (mesh, copies, _, _), norm in norms.items():
        sq = norm.square()
        sums[mesh] = sums.get(mesh, zero) + (sq if copies == 1 else sq / copies)
    meshes = [mesh for mesh in sums if mesh is not None]
    totals = _summed(torch.stack([sums[None], *(sums[m] for m in meshes)]), group)  # one over tp
    total = totals[0]
    for mesh, part in zip(meshes, totals[1:], strict=True):
        for dim in range(mesh.ndim):  # sharded pieces (and 1/size of each replica) summed over the mesh
            part = _summed(part, mesh.get_group(dim))
        total = total + part
    return _summed(total, pp_group).sqrt()  # and over the pipeline stages

def _parts(grad: torch.Tensor, placement: Shard | None, n: int) -> list[tuple[torch.Tensor, int]]:
    """This rank's part of ``grad`` with the number of tp ranks holding each piece: a replicated tail
    (see :class:`~tensorpar.sharding.Shard`) is held by all ``n``, the rest by this rank alone."""
    local = local_part(grad)
    if placement is None or not placement.replicated or n == 1:
        return [(local, 1)]
    dim = placement.dim % local.dim()
    start = grad.__create_chunk_list__()[0].offsets[dim] if is_dtensor(grad) else 0  # FSDP2's dp chunk
    lo = min(max(grad.shape[dim] - placement.replicated - start, 0), local.shape[dim])  # the tail's first local row
    return [(local.narrow(dim, 0, lo), 1), (local.narrow(dim, lo, local.shape[dim] - lo), n)]

def _summed(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``x`` summed over ``group`` (``x`` itself on a group of one, or with no group)."""
    return x if group is None or group_rank_size(group)[1] == 1 else all_reduce_sum(x, group)

def clip_grad_norm_(model: nn.Module, max_norm: float, group: ProcessGroup | None = None, *,
                    pp_group: ProcessGroup | None = None, exclude: Collection[str] = (),
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients so that the unsharded model's gradient norm is at most ``max_norm`` (as
    ``torch.nn.utils.clip_grad_norm_`` on the unsharded model); return the norm before. For plain tp models
    (DDP or ZeRO over dp), FSDP2 models and pipeline stages (``pp_group``, ``exclude``: :func:`grad_norm`).

    No host sync: every gradient is multiplied by ``min(1, max_norm / (norm + 1e-6))`` on the device. As in
    torch, a non-finite norm makes the factor NaN or 0; ``error_if_nonfinite=True`` raises a
    ``RuntimeError`` on every rank instead, before any gradient changes (one host sync). ``max_norm``
    must be a number >= 0. Call it between ``loss.backward()`` and ``optimizer.step()``.
    """
    try:
        limit = float(max_norm)
    except (TypeError, ValueError):
        raise TypeError(f"clip_grad_norm_: max_norm must be a number, got {max_norm!r:.80}") from None
    if not limit >= 0:  # NaN too
        raise ValueError(f"clip_grad_norm_: max_norm must be a number >= 0, got {limit} "
                         "(a negative one would flip the gradients)")
    norm = grad_norm(model, group, pp_group=pp_group, exclude=exclude)
    if error_if_nonfinite and not torch.isfinite(norm).item():
        raise RuntimeError(f"clip_grad_norm_: the total norm of the gradients is {norm.item()}, not finite, so "
                           "it cannot be clipped (error_if_nonfinite=False scales the gradients by it anyway)")
    coef = (limit / (norm + 1e-6)).clamp(max=1.0)  # (), on the device: nothing branches on it
    grads = [local_part(p.grad) for p in model.parameters() if p.grad is not None]
    with torch.no_grad():
        for device in {g.device for g in grads}:  # one foreach launch per device
            torch._foreach_mul_([g for g in grads if g.device == device], coef.to(device))
    return norm
