"""Column- and row-parallel linear maps computed segment by segment (the bitwise mode).

With the segments of the split dimension (:mod:`.segments`, this rank's in ``placed.local``):

* **column-parallel** ``Y = X Wᵀ``, ``W``'s rows split: each segment ``s`` of the output features is
  one product ``X W_sᵀ (+ b_s)``, of the same shape at every tp. The input gradient
  ``Σ_s G_s W_s`` is the tree sum of one product per segment (:func:`~.tree_sum.tree_sum`): it takes
  the place of ``f``'s all-reduce, so the map is called without ``f`` in front of it;
* **row-parallel** ``Y = Σ_s X_s W_sᵀ``, ``W``'s columns split: the output is the tree sum of one
  product per segment of the input features, in place of ``g``; the bias is added after it, and its
  gradient is the token-wise tree sum of :func:`token_sum`.

Weight and input gradients are computed per segment too (``G_sᵀ X`` and ``G W_s``): BLAS and cuBLAS
choose a product's kernel by its shape, so a slice of a larger product need not hold the same bits.
Every operand a kernel reads is contiguous and aligned (:func:`fixed`), a copy where the segment is a
strided or offset view, so that whichever tensor a segment was cut from, the kernel sees the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from ..comm.linear import autocast_inputs
from .segments import PlacedTree
from .tree_sum import tree_sum

#: the alignment of a fresh allocation (torch's CPU allocator: 64 bytes; CUDA's caching allocator: more)
ALIGNMENT = MappingProxyType({"cpu": 64, "cuda": 256})


def fixed(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and starting on an allocation boundary (a copy where it is not). In a
    ``torch.compile`` graph, contiguous: the compiler lays out its buffers itself."""
    if torch.compiler.is_compiling():
        return t.contiguous()
    aligned = t.storage_offset() * t.element_size() % ALIGNMENT.get(t.device.type, 64) == 0
    return t if aligned and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def segments_of(t: torch.Tensor, placed: PlacedTree, dim: int = -1) -> list[tuple[int, torch.Tensor]]:
    """This rank's segments of ``t`` along ``dim`` (its local layout), each with its segment index."""
    return [(s, t.narrow(dim, lo, n)) for s, lo, n in placed.local]


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


def by_segment(t: torch.Tensor, placed: PlacedTree, fn: Callable[[torch.Tensor], torch.Tensor],
               dim: int = -1) -> torch.Tensor:
    """``fn`` applied to each of this rank's segments of ``t`` along ``dim`` (:func:`blockwise`): an
    elementwise ``fn`` then computes each element with the same code at every tp (CPU kernels run the
    last elements of a tensor, which depend on its layout, through scalar code)."""
    return blockwise(fn, [t], dim, placed.lengths())


def token_sum(g: torch.Tensor, placed: PlacedTree, group: ProcessGroup | None) -> torch.Tensor:
    """``g`` ``(..., T_r, C)`` summed over every token of the sequence, by canonical segments of the
    tokens (dim -2; ``placed`` over the tokens this rank holds): the same bits whether the tokens are
    split over ranks (sequence parallelism) or not. ``(C,)``, on every rank."""
    g3 = g.reshape(math.prod(g.shape[:-2]), *g.shape[-2:]) if g.dim() >= 2 else g.reshape(1, 1, -1)  # (B, T_r, C)

    def partial(s: int) -> torch.Tensor:
        _, lo, n = next(item for item in placed.local if item[0] == s)
        return fixed(g3.narrow(1, lo, n)).sum((0, 1))  # (C,)

    return tree_sum(partial, placed, group, g3.shape[-1:], g3)


class _SegmentedColumnLinear(torch.autograd.Function):
    """Column-parallel ``Y = X Wᵀ + b`` by output segments; backward, the input gradient's tree sum."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, placed: PlacedTree,
                group: ProcessGroup | None) -> torch.Tensor:
        x, weight, bias = autocast_inputs(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.placed, ctx.group, ctx.has_bias = placed, group, bias is not None
        x2 = fixed(x.reshape(-1, x.shape[-1]))  # (N, in)
        with torch.autocast(x.device.type, enabled=False):
            parts = [F.linear(x2, fixed(w), None if bias is None else fixed(bias.narrow(0, lo, n)))
                     for (_, w), (_, lo, n) in zip(segments_of(weight, placed, 0), placed.local, strict=True)]
        return torch.cat(parts, -1).reshape(*x.shape[:-1], -1)  # (*, out / tp)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        placed, needs = ctx.placed, ctx.needs_input_grad
        g2 = grad.reshape(-1, grad.shape[-1])  # (N, out / tp)
        x2 = fixed(x.reshape(-1, x.shape[-1]))  # (N, in)
        rows = {s: (lo, n) for s, lo, n in placed.local}

        def input_part(s: int) -> torch.Tensor:
            lo, n = rows[s]
            return fixed(g2.narrow(1, lo, n)) @ fixed(weight.narrow(0, lo, n))  # (N, in)

        grad_x = tree_sum(input_part, placed, ctx.group, x2.shape, x2).reshape(x.shape) if needs[0] else None
        grad_w = grad_b = None
        if needs[1]:
            grad_w = torch.cat([fixed(g2.narrow(1, lo, n)).t() @ x2 for _, lo, n in placed.local])  # (out / tp, in)
        if ctx.has_bias and needs[2]:
            grad_b = torch.cat([fixed(g2.narrow(1, lo, n)).sum(0) for _, lo, n in placed.local])
        return grad_x, grad_w, grad_b, None, None


class _SegmentedRowLinear(torch.autograd.Function):
    """Row-parallel ``Y = Σ_s X_s W_sᵀ + b`` by input segments, the sum a tree sum."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, placed: PlacedTree,
                tokens: PlacedTree | None, group: ProcessGroup | None) -> torch.Tensor:
        x, weight, bias = autocast_inputs(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.placed, ctx.tokens, ctx.group, ctx.has_bias = placed, tokens, group, bias is not None
        x2 = x.reshape(-1, x.shape[-1])  # (N, in / tp)
        cols = {s: (lo, n) for s, lo, n in placed.local}

        def part(s: int) -> torch.Tensor:
            lo, n = cols[s]
            return F.linear(fixed(x2.narrow(1, lo, n)), fixed(weight.narrow(1, lo, n)))  # (N, out)

        with torch.autocast(x.device.type, enabled=False):
            y = tree_sum(part, placed, group, (x2.shape[0], weight.shape[0]), x2)
        y = y.reshape(*x.shape[:-1], weight.shape[0])  # (*, out)
        return y if bias is None else y + bias

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        placed, needs = ctx.placed, ctx.needs_input_grad
        g2 = fixed(grad.reshape(-1, grad.shape[-1]))  # (N, out)
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = grad_w = grad_b = None
        if needs[0]:
            grad_x = torch.cat([g2 @ fixed(weight.narrow(1, lo, n)) for _, lo, n in placed.local], -1).reshape(x.shape)
        if needs[1]:
            grad_w = torch.cat([g2.t() @ fixed(x2.narrow(1, lo, n)) for _, lo, n in placed.local], 1)  # (out, in / tp)
        if ctx.has_bias and needs[2]:  # every token's gradient, here: no collective
            grad_b = token_sum(grad, ctx.tokens, None)
        return grad_x, grad_w, grad_b, None, None, None


def segmented_column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, placed: PlacedTree,
                            group: ProcessGroup | None) -> torch.Tensor:
    """Column-parallel ``F.linear(x, weight, bias)`` by ``placed``'s segments of the output features,
    the input gradient summed over the group by the tree (no ``f`` in front of it)."""
    return _SegmentedColumnLinear.apply(x, weight, bias, placed, group)


def segmented_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, placed: PlacedTree,
                         tokens: PlacedTree, group: ProcessGroup | None) -> torch.Tensor:
    """Row-parallel ``Σ_ranks F.linear(x, weight) + bias`` by ``placed``'s segments of the input
    features, summed over the group by the tree; the bias gradient by the token segments ``tokens``
    (every token held here: see :func:`token_sum`)."""
    return _SegmentedRowLinear.apply(x, weight, bias, placed, tokens, group)
