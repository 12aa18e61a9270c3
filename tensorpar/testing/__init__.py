"""Testing tensor-parallel code in real processes: a persistent worker pool (:class:`Worlds`), comparisons
against unsharded twins, the equivalence debugger and collective counts; hypothesis strategies in
:mod:`.strategies`. Draw examples in the test process and send each to every rank of a world (``@given``
inside the ranks would draw differently per rank and deadlock their collectives); a function sent to a
world must be importable. Example: ``Worlds()[2].run(check, n, seed)`` with ``check`` at module level."""

from typing import TYPE_CHECKING, Any

from .compare import TOLERANCES, assert_all_close, assert_close, assert_sharded_equivalent, rel_error
from .debugger import find_divergence, group_of_one
from .findings import DivergenceReport, Finding
from .pool import World, Worlds, run_script

if TYPE_CHECKING:
    from .comm_counts import CollectiveLog, CollectiveRecord, count_collectives


def __getattr__(name: str) -> Any:
    """:mod:`.comm_counts`'s names, imported when first asked for (PEP 562): torch's CommDebugMode loads DTensor."""
    if name in ("CollectiveLog", "CollectiveRecord", "count_collectives"):
        from . import comm_counts
        return getattr(comm_counts, name)
    raise AttributeError(f"module 'tensorpar.testing' has no attribute {name!r}")


__all__ = ["TOLERANCES", "CollectiveLog", "CollectiveRecord", "DivergenceReport", "Finding", "World", "Worlds",
           "assert_all_close", "assert_close", "assert_sharded_equivalent", "count_collectives", "find_divergence",
           "group_of_one", "rel_error", "run_script"]
