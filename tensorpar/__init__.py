"""tensorpar: Megatron-style tensor parallelism for PyTorch.

The runtime core: the (dp, tp) process mesh, autograd collectives, balanced
sharding, tp-invariant initialisation, per-rank random streams, vocab-parallel
cross-entropy, a local launcher, and whole-model helpers. The layers built on
it live in the ``layers`` package; ``tensorpar.testing`` holds the
multi-process test harness.
"""

from . import checkpoint, tiled_init
from .collectives import CollectiveError
from .comm import (
    all_gather,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter,
    scatter_to_tp,
)
from .counter import CollectiveCounter, CollectiveRecord, count_collectives
from .cross_entropy import vocab_parallel_cross_entropy
from .data import ByteData, default_corpus
from .functional import (
    column_parallel_linear,
    column_parallel_linears,
    row_parallel_linear,
)
from .launch import RankError, spawn
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
from .parallelize import parallelize
from .random import RNGStatesTracker
from .sharding import Shard, partition_offsets, partition_sizes, shard
from .state import full_grads, full_state_dict, load_full_state_dict, shard_geometry
from .training import clip_grad_norm_, cosine_lr, grad_norm

__all__ = [
    "ByteData",
    "CollectiveCounter",
    "CollectiveError",
    "CollectiveRecord",
    "Mesh",
    "RNGStatesTracker",
    "RankError",
    "Shard",
    "all_gather",
    "checkpoint",
    "clip_grad_norm_",
    "column_parallel_linear",
    "column_parallel_linears",
    "copy_to_tp",
    "cosine_lr",
    "count_collectives",
    "current_mesh",
    "default_corpus",
    "full_grads",
    "full_state_dict",
    "gather_from_tp",
    "grad_norm",
    "group_rank_size",
    "init",
    "load_full_state_dict",
    "manual_seed",
    "parallelize",
    "partition_offsets",
    "partition_sizes",
    "reduce_from_tp",
    "reduce_scatter",
    "row_parallel_linear",
    "scatter_to_tp",
    "shard",
    "shard_geometry",
    "shutdown",
    "spawn",
    "tiled_init",
    "tp_group",
    "use_mesh",
    "vocab_parallel_cross_entropy",
]
