"""Testing tensor-parallel code in real processes: a persistent worker pool, and
comparisons against unsharded twins. Hypothesis strategies are in
:mod:`tensorpar.testing.strategies` (the only part that needs ``hypothesis``).

Draw examples with hypothesis in the test process and send each example to
every rank of a :class:`World`; never run ``@given`` inside the ranks (their
draws would diverge and their collectives deadlock). A function sent to a
world must be importable (defined at module level).

Example (a pytest test)::

    from tensorpar.testing import Worlds, assert_sharded_equivalent
    from tensorpar.testing.strategies import tp_sizes

    WORLDS = Worlds()                            # one pool per world size, started on first use

    def check(n, seed):                          # runs on every rank, default mesh tp = world size
        torch.manual_seed(seed)
        dense = torch.nn.Linear(n, 3 * n)
        return assert_sharded_equivalent(ColumnParallelLinear.from_linear(dense), dense,
                                         torch.randn(4, n), output_shard=Shard(-1, 3 * n))

    @given(tp=tp_sizes(), n=st.integers(4, 64), seed=st.integers(0, 2**31))
    def test_column(tp, n, seed):
        WORLDS[tp].run(check, n, seed)
"""

from typing import TYPE_CHECKING, Any

from .compare import TOLERANCES, assert_all_close, assert_close, assert_sharded_equivalent, rel_error
from .debugger import find_divergence, group_of_one
from .findings import DivergenceReport, Finding
from .pool import World, Worlds, run_script

if TYPE_CHECKING:
    from .comm_counts import CollectiveLog, CollectiveRecord, count_collectives

#: loaded on first use: they need torch's CommDebugMode, which loads DTensor
_COMM_COUNTS = ("CollectiveLog", "CollectiveRecord", "count_collectives")


def __getattr__(name: str) -> Any:
    """:mod:`.comm_counts`'s names, imported when first asked for (PEP 562)."""
    if name in _COMM_COUNTS:
        from . import comm_counts
        return getattr(comm_counts, name)
    raise AttributeError(f"module 'tensorpar.testing' has no attribute {name!r}")


__all__ = ["TOLERANCES", "CollectiveLog", "CollectiveRecord", "DivergenceReport", "Finding", "World", "Worlds",
           "assert_all_close", "assert_close", "assert_sharded_equivalent", "count_collectives", "find_divergence",
           "group_of_one", "rel_error", "run_script"]
