"""Canonical segments of a split dimension, and the fixed tree that adds their partial results.

A dimension split over tp ranks is cut, once and for all, at every boundary
that any rank's shard has at any tp of the mode (:class:`~tensorpar.bitwise.Bitwise`):
the *segments* are the pieces between consecutive cuts. Every rank's shard, at
every such tp, is then a run of whole segments. 12 features at tp 1-4 (shards
``[12]``, ``[6, 6]``, ``[4, 4, 4]``, ``[3, 3, 3, 3]``) give the cuts 3, 4, 6,
8, 9 and the segments ``[0, 3) [3, 4) [4, 6) [6, 8) [8, 9) [9, 12)``; 10
features (``[5, 5]``, ``[4, 3, 3]``, ``[3, 3, 2, 2]``) give seven.

A sum over the dimension is computed as one partial result per *leaf* (the
segments one rank holds together at every tp: a plain split's segments one by
one, a fused ``[Q | K | V]``'s Q, K and V rows of one group of heads together),
each of the same shape and from the same elements at every tp, added along a
fixed tree over the leaves. The tree is built from the shards themselves: its
nodes are the runs of leaves that one rank holds at a power of two of the mode
(2, then 4, ...), then at the other sizes, each kept when it nests with those
already chosen. With 12 features: the halves ``[0, 6) [6, 12)`` and the
quarters in them; tp 3's thirds cross the halves and are left out. A rank then
adds the subtrees it holds whole by itself (one each at tp 2 and 4 here, two
at tp 3), and the ranks exchange only those partial sums
(:mod:`tensorpar.bitwise.tree_sum`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from ..sharding import partition_bounds, partition_sizes

#: ``(offset, length)`` of a run of a full dimension
Piece = tuple[int, int]
#: a run of leaves ``[lo, hi)`` by index: a node of the tree (a leaf when ``hi == lo + 1``)
Node = tuple[int, int]


def layouts(pieces_at: Callable[[int, int], Sequence[Piece]], tp_sizes: Iterable[int]) -> dict[int, list[list[Piece]]]:
    """Every rank's pieces at every tp in ``tp_sizes`` that the split allows: ``pieces_at(tp, rank)``,
    a tp for which it raises ``ValueError`` (fewer units than ranks) being left out."""
    found = {}
    for tp in tp_sizes:
        try:
            found[tp] = [list(pieces_at(tp, rank)) for rank in range(tp)]
        except ValueError:
            continue
    return found


def _priority(tp: int) -> tuple[bool, int]:
    return tp & (tp - 1) != 0, tp  # powers of two first (they nest), then the others


@dataclass(frozen=True)
class SegmentTree:
    """The canonical segments of a dimension of ``size`` and the tree that adds their partial results.

    ``segments``: ``(offset, length)`` runs in order. ``leaves``: each leaf's segments (held together by
    one rank at every tp), ordered by which rank holds them at each tp, smallest tp first. ``nodes``: the
    runs ``[lo, hi)`` of two or more leaves that are nodes (the root included), pairwise nested or
    disjoint; a node's children are the largest nodes inside it and the single leaves between them.
    """

    size: int
    segments: tuple[Piece, ...]
    leaves: tuple[tuple[int, ...], ...]
    nodes: frozenset[Node]
    inner: Mapping[Node, tuple[Node, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        inner: dict[Node, tuple[Node, ...]] = {}
        for node in self.nodes:
            lo, hi = node
            inside = sorted(n for n in self.nodes if n != node and lo <= n[0] and n[1] <= hi)
            largest = [n for n in inside if not any(o != n and o[0] <= n[0] and n[1] <= o[1] for o in inside)]
            children, at = [], lo
            for a, b in largest:
                children += [(i, i + 1) for i in range(at, a)] + [(a, b)]
                at = b
            inner[node] = tuple(children + [(i, i + 1) for i in range(at, hi)])
        object.__setattr__(self, "inner", MappingProxyType(inner))

    @classmethod
    def build(cls, size: int, layout: Mapping[int, Sequence[Sequence[Piece]]]) -> SegmentTree:
        """The segments and tree of a dimension of ``size`` split as ``layout`` says at each tp."""
        cuts = {0, size}
        for ranks in layout.values():
            for pieces in ranks:
                for offset, length in pieces:
                    if length:
                        cuts |= {offset, offset + length}
        cuts_sorted = sorted(cuts)
        segments = tuple((a, b - a) for a, b in itertools.pairwise(cuts_sorted))
        starts = {offset: i for i, offset in enumerate(cuts_sorted)}
        holders = {tp: _holders(segments, starts, ranks) for tp, ranks in layout.items()}
        signature = {s: tuple(holders[tp][s] for tp in sorted(layout)) for s in range(len(segments))}
        groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for s in range(len(segments)):
            groups.setdefault(signature[s], []).append(s)
        leaves = tuple(tuple(groups[key]) for key in sorted(groups))
        leaf_of = {s: i for i, leaf in enumerate(leaves) for s in leaf}
        nodes: set[Node] = {(0, len(leaves))} if len(leaves) > 1 else set()  # a single leaf: no inner node
        for tp in sorted(layout, key=_priority):
            for rank in range(len(layout[tp])):
                own = sorted({leaf_of[s] for s in range(len(segments)) if holders[tp][s] == (0, rank)})
                node = (own[0], own[-1] + 1) if own else (0, 0)
                contiguous = len(own) == node[1] - node[0]
                if contiguous and len(own) >= 2 and all(_nested_or_apart(node, other) for other in nodes):
                    nodes.add(node)
        return cls(size, segments, leaves, frozenset(nodes))

    @property
    def root(self) -> Node:
        return (0, len(self.leaves))

    def children(self, node: Node) -> tuple[Node, ...]:
        """The children of a node, left to right (none for a single leaf)."""
        return self.inner.get(node, ())

    def segments_of(self, pieces: Sequence[Piece]) -> list[int]:
        """The indices of the segments that make up ``pieces``, in the pieces' order."""
        starts = {offset: i for i, (offset, _) in enumerate(self.segments)} | {self.size: len(self.segments)}
        found: list[int] = []
        for offset, length in pieces:
            if not length:
                continue
            if offset not in starts or offset + length not in starts:
                raise ValueError(f"the piece {(offset, length)} does not start and end on a segment cut")
            found += range(starts[offset], starts[offset + length])
        return found


def _holders(segments: Sequence[Piece], starts: Mapping[int, int],
             ranks: Sequence[Sequence[Piece]]) -> dict[int, tuple[int, int]]:
    """Who holds each segment at one tp: ``(0, rank)`` for one rank, ``(1, 0)`` for every rank."""
    held: dict[int, set[int]] = {s: set() for s in range(len(segments))}
    for rank, pieces in enumerate(ranks):
        for offset, length in pieces:
            if length:
                for s in range(starts[offset], starts[offset + length]):
                    held[s].add(rank)
    return {s: (0, min(h)) if len(h) == 1 else (1, 0) for s, h in held.items()}


def _nested_or_apart(a: Node, b: Node) -> bool:
    return a[1] <= b[0] or b[1] <= a[0] or (b[0] <= a[0] and a[1] <= b[1]) or (a[0] <= b[0] and b[1] <= a[1])


@dataclass(frozen=True)
class PlacedTree:
    """A :class:`SegmentTree` over the ranks of one tp group: which ranks hold which segments (``holders``)
    and leaves (``leaf_holders``), and this rank's segments in its local order (``local``: ``(segment,
    local offset, length)``). A segment every rank holds (a replicated part) is computed by each, alike."""

    tree: SegmentTree
    tp: int
    rank: int
    holders: tuple[frozenset[int], ...]
    local: tuple[tuple[int, int, int], ...]
    leaf_holders: tuple[frozenset[int], ...] = field(init=False)
    sent: tuple[tuple[Node, ...], ...] = field(init=False)
    #: this rank's leaves, in order
    mine: tuple[int, ...] = field(init=False, repr=False, compare=False)
    #: whether each of this rank's leaves is one segment, in the local order: its leaves' blocks side by side
    #: are then its local tensor
    in_order: bool = field(init=False, repr=False, compare=False)
    _held: tuple[frozenset[int], ...] = field(init=False, repr=False, compare=False)  # each rank's leaves
    _pieces: Mapping[int, tuple[Piece, ...]] = field(init=False, repr=False, compare=False)  # of this rank's leaves

    def __post_init__(self) -> None:
        leaf_holders = tuple(self.holders[leaf[0]] for leaf in self.tree.leaves)
        object.__setattr__(self, "leaf_holders", leaf_holders)
        held = tuple(frozenset(i for i, h in enumerate(leaf_holders) if r in h) for r in range(self.tp))
        object.__setattr__(self, "_held", held)
        object.__setattr__(self, "mine", tuple(sorted(held[self.rank])))
        object.__setattr__(self, "in_order", [self.tree.leaves[leaf] for leaf in self.mine]
                           == [(segment,) for segment, _, _ in self.local])
        where = {s: (lo, n) for s, lo, n in self.local}
        object.__setattr__(self, "_pieces", MappingProxyType(
            {leaf: tuple(where[s] for s in self.tree.leaves[leaf]) for leaf in self.mine}))
        common = self.common()
        object.__setattr__(self, "sent", tuple(self._maximal(held[r], common, self.tree.root) for r in range(self.tp)))

    @classmethod
    def place(cls, tree: SegmentTree, pieces_by_rank: Sequence[Sequence[Piece]], rank: int) -> PlacedTree:
        """``tree`` over ranks holding ``pieces_by_rank`` (each rank's pieces in its local order)."""
        holders: list[set[int]] = [set() for _ in tree.segments]
        for r, pieces in enumerate(pieces_by_rank):
            for s in tree.segments_of(pieces):
                holders[s].add(r)
        unheld = [tree.segments[s] for s, h in enumerate(holders) if not h]
        if unheld:
            raise ValueError(f"no rank holds the segments {unheld} of a dimension of {tree.size}")
        if any(len({frozenset(holders[s]) for s in leaf}) > 1 for leaf in tree.leaves):
            raise ValueError("a leaf's segments are held by different ranks: the tree was built for other layouts")
        local, at = [], 0
        for s in tree.segments_of(pieces_by_rank[rank]):
            local.append((s, at, tree.segments[s][1]))
            at += tree.segments[s][1]
        return cls(tree, len(pieces_by_rank), rank, tuple(frozenset(h) for h in holders), tuple(local))

    def held(self, rank: int) -> frozenset[int]:
        """The leaves ``rank`` holds."""
        return self._held[rank]

    def common(self) -> frozenset[int]:
        """The leaves every rank holds."""
        return frozenset(i for i, h in enumerate(self.leaf_holders) if len(h) == self.tp)

    def lengths(self) -> list[int]:
        """This rank's segment lengths, in its local order (to split its local tensor by)."""
        return [n for _, _, n in self.local]

    def pieces(self, leaf: int) -> tuple[Piece, ...]:
        """``(local offset, length)`` of each segment of ``leaf`` (one this rank holds), in the leaf's order."""
        return self._pieces[leaf]

    def _maximal(self, held: frozenset[int], common: frozenset[int], node: Node) -> tuple[Node, ...]:
        """The largest nodes under ``node`` whose leaves are all ``held``, leaving out those every rank
        holds: what a rank holding ``held`` adds up itself and sends to the others."""
        leaves = set(range(*node))
        if leaves <= held:
            return () if leaves <= common else (node,)
        return tuple(n for child in self.tree.children(node) for n in self._maximal(held, common, child))


def placed_split(pieces_at: Callable[[int, int], Sequence[Piece]], size: int, tp: int, rank: int,
                 tp_sizes: Iterable[int]) -> PlacedTree:
    """The segments of a dimension of ``size`` split as ``pieces_at(tp, rank)`` says (each rank's
    pieces in its local order), cut for every size in ``tp_sizes`` and ``tp``, placed over the ranks
    of ``tp``: this is ``rank``'s view."""
    layout = layouts(pieces_at, {*tp_sizes, tp})
    if tp not in layout:
        pieces_at(tp, rank)  # raises what the split says about this tp
    if torch.compiler.is_compiling():
        return PlacedTree.place(SegmentTree.build(size, layout), layout[tp], rank)
    return _cached_placed(size, _key(layout), tp, rank)


def placed_tokens(seq_len: int, tp: int, rank: int, tp_sizes: Iterable[int], *, split: bool) -> PlacedTree:
    """The canonical segments of ``seq_len`` tokens (the cuts of sequence parallelism's balanced
    split at every size in ``tp_sizes``), placed over the ranks of ``tp`` when the tokens are
    ``split`` among them, else all held by this rank (every rank holding every token)."""
    sizes = tuple(sorted({*tp_sizes, tp}))
    # eagerly from a cache; while torch.compile traces, built afresh (Dynamo would trace past the cache)
    if torch.compiler.is_compiling():
        return _place_tokens(_build_sequence_tree(seq_len, sizes), seq_len, tp, rank, split)
    return _cached_tokens(seq_len, tp, rank, sizes, split)


def _place_tokens(tree: SegmentTree, seq_len: int, tp: int, rank: int, split: bool) -> PlacedTree:
    if not split:
        return PlacedTree.place(tree, [[(0, seq_len)]], 0)
    return PlacedTree.place(tree, _sequence_pieces(seq_len, tp), rank)


@functools.lru_cache(maxsize=256)
def _cached_tokens(seq_len: int, tp: int, rank: int, tp_sizes: tuple[int, ...], split: bool) -> PlacedTree:
    return _place_tokens(_sequence_tree(seq_len, tp_sizes), seq_len, tp, rank, split)


def placed_vocabulary(vocab_size: int, tp: int, rank: int, tp_sizes: Iterable[int]) -> PlacedTree:
    """The canonical segments of a vocabulary of ``vocab_size`` split in balanced rows, placed over ``tp``."""
    sizes = tuple(sorted({*tp_sizes, tp}))
    layout = {t: [[partition_bounds(vocab_size, t, r, name="vocab_size")] for r in range(t)]
              for t in sizes if t <= vocab_size}
    if torch.compiler.is_compiling():
        return PlacedTree.place(SegmentTree.build(vocab_size, layout), layout[tp], rank)
    return _cached_placed(vocab_size, _key(layout), tp, rank)


def _sequence_pieces(seq_len: int, tp: int) -> list[list[Piece]]:
    sizes = partition_sizes(seq_len, tp, name="sequence length", allow_empty=True)
    return [[(sum(sizes[:r]), sizes[r])] for r in range(tp)]


def _build_sequence_tree(seq_len: int, tp_sizes: tuple[int, ...]) -> SegmentTree:
    return SegmentTree.build(seq_len, {tp: _sequence_pieces(seq_len, tp) for tp in tp_sizes})


_sequence_tree = functools.lru_cache(maxsize=64)(_build_sequence_tree)


#: a layout as a cache key: ``((tp, ((rank 0's pieces), ...)), ...)``
LayoutKey = tuple[tuple[int, tuple[tuple[Piece, ...], ...]], ...]


def _key(layout: Mapping[int, Sequence[Sequence[Piece]]]) -> LayoutKey:
    return tuple(sorted((tp, tuple(tuple(p) for p in ranks)) for tp, ranks in layout.items()))


@functools.lru_cache(maxsize=256)
def _cached_tree(size: int, key: LayoutKey) -> SegmentTree:
    return SegmentTree.build(size, dict(key))


@functools.lru_cache(maxsize=1024)
def _cached_placed(size: int, key: LayoutKey, tp: int, rank: int) -> PlacedTree:
    return PlacedTree.place(_cached_tree(size, key), dict(key)[tp], rank)
