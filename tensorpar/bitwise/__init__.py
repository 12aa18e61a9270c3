"""Bitwise mode: a model sharded over tp ranks computes exactly the bits of the same model at tp = 1.

:func:`enable` (or :func:`use_bitwise` for a block) sets the mode for the modules built afterwards; each
layer chooses its numerics once, when built (:func:`current_bitwise`). The mode removes the three ways
tp changes the bits (README, "Bitwise"): split reductions become sums of one partial result per
canonical segment along one fixed tree (:mod:`.segments`, :mod:`.tree_sum`); every product, activation
and reduction runs one segment at a time, the same shape and alignment at every tp; sums over tokens
(LayerNorm and row-bias gradients) add canonical segments of the sequence, with or without sequence
parallelism. What is computed per row, head or element is the same whatever a rank holds.
"""

from __future__ import annotations

# The sums (tree_sum, linear, ...) use the collectives: they are imported from their modules, not from here.
from .segments import PlacedTree, SegmentTree, layouts
from .settings import DEFAULT_TP_SIZES, Bitwise, current_bitwise, enable, use_bitwise

__all__ = ["DEFAULT_TP_SIZES", "Bitwise", "PlacedTree", "SegmentTree", "current_bitwise", "enable", "layouts",
           "use_bitwise"]
