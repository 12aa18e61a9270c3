"""Bitwise mode: a model sharded over tp ranks computes exactly the bits of the same model at tp = 1.

Turned on by :func:`enable` (``tensorpar.bitwise.enable()`` after ``tensorpar.init``), or by
:func:`use_bitwise` for a block, for every layer built afterwards: a layer chooses its numerics once,
when it is built (:func:`current_bitwise`), and keeps them. Three things make a sharded model's numbers
depend on tp, and the mode removes each:

1. **Split reductions.** A row-parallel product adds partial sums over each rank's slice of the
   reduced dimension, and the all-reduce adds those; the unsharded product adds in its own order.
   Floating-point addition is not associative, so the last bits differ. The mode cuts every split
   dimension into canonical *segments* (:mod:`.segments`): every rank's shard, at every tp of the
   mode, is a run of whole segments. A sum over the dimension is one partial result per segment,
   added along one fixed tree (:func:`.tree_sum.tree_sum`), whoever holds which segment. This replaces ``g``
   (row-parallel outputs), ``f`` (column-parallel input gradients), the vocabulary sums of the
   cross-entropy and the gradient norm's sum of squares.
2. **Kernels that choose by shape.** A BLAS or cuBLAS product of a weight's slice is not always
   the same columns of the full product (the kernel, its blocking and its thread split depend on
   the shape), and an elementwise CPU kernel computes the last elements of a tensor with scalar code
   whose transcendental functions (``tanh``, ``exp`` in GELU and SiLU) differ from the vector code's
   in the last bit. So every product, activation and per-segment reduction runs on one segment at a
   time, a tensor of the same shape, contiguous and equally aligned, at every tp.
3. **Sums over tokens that sequence parallelism splits.** The gradients of LayerNorm weights and
   of row-parallel biases add every token's part; with sequence parallelism each rank holds some
   tokens. The mode adds them by canonical segments of the sequence, with or without sequence
   parallelism, so turning it on changes no bit either.

What each layer does in the mode is described where the layer lives; what does not change is
everything computed per row, per head or per element on whole rows, heads or elements (LayerNorm
rows, attention heads, AdamW), which is the same whatever a rank holds.
"""

from __future__ import annotations

# The sums (tree_sum, linear, ...) use the collectives: they are imported from their modules, not from here.
from .segments import PlacedTree, SegmentTree, layouts
from .settings import DEFAULT_TP_SIZES, Bitwise, current_bitwise, enable, use_bitwise

__all__ = ["DEFAULT_TP_SIZES", "Bitwise", "PlacedTree", "SegmentTree", "current_bitwise", "enable", "layouts",
           "use_bitwise"]
