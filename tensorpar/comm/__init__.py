"""Megatron's ``f`` and ``g`` and what they are made of: :mod:`~tensorpar.comm.regions` (the autograd
collectives), :mod:`~tensorpar.comm.linear` (the linear maps fused with them), :mod:`~tensorpar.comm.sequence`
and :mod:`~tensorpar.comm.saved_tensor_hooks` (sequence parallelism), :mod:`~tensorpar.comm.collectives`
(the plain collectives over uneven shards, on torch's). Count collectives with torch's ``CommDebugMode``
(:func:`tensorpar.testing.count_collectives`); compare them across ranks with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``.
"""

from .linear import column_parallel_linear, row_parallel_linear
from .regions import all_gather, copy_to_tp, gather_from_tp, reduce_from_tp, reduce_scatter, scatter_to_tp
from .saved_tensor_hooks import save_sequence_shard
from .sequence import (
    all_gather_sequence,
    gather_sequence,
    reduce_scatter_sequence,
    scatter_sequence,
    sequence_length,
    sequence_parallel_column_linear,
    sequence_parallel_row_linear,
    sequence_sizes,
)

__all__ = [
    "all_gather", "all_gather_sequence", "column_parallel_linear", "copy_to_tp", "gather_from_tp", "gather_sequence",
    "reduce_from_tp", "reduce_scatter", "reduce_scatter_sequence", "row_parallel_linear", "save_sequence_shard",
    "scatter_sequence", "scatter_to_tp", "sequence_length", "sequence_parallel_column_linear",
    "sequence_parallel_row_linear", "sequence_sizes",
]
