"""Fully sharded data parallelism (FSDP2) over the mesh's dp dimension, tensor parallelism inside.

On a ``(dp, tp)`` mesh each rank already holds its balanced tp shard of every
split parameter as a plain tensor (and the whole of each replicated one).
:func:`fully_shard_dp` hands those local tensors to torch's ``fully_shard`` on
the 1-D ``dp`` sub-mesh, which treats each as a tensor of its own and splits
its dim 0 into ``dp`` chunks (``torch.chunk``: ``⌈d0 / dp⌉`` rows, the last
chunks shorter or empty). A weight of full shape ``(m, k)`` split by rows over
tp is then held as about ``m / (tp · dp)`` rows on each rank, and so are its
gradient and its optimizer state::

    full (m, k) --tensorpar, tp--> (m_r, k) --FSDP2, dp--> (⌈m_r / dp⌉, k) or fewer rows

Registered parameters and gradients become ``DTensor``\\ s sharded ``Shard(0)``
over the dp sub-mesh, whose global shape is the rank's tp shard. Before a
module's forward and backward FSDP2 all-gathers its parameters over dp, so the
module computes on its plain tp shard exactly as without FSDP; after backward
it reduce-scatters (and averages) the gradients over dp. tensorpar's full views
(:mod:`tensorpar.full`) and gradient norm (:mod:`tensorpar.clipping`) read
those ``DTensor``\\ s on both dimensions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

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

    Each of ``modules`` (e.g. the transformer blocks) becomes its own FSDP2 unit, all-gathered and
    reduce-scattered as one; ``model`` itself then takes every parameter left. ``mesh`` defaults
    to the current mesh. Build the optimizer *after* this call: FSDP2 replaces the parameters.
    ``reshard_after_forward`` frees each unit's gathered parameters after its forward (gathering
    them again for backward); ``mp_policy`` is an FSDP2 ``MixedPrecisionPolicy``, ``offload_policy``
    its ``CPUOffloadPolicy`` (the dp shards of parameters, gradients and optimizer state kept in host
    memory, the optimizer stepping there: FSDP2's own ZeRO-Offload).

    Under FSDP2, :func:`tensorpar.full_state_dict`, :func:`tensorpar.full_grads` and
    :func:`tensorpar.clip_grad_norm_` are collectives over the whole mesh (every rank calls them);
    gradient accumulation skips the dp reduction with ``model.set_requires_gradient_sync(False)``.

    Example::

        mesh = tensorpar.init(tp=2, dp=2)
        model = GPT(config)
        tensorpar.fully_shard_dp(model, mesh, modules=model.transformer.h)
        optimizer = torch.optim.AdamW(model.parameters())   # its state is sharded over dp too
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
    dp_mesh = (mesh or current_mesh()).device_mesh["dp"]
    options: dict[str, Any] = dict(mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        if not isinstance(mp_policy, MixedPrecisionPolicy):
            raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
        options["mp_policy"] = mp_policy
    if offload_policy is not None:
        if not isinstance(offload_policy, OffloadPolicy):
            raise TypeError(f"offload_policy must be an FSDP2 OffloadPolicy, got {type(offload_policy).__name__}")
        options["offload_policy"] = offload_policy
    for unit in units:  # bottom-up: each unit keeps its own parameters, the root takes the rest
        fully_shard(unit, **options)
    fully_shard(model, **options)
    return model
