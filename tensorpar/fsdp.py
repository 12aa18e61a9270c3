"""Fully sharded data parallelism (FSDP2) over the mesh's dp dimension, tensor parallelism inside.

Each rank's local tensors (its tp shards, and replicated parameters whole) go to torch's ``fully_shard``
on the 1-D ``dp`` sub-mesh, which splits each one's dim 0 like ``torch.chunk``::

    full (m, k) --tensorpar, tp--> (m_r, k) --FSDP2, dp--> (⌈m_r / dp⌉, k) or fewer rows

Parameters and gradients become ``DTensor``\\ s (``Shard(0)`` over dp, global shape the tp shard): FSDP2
all-gathers them over dp around each forward and backward, so modules compute on their plain tp shards,
and reduce-scatters the gradients; :mod:`tensorpar.full` and :mod:`tensorpar.clipping` read both dims.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from torch import nn

from .mesh import Mesh, current_mesh

if TYPE_CHECKING:  # imported when called: torch.distributed.fsdp's FSDP2 API is torch >= 2.6
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy


def fully_shard_dp(model: nn.Module, mesh: Mesh | None = None, *, modules: Iterable[nn.Module] = (),
                   reshard_after_forward: bool = True,
                   mp_policy: MixedPrecisionPolicy | None = None,
                   offload_policy: OffloadPolicy | None = None) -> nn.Module:
    """Shard ``model``'s parameters, gradients and optimizer state over the dp dimension of ``mesh``
    with FSDP2, keeping tensorpar's tp shards inside; return ``model`` (now an ``FSDPModule``).

    Each of ``modules`` (e.g. the blocks) becomes its own FSDP2 unit; ``model`` takes the parameters left.
    Build the optimizer *after* this call (FSDP2 replaces the parameters). ``reshard_after_forward``,
    ``mp_policy`` (a ``MixedPrecisionPolicy``) and ``offload_policy`` (``CPUOffloadPolicy``: FSDP2's
    ZeRO-Offload) are ``fully_shard``'s. Then :func:`tensorpar.full_state_dict`, :func:`tensorpar.full_grads`
    and :func:`tensorpar.clip_grad_norm_` are collectives over the whole mesh. E.g.
    ``fully_shard_dp(gpt, modules=gpt.transformer.h)``, then ``torch.optim.AdamW(gpt.parameters())``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if not isinstance(model, nn.Module):
        raise TypeError(f"fully_shard_dp expects an nn.Module, got {type(model).__name__}")
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a tensorpar Mesh (from tensorpar.init) or None, got {type(mesh).__name__}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
    units = list(modules)
    inside = {id(m) for m in model.modules()}
    for i, unit in enumerate(units):
        if not isinstance(unit, nn.Module):
            raise TypeError(f"modules[{i}] is a {type(unit).__name__}, not an nn.Module")
        if id(unit) not in inside or unit is model:
            raise ValueError(f"modules[{i}] ({type(unit).__name__}) is not a submodule of the model "
                             f"(it must be one of {len(inside) - 1} submodules, the model itself excluded)")
    if len({id(u) for u in units}) != len(units):
        raise ValueError(f"modules lists a module more than once ({len(units)} entries, "
                         f"{len({id(u) for u in units})} distinct)")
    for name, policy, kind in (("mp_policy", mp_policy, MixedPrecisionPolicy),
                               ("offload_policy", offload_policy, OffloadPolicy)):
        if policy is not None and not isinstance(policy, kind):
            raise TypeError(f"{name} must be an FSDP2 {kind.__name__}, got {type(policy).__name__}")
    dp = (mesh or current_mesh()).device_mesh["dp"]  # the 1-D dp sub-mesh
    mp, offload = mp_policy or MixedPrecisionPolicy(), offload_policy or OffloadPolicy()  # None: torch's defaults
    for unit in [*units, model]:  # bottom-up: each unit keeps its own parameters, the root takes the rest
        fully_shard(unit, mesh=dp, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload)
    return model
