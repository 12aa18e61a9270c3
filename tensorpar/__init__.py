"""tensorpar: Megatron-style tensor parallelism for PyTorch.

The runtime core: the (pp, dp, tp) process mesh, Megatron's ``f`` and ``g`` and
the other autograd collectives (:mod:`tensorpar.comm`), balanced sharding and
full views of sharded models, tp-invariant initialisation, per-rank random
streams, vocab-parallel cross-entropy, gradient clipping, pipeline stages and
schedules (:mod:`tensorpar.pipeline`), checkpoints and a local launcher.
``tensorpar.testing`` is the multi-process test kit. The ``nn.Module``\\ s
built on this core live in a package of their own; the training app (data,
command line, run directory, loggers) lives beside ``examples/train_gpt.py``.

``import tensorpar`` loads the mesh, sharding, the collectives and what a
model's forward and backward use. The checkpoint store, the launcher
(:func:`spawn`), FSDP2, pipelines and the test kit
load on first use (``tensorpar.checkpoint``,
``tensorpar.spawn``, ...), and so do ``torch.distributed.checkpoint`` and
DTensor, which only they need.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

from . import tiled_init
from .bitwise.settings import current_bitwise
from .clipping import clip_grad_norm_, grad_norm
from .comm import (
    CollectiveCounter,
    CollectiveError,
    CollectiveRecord,
    all_gather,
    all_gather_sequence,
    column_parallel_linear,
    copy_to_tp,
    count_collectives,
    gather_from_tp,
    gather_sequence,
    reduce_from_tp,
    reduce_scatter,
    reduce_scatter_sequence,
    row_parallel_linear,
    save_sequence_shard,
    scatter_sequence,
    scatter_to_tp,
    sequence_length,
    sequence_parallel_column_linear,
    sequence_parallel_row_linear,
    sequence_sizes,
)
from .cross_entropy import vocab_parallel_cross_entropy
from .full import full_grads, full_state_dict, load_full_state_dict, shard_geometry, unshard
from .mesh import (
    Mesh,
    current_mesh,
    group_rank_size,
    init,
    manual_seed,
    shutdown,
    tp_group,
    use_mesh,
)
from .random import RNGStatesTracker
from .sharding import Shard, partition_bounds, partition_offsets, partition_sizes, shard


def _installed_version() -> str:
    """This distribution's version, as installed (``pip install``); ``0+unknown`` in a source tree
    that was never installed."""
    try:
        return importlib.metadata.version("tensorpar")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _installed_version()

#: what loads on first use: attribute -> (module, name in it; None for the module itself)
_ON_FIRST_USE = (
    ("checkpoint", "tensorpar.checkpoint", None),
    ("pipeline", "tensorpar.pipeline", None),
    ("testing", "tensorpar.testing", None),
    ("spawn", "tensorpar.launch", "spawn"),
    ("RankError", "tensorpar.launch", "RankError"),
    ("fully_shard_dp", "tensorpar.fsdp", "fully_shard_dp"),
)

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


__all__ = [
    "CollectiveCounter",
    "CollectiveError",
    "CollectiveRecord",
    "Mesh",
    "RNGStatesTracker",
    "RankError",
    "Shard",
    "all_gather",
    "all_gather_sequence",
    "checkpoint",
    "clip_grad_norm_",
    "column_parallel_linear",
    "copy_to_tp",
    "count_collectives",
    "current_bitwise",
    "current_mesh",
    "full_grads",
    "full_state_dict",
    "fully_shard_dp",
    "gather_from_tp",
    "gather_sequence",
    "grad_norm",
    "group_rank_size",
    "init",
    "load_full_state_dict",
    "manual_seed",
    "partition_bounds",
    "partition_offsets",
    "partition_sizes",
    "reduce_from_tp",
    "reduce_scatter",
    "reduce_scatter_sequence",
    "row_parallel_linear",
    "save_sequence_shard",
    "scatter_sequence",
    "scatter_to_tp",
    "sequence_length",
    "sequence_parallel_column_linear",
    "sequence_parallel_row_linear",
    "sequence_sizes",
    "shard",
    "shard_geometry",
    "shutdown",
    "spawn",
    "tiled_init",
    "tp_group",
    "unshard",
    "use_mesh",
    "vocab_parallel_cross_entropy",
]
