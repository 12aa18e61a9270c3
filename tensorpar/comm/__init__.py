"""Everything Megatron's ``f`` and ``g`` are made of, one job per module.

* :mod:`~tensorpar.comm.regions`: the paper's operators as autograd functions:
  ``f`` (:func:`copy_to_tp`), ``g`` (:func:`reduce_from_tp`), scatter/gather and
  reduce-scatter/all-gather along any dim, each gather named by what its backward does;
* :mod:`~tensorpar.comm.linear`: the column- and row-parallel linear maps fused
  with their ``f`` and ``g``;
* :mod:`~tensorpar.comm.sequence`: sequence parallelism, the same maps with the
  tokens split outside them (all-gather in, reduce-scatter out), overlapped;
* :mod:`~tensorpar.comm.saved_tensor_hooks`: autograd's saved-tensor hooks that keep a gathered activation for
  backward as this rank's tokens;
* :mod:`~tensorpar.comm.collectives`: the plain out-of-place collectives over uneven shards, one route each,
  on torch's functional collectives.

Count collectives with torch's ``CommDebugMode`` (:func:`tensorpar.testing.count_collectives` keeps each one's
payload and phase); compare them across ranks with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``.
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
