"""Column- and row-parallel linear maps computed leaf by leaf (the bitwise mode).

* **column-parallel** ``Y = X Wᵀ``: one product ``X W_lᵀ (+ b_l)`` per leaf ``l`` (:mod:`.segments`) of the
  output features; the input gradient ``Σ_l G_l W_l`` is a tree sum (:mod:`.tree_sum`) in place of ``f``;
* **row-parallel** ``Y = Σ_l X_l W_lᵀ``: a tree sum of one product per leaf of the input features in
  place of ``g``, then the bias, whose gradient is the token-wise tree sum of :func:`token_sum`.

Weight and input gradients are per leaf too (BLAS and cuBLAS choose kernels by shape), and every operand
a kernel reads is contiguous and aligned (:func:`fixed`), whichever tensor a segment was cut from.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from ..comm.linear import autocast_inputs, autocast_off
from ..comm.sequence import gather_sequence, scatter_sequence
from .segments import PlacedTree, placed_tokens
from .tree_sum import start_tree_sum, tree_sum

#: the alignment of a fresh allocation (torch's CPU allocator: 64 bytes; CUDA's caching allocator: more)
ALIGNMENT = MappingProxyType({"cpu": 64, "cuda": 256})
#: the fewest rows a product is computed with: CPU GEMMs (torch 2.13) give row ``i`` of a product of ``M >= 4``
#: rows the same bits whatever ``M`` is, while ``M < 4`` (one token decoding) takes another code path
MIN_ROWS = 8
#: the fewest output features a product has: one (a vocabulary segment of one token) runs as a matrix-vector
#: product, whose rows' bits depend on how many rows there are
MIN_FEATURES = 2
#: a product's inner width is zero-padded to a multiple of this (as are attention's head size and key blocks):
#: CPU GEMMs give a row of a narrower or odd-width product bits that depend on where it lies among the rows
#: (``n_embd=30``: 9e-8 apart), and none at multiples of 4 (attention's batched products: 8)
WIDTH_MULTIPLE = 8
#: elementwise kernels run a flat tensor in vector chunks and its last ``< 2 * vector width`` elements in scalar
#: code, whose ``exp``, ``log`` and ``tanh`` differ in the last bit; a multiple of this has no scalar tail
LANES = 64


def fixed(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and starting on an allocation boundary (a copy where it is not). In a
    ``torch.compile`` graph, contiguous: the compiler lays out its buffers itself."""
    if not t.is_contiguous():
        return t.contiguous()  # a fresh copy (aligned), also in a graph
    if torch.compiler.is_compiling() or t.storage_offset() * t.element_size() % ALIGNMENT.get(t.device.type, 64) == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def padded_rows(x: torch.Tensor, least: int = MIN_ROWS) -> torch.Tensor:
    """``x`` (N, ...) with zero rows after it up to ``least`` (itself when it has as many): each row's
    product then has the same bits whatever the number of rows (a batch of one decoding, or training)."""
    n = x.shape[0]
    return x if n >= least else torch.cat([x, x.new_zeros(least - n, *x.shape[1:])])


def padded_width(t: torch.Tensor, rows: int = 0) -> torch.Tensor:
    """``t`` (N, n) with zero columns after it up to a multiple of :data:`WIDTH_MULTIPLE` and zero rows up to
    ``rows`` (itself when it has as many of both): one copy for both."""
    pad, more = -t.shape[-1] % WIDTH_MULTIPLE, max(rows - t.shape[0], 0)
    return F.pad(t, (0, pad, 0, more)) if pad or more else t


def exact_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear`` of ``x`` and ``w`` zero-padded to an inner width of a multiple of :data:`WIDTH_MULTIPLE` (either
    may come padded already: :func:`padded_width`), with
    16-bit operands multiplied in float32 and the result rounded back to ``dtype`` (default ``x``'s; ``x`` may
    come widened already, for several products): CPU bf16 GEMMs give a row other bits as the number of rows
    changes (seen at 39 rows against 8), float32's do not."""
    if x.shape[-1] % WIDTH_MULTIPLE or w.shape[-1] != x.shape[-1]:  # (they mostly come padded)
        x, w = padded_width(x), padded_width(w)  # exact zeros in every row's sums
    if x.element_size() >= 4 and dtype in (None, x.dtype):
        return F.linear(x, w, b)
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype or x.dtype)


def lanewise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """An elementwise ``fn`` of ``x`` with every element computed by the vector code: flattened and padded
    (with ones) to a multiple of :data:`LANES` elements, so that an element's bits depend neither on the
    tensor's shape nor on where in it the element lies."""
    n = x.numel()
    flat = x.reshape(-1)
    if n % LANES == 0:
        return fn(flat).view(x.shape)
    return fn(F.pad(flat, (0, -n % LANES), value=1.0))[:n].view(x.shape)


class _FixedGradient(torch.autograd.Function):
    """The identity; backward, the gradient made contiguous and aligned (:func:`fixed`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return fixed(grad)


def blockwise(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], dim: int,
              sizes: Sequence[int] | None = None) -> torch.Tensor:
    """``fn`` applied to matching blocks of ``inputs`` along ``dim`` (of ``sizes``, default one element
    each), the results put back side by side along ``dim``. ``fn`` sees each block contiguous and
    aligned, and its backward the block's gradient, so a kernel that runs block by block sees the same
    tensors whatever else a rank holds."""
    sizes = [1] * inputs[0].shape[dim] if sizes is None else sizes
    blocks = zip(*(t.split(list(sizes), dim) for t in inputs), strict=True)
    return torch.cat([_FixedGradient.apply(fn(*(fixed(b) for b in block))) for block in blocks], dim)


class BySegment:
    """An elementwise ``fn(x)`` computed with the same code for every element at every tp, a callable
    ``(x, fn)`` of this rank's segments ``placed`` of the last dim (CPU kernels run the last elements of a
    tensor, which depend on its layout, through scalar code).

    On one CPU thread, one :func:`lanewise` call over the whole of ``x``: its vector code computes each
    element alone, wherever it lies. Elsewhere ``fn`` runs on each segment alone (:func:`blockwise`): with
    several threads each thread's share of a tensor ends in a scalar tail that depends on the tensor's
    size, and a segment's shares are the same at every tp (so on other devices and in ``torch.compile``
    graphs, whose kernels are not checked here)."""

    def __init__(self, placed: PlacedTree) -> None:
        self.placed = placed

    def __call__(self, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if x.device.type == "cpu" and not torch.compiler.is_compiling() and torch.get_num_threads() == 1:
            return lanewise(fn, x)
        return blockwise(functools.partial(lanewise, fn), [x], -1, self.placed.lengths())


def gathered(t: torch.Tensor, pieces: Sequence[tuple[int, int]], dim: int) -> torch.Tensor:
    """The ``(offset, length)`` pieces of ``t`` along ``dim`` side by side: contiguous and aligned (a leaf
    of several segments gathered by a copy, a single segment as :func:`fixed` gives it)."""
    if len(pieces) == 1:
        return fixed(t.narrow(dim, *pieces[0]))
    return torch.cat([t.narrow(dim, lo, n) for lo, n in pieces], dim)


def unpadded(y: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """The first ``rows`` rows and ``columns`` columns of a product computed padded (itself when unpadded)."""
    return y if y.shape == (rows, columns) else y[:rows, :columns]


def in_local_order(placed: PlacedTree, blocks: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """This rank's leaves' ``blocks`` (each its leaf's segments side by side along ``dim``, in ``placed.mine``'s
    order) laid out as its local tensor: one ``cat`` (a single block that is a whole fresh tensor as it is)."""
    if placed.in_order:
        whole = len(blocks) == 1 and not torch.compiler.is_compiling() and _whole(blocks[0])
        return blocks[0] if whole else torch.cat(list(blocks), dim)
    parts: dict[int, torch.Tensor] = {}  # segment -> its block
    for leaf, block in zip(placed.mine, blocks, strict=True):
        parts |= zip(placed.tree.leaves[leaf], block.split([n for _, n in placed.pieces(leaf)], dim), strict=True)
    return torch.cat([parts[s] for s, _, _ in placed.local], dim)


def _whole(t: torch.Tensor) -> bool:
    """Whether ``t`` is contiguous and spans its whole storage (a fresh result, not a view into another)."""
    spans = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t.is_contiguous() and t.storage_offset() == 0 and spans


def token_sum(g: torch.Tensor, placed: PlacedTree, group: ProcessGroup | None) -> torch.Tensor:
    """``g`` ``(..., T_r, C)`` summed over every token of the sequence, by canonical segments of the
    tokens (dim -2; ``placed`` over the tokens this rank holds): the same bits whether the tokens are
    split over ranks (sequence parallelism) or not. ``(C,)``, on every rank."""
    g3 = g.reshape(math.prod(g.shape[:-2]), *g.shape[-2:]) if g.dim() >= 2 else g.reshape(1, 1, -1)  # (B, T_r, C)
    return tree_sum(lambda leaf: gathered(g3, placed.pieces(leaf), 1).sum((0, 1)), placed, group, g3.shape[-1:], g3)


def column_operands(weight: torch.Tensor, bias: torch.Tensor | None, placed: PlacedTree
                    ) -> list[tuple[torch.Tensor, torch.Tensor | None, int]]:
    """What a column-parallel product reads of ``weight`` (out / tp, in) and ``bias`` for each of this rank's
    leaves: its segments' rows side by side (at least :data:`MIN_FEATURES`), its bias, its number of rows."""
    operands = []
    for leaf in placed.mine:
        pieces = placed.pieces(leaf)
        w = padded_width(gathered(weight, pieces, 0), MIN_FEATURES)  # (max(rows of the leaf, 2), in, padded)
        b = None if bias is None else padded_rows(gathered(bias, pieces, 0), MIN_FEATURES)
        operands.append((w, b, sum(k for _, k in pieces)))
    return operands


def row_operands(weight: torch.Tensor, bias: None, placed: PlacedTree) -> dict[int, torch.Tensor]:
    """What a row-parallel product reads of ``weight`` (out, in / tp) for each of this rank's leaves: its
    segments' columns side by side, contiguous (at least :data:`MIN_FEATURES` rows): ``(max(out, 2), n)``
    (``n`` padded)."""
    return {leaf: padded_width(gathered(weight, placed.pieces(leaf), 1), MIN_FEATURES) for leaf in placed.mine}


class LeafOperands:
    """The operands a segmented product reads of its weight and bias (:func:`column_operands`,
    :func:`row_operands`), kept from one call to the next while the same tensors are unchanged (same objects,
    storage and version counter): decoding, a product then reads its weight's columns or fused rows without
    copying them at every token. A layer keeps them only while it runs without gradients and autocast
    (:meth:`SegmentedColumn.__call__`), at the cost of one copy of the leaves that are copies (a row-parallel
    weight's, a fused ``[Q | K | V]``'s rows), dropped when the layer runs with gradients again."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._operands: Any = None

    def drop(self) -> None:
        """Forget the kept operands."""
        self._key = self._operands = None

    def get(self, build: Callable[..., Any], weight: torch.Tensor, bias: torch.Tensor | None,
            placed: PlacedTree) -> Any:
        """``build(weight, bias, placed)``, or what it gave last for the same, unchanged tensors."""
        key = (placed, *((weakref.ref(t), t.data_ptr(), t._version) for t in (weight, bias) if t is not None))
        if self._key is None or not _same(self._key, key):
            self._key, self._operands = None, None  # the old operands are not kept while new ones are made
            self._operands, self._key = build(weight, bias, placed), key
        return self._operands


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two keys of :meth:`LeafOperands.get` name the same placed tree and live, unchanged tensors."""
    return len(a) == len(b) and a[0] is b[0] and all(x[0]() is y[0]() is not None and x[1:] == y[1:]
                                                      for x, y in zip(a[1:], b[1:], strict=True))


def _kept(kept: LeafOperands, x: torch.Tensor) -> LeafOperands | None:
    """``kept`` where a product of ``x`` keeps its weight's operands (eagerly, without gradients or autocast),
    else ``None`` (eagerly, with ``kept`` dropped)."""
    if torch.compiler.is_compiling():
        return None
    if torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type):
        kept.drop()
        return None
    return kept


class _SegmentedColumnLinear(torch.autograd.Function):
    """Column-parallel ``Y = X Wᵀ + b`` by output leaves; backward, the input gradient's tree sum."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, placed: PlacedTree,
                group: ProcessGroup | None, kept: LeafOperands | None = None) -> torch.Tensor:
        x, weight, bias = autocast_inputs(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.placed, ctx.group, ctx.has_bias = placed, group, bias is not None
        x2 = fixed(x.reshape(-1, x.shape[-1]))  # (N, in)
        n = x2.shape[0]
        rows = padded_width(x2, MIN_ROWS)  # (max(N, MIN_ROWS), in, padded)
        wide = rows.float() if rows.element_size() < 4 else rows  # 16-bit rows widened once for every leaf
        operands = column_operands(weight, bias, placed) if kept is None else \
            kept.get(column_operands, weight, bias, placed)
        with autocast_off(x):  # one product per leaf: (N, rows of the leaf) each
            blocks = [unpadded(exact_linear(wide, w, b, rows.dtype), n, k) for w, b, k in operands]
        return in_local_order(placed, blocks, -1).reshape(*x.shape[:-1], -1)  # (*, out / tp)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        placed, needs = ctx.placed, ctx.needs_input_grad
        g2 = grad.reshape(-1, grad.shape[-1])  # (N, out / tp)
        x2 = fixed(x.reshape(-1, x.shape[-1]))  # (N, in)
        grads = {leaf: gathered(g2, placed.pieces(leaf), 1) for leaf in placed.mine}  # (N, rows of the leaf), once

        def input_part(leaf: int) -> torch.Tensor:
            return grads[leaf] @ gathered(weight, placed.pieces(leaf), 0)  # (N, in)

        pending = start_tree_sum(input_part, placed, ctx.group, x2.shape, x2) if needs[0] else None
        grad_w = grad_b = None  # while the partial sums of the input gradient are exchanged
        if needs[1]:  # (out / tp, in): each leaf's rows of it
            grad_w = in_local_order(placed, [grads[leaf].t() @ x2 for leaf in placed.mine], 0)
        if ctx.has_bias and needs[2]:  # a sum over the tokens of each segment's columns
            grad_b = torch.cat([fixed(g2.narrow(1, lo, n)).sum(0) for _, lo, n in placed.local])
        grad_x = None if pending is None else pending.wait().reshape(x.shape)
        return grad_x, grad_w, grad_b, None, None, None


class _SegmentedRowLinear(torch.autograd.Function):
    """Row-parallel ``Y = Σ_leaves X_leaf W_leafᵀ + b`` by input leaves, the sum a tree sum."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, placed: PlacedTree,
                tokens: PlacedTree, group: ProcessGroup | None, kept: LeafOperands | None = None) -> torch.Tensor:
        x, weight, bias = autocast_inputs(x, weight, bias)
        x2 = x.reshape(-1, x.shape[-1])  # (N, in / tp)
        inputs = [gathered(x2, placed.pieces(leaf), 1) for leaf in placed.mine]  # (N, n) each: x, copied once
        ctx.save_for_backward(weight, *inputs)  # the leaves stand for x: no more memory
        ctx.placed, ctx.tokens, ctx.group, ctx.has_bias, ctx.shape = placed, tokens, group, bias is not None, x.shape
        by_leaf = dict(zip(placed.mine, inputs, strict=True))
        columns = row_operands(weight, None, placed) if kept is None else kept.get(row_operands, weight, None, placed)

        def part(leaf: int) -> torch.Tensor:
            x_leaf = by_leaf[leaf]
            product = exact_linear(padded_width(x_leaf, MIN_ROWS), columns[leaf])  # (max(N, MIN_ROWS), out)
            return unpadded(product, x_leaf.shape[0], weight.shape[0])  # (N, out)

        with autocast_off(x):
            y = tree_sum(part, placed, group, (x2.shape[0], weight.shape[0]), x2)
        y = y.reshape(*x.shape[:-1], weight.shape[0])  # (*, out)
        return y if bias is None else y + bias

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        placed, needs = ctx.placed, ctx.needs_input_grad
        weight, *inputs = ctx.saved_tensors
        g2 = fixed(grad.reshape(-1, grad.shape[-1]))  # (N, out)
        grad_x = grad_w = grad_b = None
        if needs[0]:  # per leaf (N, its columns), laid out as this rank's
            grad_x = in_local_order(placed, [g2 @ gathered(weight, placed.pieces(leaf), 1) for leaf in placed.mine],
                                    -1).reshape(ctx.shape)
        if needs[1]:
            grad_w = in_local_order(placed, [g2.t() @ x_leaf for x_leaf in inputs], -1)  # (out, in / tp)
        if ctx.has_bias and needs[2]:  # every token's gradient, here: no collective
            grad_b = token_sum(grad, ctx.tokens, None)
        return grad_x, grad_w, grad_b, None, None, None, None


class SegmentedColumn:
    """A column-parallel layer's product by the segments ``placed`` of its output features, a callable
    ``(x, weight, bias, seq_len)``: the input gradient's tree sum stands
    for ``f``, so the region entry in front of it is the identity. With sequence parallelism the tokens are
    all-gathered first, backward keeping this rank's. Replicated rows must be given whole gradients."""

    def __init__(self, placed: PlacedTree, group: ProcessGroup, sequence_parallel: bool) -> None:
        self.placed, self.group, self.sequence_parallel = placed, group, sequence_parallel
        self.kept = LeafOperands()  # the weight's leaves, kept while decoding

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 seq_len: int | None = None) -> torch.Tensor:
        if self.sequence_parallel:  # (..., T_r, in) -> (..., T, in); backward keeps this rank's tokens
            x = gather_sequence(x, seq_len, self.group)
        return _SegmentedColumnLinear.apply(x, weight, bias, self.placed, self.group, _kept(self.kept, x))


class SegmentedRow:
    """A row-parallel layer's product by the segments ``placed`` of its input features, a callable
    ``(x, weight, bias)``, summed over the group by the tree, the bias gradient by segments of the tokens
    (every token is here: :func:`token_sum`); with sequence parallelism each rank keeps its tokens of the sum."""

    def __init__(self, placed: PlacedTree, group: ProcessGroup, sequence_parallel: bool,
                 tp_sizes: Sequence[int]) -> None:
        self.placed, self.group, self.sequence_parallel, self.tp_sizes = placed, group, sequence_parallel, tp_sizes
        self.kept = LeafOperands()  # the weight's leaves, kept while decoding

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        tokens = placed_tokens(x.shape[-2] if x.dim() > 1 else 1, self.placed.tp, self.placed.rank, self.tp_sizes,
                               split=False)  # from a cache (while torch.compile traces, built in the graph's forward)
        y = _SegmentedRowLinear.apply(x, weight, bias, self.placed, tokens, self.group, _kept(self.kept, x))  # (*, out)
        return scatter_sequence(y, self.group) if self.sequence_parallel else y
