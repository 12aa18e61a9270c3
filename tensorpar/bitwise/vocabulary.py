"""The cross-entropy's sum of exponentials over a split vocabulary, by canonical segments (the bitwise mode).

The vocabulary rows are split plainly, so each segment of them is a leaf: one exponential and one sum
per segment, added by the segments' tree (:func:`~.tree_sum.tree_sum`), the same bits at every tp of
the mode, 1 included.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed import ProcessGroup

from .linear import lanewise
from .segments import PlacedTree, placed_vocabulary
from .tree_sum import tree_sum


class SegmentedExpSum:
    """``Σ_v exp(z_v)`` over the whole vocabulary ``(*)`` of this rank's rows ``z`` ``(*, V / tp)``,
    writing ``exp(z)`` into ``z``: a callable ``(z, group)``, like the default's all-reduce."""

    def __init__(self, vocab_size: int, tp: int, rank: int, tp_sizes: Iterable[int]) -> None:
        self.placed: PlacedTree = placed_vocabulary(vocab_size, tp, rank, tp_sizes)

    def __call__(self, z: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        placed = self.placed
        exps = {s: lanewise(torch.exp, z.narrow(-1, lo, n)) for s, lo, n in placed.local}  # (*, n) each

        def partial(leaf: int) -> torch.Tensor:
            (s,) = placed.tree.leaves[leaf]  # the vocabulary is split plainly: a leaf is one segment
            return exps[s].sum(-1)

        total = tree_sum(partial, placed, group, z.shape[:-1], z)
        for s, lo, n in placed.local:
            z.narrow(-1, lo, n).copy_(exps[s])
        return total

    @staticmethod
    def log(t: torch.Tensor) -> torch.Tensor:
        """``log(t)`` of every element alike, whatever ``t``'s shape (:func:`~.linear.lanewise`)."""
        return lanewise(torch.log, t)
