"""The sum of per-leaf partial results along the fixed tree, the same bits on every rank and at every tp.

Each rank adds up the largest subtrees it holds whole (:attr:`~.segments.PlacedTree.sent`), the ranks
all-gather those partial sums (one collective; none when no rank holds anything of its own), and every
rank adds the rest in the tree's order. A node's value is its children's added left to right wherever
it is computed, so the result depends neither on who computed which subtree nor on the number of ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch.distributed import ProcessGroup

from ..comm.collectives import Pending, start_all_gather_along
from .segments import Node, PlacedTree


def _added(value: Callable[[Node], torch.Tensor], nodes: Sequence[Node]) -> torch.Tensor:
    """``value(node)`` of the ``nodes`` added left to right, each computed when it is added (out of place: a
    partial result may be a view of a live tensor; no generator: Dynamo 2.14 fails on recursive ones)."""
    total = value(nodes[0])
    for node in nodes[1:]:
        total = total + value(node)
    return total


class PendingTreeSum:
    """A tree sum whose exchange is in flight; ``wait()`` finishes it (the same bits on every rank)."""

    def __init__(self, placed: PlacedTree, local: Callable[[Node], torch.Tensor], mine: dict[Node, torch.Tensor],
                 exchange: Pending | None) -> None:
        self._placed, self._local, self._mine, self._exchange = placed, local, mine, exchange

    def wait(self) -> torch.Tensor:
        placed = self._placed
        received: dict[Node, torch.Tensor] = dict(self._mine)  # this rank's own subtrees, computed once
        if self._exchange is not None:
            everyone = self._exchange.wait().unbind(0)  # every rank's subtrees, in rank order
            at = 0
            for r, nodes in enumerate(placed.sent):
                for node in nodes:
                    if r != placed.rank:
                        received[node] = everyone[at]
                    at += 1
        return self._value(placed.tree.root, received, placed.held(placed.rank))

    def _value(self, node: Node, received: dict[Node, torch.Tensor], held: frozenset[int]) -> torch.Tensor:
        """A node's sum: received, added up here, or its children's added (a method, not a closure calling
        itself: that would be a reference cycle keeping every partial sum alive until the cyclic collector ran)."""
        if node in received:
            return received[node]
        if set(range(*node)) <= held:
            return self._local(node)
        return _added(lambda child: self._value(child, received, held), self._placed.tree.children(node))


def _local_sum(partial: Callable[[int], torch.Tensor], placed: PlacedTree, node: Node) -> torch.Tensor:
    """The sum of a node whose leaves this rank holds, added along the tree."""
    lo, hi = node
    if hi - lo == 1:
        return partial(lo)
    return _added(functools.partial(_local_sum, partial, placed), placed.tree.children(node))


def start_tree_sum(partial: Callable[[int], torch.Tensor], placed: PlacedTree, group: ProcessGroup | None,
                   shape: Sequence[int], like: torch.Tensor) -> PendingTreeSum:
    """Start the tree sum of every leaf's partial result; ``wait()`` gives it, the same on every rank of
    ``group`` (what this rank computes meanwhile overlaps the exchange).

    ``partial(leaf)`` computes the partial result of a leaf this rank holds (see
    :class:`~.segments.SegmentTree`), when the tree needs it (so that no more are alive at once than the
    tree's depth); each has ``shape`` and ``like``'s dtype and device. A collective over ``group`` when
    ranks hold leaves of their own.
    """
    local = functools.partial(_local_sum, partial, placed)
    mine: dict[Node, torch.Tensor] = {}
    exchange = None
    counts = [len(nodes) for nodes in placed.sent]
    if placed.tp > 1 and any(counts):  # every rank joins when any rank has something for the others
        if group is None:
            raise ValueError("tree_sum: other ranks hold leaves of their own, and no group reaches them")
        mine = {node: local(node) for node in placed.sent[placed.rank]}
        stacked = torch.stack(list(mine.values())) if mine else like.new_empty((0, *shape))
        exchange = start_all_gather_along(stacked, 0, counts, group)
    return PendingTreeSum(placed, local, mine, exchange)


def tree_sum(partial: Callable[[int], torch.Tensor], placed: PlacedTree, group: ProcessGroup | None,
             shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """The tree sum of every leaf's partial result, the same on every rank of ``group``
    (:func:`start_tree_sum`, waited for)."""
    return start_tree_sum(partial, placed, group, shape, like).wait()
