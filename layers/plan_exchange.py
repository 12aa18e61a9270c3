"""A bitwise tree sum's exchange of partial sums (:mod:`tensorpar.bitwise.tree_sum`) as one rank holds it, for
the bitwise planner (:mod:`layers.plan_bitwise`): what it sends, receives and joins, and the additions after,
followed on the tree in the order the ranks add it up."""

from __future__ import annotations

import functools
from collections.abc import Callable

from tensorpar.bitwise.segments import Node, Piece, PlacedTree, placed_split
from tensorpar.sharding import partition_bounds

from .config import GPTConfig
from .heads import head_layout
from .plan_saved import Shapes


def qkv_pieces(n_head: int, n_kv: int, d: int, queries_only: bool) -> Callable[[int, int], list[Piece]]:
    """A rank's pieces of the fused ``[Q|K|V]`` rows at a tp (:func:`layers.numerics.attention`'s cuts), or of
    its query features alone (the output projection's input)."""
    def pieces(tp: int, rank: int) -> list[Piece]:
        at = head_layout(n_head, n_kv, tp, rank)
        kv = (at.kv_held.start * d, len(at.kv_held) * d)
        q = (at.query.start * d, len(at.query) * d)
        return [q] if queries_only else [q, (n_head * d + kv[0], kv[1]), ((n_head + n_kv) * d + kv[0], kv[1])]
    return pieces


@functools.lru_cache(maxsize=1024)
def _exchange_units(what: str, n_head: int, n_kv: int, d: int, size: int, tp: int, rank: int,
                    tp_sizes: tuple[int, ...]) -> int:
    """The most ``(N, C)`` partial sums a tree sum over the leaves of ``what`` (``"qkv"``: the fused rows,
    ``"query"``: the output projection's input, else balanced rows of ``size``: the MLP's, the vocabulary) holds on
    this rank from its exchange to its result (:func:`exchange`); 0 where nothing is exchanged."""
    if what in ("qkv", "query"):
        size = (n_head + (2 * n_kv if what == "qkv" else 0)) * d
        pieces = qkv_pieces(n_head, n_kv, d, what == "query")
    else:
        pieces = functools.partial(lambda n, t, r: [partition_bounds(n, t, r)], size)
    placed = placed_split(pieces, size, tp, rank, tp_sizes)
    counts = [len(nodes) for nodes in placed.sent]
    if tp == 1 or not any(counts):
        return 0
    own, most, total = counts[rank], max(counts), sum(counts)
    held = own + (own if own < most else 0)  # this rank's sums; its stack, where a padded copy is what is sent
    additions = _additions(placed)  # (sums alive, whether the received ones are read then or later) by moment
    if len(set(counts)) > 1:  # joined first (the received buffer gone), the additions reading the join
        return held + max(tp * most + total, total + max((n for n, _ in additions), default=0))
    # the received buffer is the join, held until the last addition that reads it
    return held + max([tp * most] + [n + (tp * most if reads else 0) for n, reads in additions])


def _additions(placed: PlacedTree) -> list[tuple[int, bool]]:
    """As each new sum is made while a rank adds up the tree after the exchange
    (:meth:`~tensorpar.bitwise.tree_sum.PendingTreeSum.wait`; each node's children added left to right, out of
    place): how many new sums are alive, and whether a received sum is read then or later. A received sum is
    a view of the exchange (this rank's own: counted apart); a leaf every rank holds is computed here."""
    received = {node for r, nodes in enumerate(placed.sent) if r != placed.rank for node in nodes}
    own = set(placed.sent[placed.rank])
    held = placed.held(placed.rank)
    moments: list[tuple[int, bool]] = []
    alive = 0

    def value(node: Node, local: bool) -> str:  # "received", "own" or "new"
        nonlocal alive
        lo, hi = node
        if not local and (node in received or node in own):
            return "received" if node in received else "own"
        local = local or set(range(lo, hi)) <= held
        if local and hi - lo == 1:
            alive += 1
            moments.append((alive, False))
            return "new"
        children = placed.tree.children(node)
        total = value(children[0], local)
        for child in children[1:]:
            v = value(child, local)
            alive += 1
            moments.append((alive, "received" in (total, v)))
            alive -= (total == "new") + (v == "new")
            total = "new"
        return total

    value(placed.tree.root, False)
    reads_after = False
    for i in reversed(range(len(moments))):  # whether a received sum is read at or after each moment
        reads_after = reads_after or moments[i][1]
        moments[i] = (moments[i][0], reads_after)
    return moments


def exchange(config: GPTConfig, s: Shapes, what: str) -> int:
    """The most a tree sum of ``(N, C)`` partial results over the leaves of ``what`` holds from its exchange of
    partial sums to its result: this rank's own sums, every rank's (padded to the most a rank sends), their
    join where ranks send unequal counts (else the received buffer is the join, read by the additions), and
    the additions after. The buffer it sends counts as gone once sent (:class:`~layers.plan_measure.LiveBytes`):
    its stack of partial sums, or where it sends fewer than the most, the padded copy (the stack stays, held
    by the exchange); the received buffer once joined, or once the last addition reading it is made."""
    assert s.mode is not None
    size = config.vocab_size if what == "vocab" else config.mlp_hidden
    units = _exchange_units(what, config.n_head, config.kv_heads, s.d, size, s.tp, s.rank, s.mode.tp_sizes)
    return units * s.b * s.t * s.c * s.a
