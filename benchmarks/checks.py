"""The per-example check that benchmarks/harness.py sends through a pool (importable by the pool's ranks)."""

import torch

from layers import ColumnParallelLinear
from tensorpar import Shard
from tensorpar.testing import assert_sharded_equivalent


def check_column(in_f: int, out_f: int, seed: int) -> dict[str, float]:
    """A small column-parallel linear against its nn.Linear twin, as a property test's example."""
    torch.manual_seed(seed)
    dense = torch.nn.Linear(in_f, out_f)
    return assert_sharded_equivalent(ColumnParallelLinear.from_linear(dense), dense, torch.randn(4, in_f),
                                     output_shard=Shard(-1, out_f), seed=seed)
