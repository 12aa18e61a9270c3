"""tensorpar: Megatron-style tensor parallelism for PyTorch.

The core: the (pp, dp, tp) mesh, Megatron's ``f`` and ``g`` and the other autograd collectives
(:mod:`tensorpar.comm`), balanced sharding and full views of sharded models, tp-invariant
initialisation, per-rank random streams, vocab-parallel cross-entropy and gradient clipping.
``import tensorpar`` loads those; the checkpoint store, the launcher (:func:`spawn`), FSDP2,
pipelines and the test kit load on first use, and so do torch's DCP and DTensor, which only they need.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

from . import comm, tiled_init
from . import random as random  # tensorpar.random.tracker(mesh): a mesh's tp stream
from .bitwise.settings import current_bitwise
from .clipping import clip_grad_norm_, grad_norm
from .comm import *  # noqa: F403  (the collectives and fused linear maps: comm.__all__)
from .cross_entropy import vocab_parallel_cross_entropy
from .full import full_grads, full_state_dict, load_full_state_dict, shard_geometry, unshard
from .mesh import Mesh, current_mesh, group_rank_size, init, tp_group, use_mesh
from .random import RNGStatesTracker, manual_seed
from .sharding import Shard, partition_bounds, partition_offsets, partition_sizes, shard
from .world import shutdown


def _installed_version() -> str:
    """This distribution's version as installed; ``0+unknown`` in a source tree never installed."""
    try:
        return importlib.metadata.version("tensorpar")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _installed_version()

#: what loads on first use: attribute -> (module, name in it; None for the module itself)
_ON_FIRST_USE = (("checkpoint", "tensorpar.checkpoint", None), ("pipeline", "tensorpar.pipeline", None),
                 ("testing", "tensorpar.testing", None), ("spawn", "tensorpar.launch", "spawn"),
                 ("RankError", "tensorpar.launch", "RankError"), ("fully_shard_dp", "tensorpar.fsdp", "fully_shard_dp"))

if TYPE_CHECKING:  # what type checkers and editors see; at run time, __getattr__ below
    from . import checkpoint
    from . import pipeline as pipeline
    from . import testing as testing
    from .fsdp import fully_shard_dp
    from .launch import RankError, spawn


def __getattr__(name: str) -> Any:
    """Load an attribute of :data:`_ON_FIRST_USE` when it is first asked for (PEP 562)."""
    for attribute, module, inside in _ON_FIRST_USE:
        if attribute == name:
            value = importlib.import_module(module)
            return value if inside is None else getattr(value, inside)
    raise AttributeError(f"module 'tensorpar' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *(attribute for attribute, _, _ in _ON_FIRST_USE)})


__all__ = [  # the core's own names, then comm's
    "Mesh", "RNGStatesTracker", "RankError", "Shard", "checkpoint", "clip_grad_norm_", "current_bitwise",
    "current_mesh", "full_grads", "full_state_dict", "fully_shard_dp", "grad_norm", "group_rank_size", "init",
    "load_full_state_dict", "manual_seed", "partition_bounds", "partition_offsets", "partition_sizes", "shard",
    "shard_geometry", "shutdown", "spawn", "tiled_init", "tp_group", "unshard", "use_mesh",
    "vocab_parallel_cross_entropy", *comm.__all__,
]
