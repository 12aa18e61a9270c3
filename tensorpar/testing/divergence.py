"""What the equivalence debugger compares, and the patterns that diagnose a difference.

:func:`tensorpar.testing.find_divergence` compares tensors of a sharded model (module outputs, gradients,
parameters) with their dense twins as *items*. Each rank holds an item's tensor in one of two ways, decided
from every rank's shape (:func:`classify`):

* **replicated**: the dense shape on every rank; each rank's copy is compared with the dense tensor;
* **sharded**: split along one dim (a parameter's ``sharding()`` dim; for an activation, the one dim where its
  shape differs) into shards whose sizes sum to the dense size there; rank ``r``'s shard is compared with the
  dense tensor's slice at its offset ``o_r = Σ_{s<r} size_s``. A dim whose shards are several pieces of the full
  tensor (a fused ``[Q | K | V]``, a :class:`~tensorpar.Shard` of tuple ``unit`` or with a replicated tail) is
  cut and joined by its placement; an activation is taken to be so when its module's ``sharding()`` has such a
  placement of the same size.

A diverging item is diagnosed from every rank's tensor (gathered), ``d`` being the dense one and ``a_r`` rank
``r``'s; each pattern is tested over the whole tensor with the comparison's tolerance, and nothing is said when
none holds:

* ``a_r = tp·d`` on every rank: a doubled ``f``/``g`` (an all-reduce applied twice);
* ``a_r = d/tp``, ``Σ_r a_r = d`` (partial sums; with a replicated bias ``b`` added on each rank:
  ``Σ_r a_r − (tp−1)·b = d``), or ``a_r = 0`` on some ranks: a missing ``f``/``g`` (the reduction over the tp
  group was not applied);
* a shard equal to the dense slice at another balanced offset: a shard placed at the wrong offset;
* replicated copies that differ across ranks.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..comm.collectives import all_gather_along
from ..full import placements, tp_local
from ..mesh import group_rank_size
from ..sharding import Shard, join_shards, shard
from ..world import exchange_ints
from .compare import rel_error, tolerance
from .findings import Finding

MISSING = "a missing f/g: the reduction over the tp group was not applied"
DOUBLED = "a doubled f/g (an all-reduce applied twice)"
_MAX_DIMS = 8  # dims of a shape that travel in a descriptor


@dataclass
class Item:
    """A tensor to compare: this rank's ``local`` and the dense twin's ``dense`` (``None``: absent).
    ``dim``: the dim a parameter is split along (``None``: replicated); ``any_dim``: an activation,
    split along whichever dim its shape says; ``placement``: how ``dim`` is split when a shard is
    several pieces of the full tensor (``hints``: its module's such placements); ``scale``: the norm below which errors
    are absolute (see :func:`~tensorpar.testing.rel_error`); ``bias``: the module's replicated bias,
    for the partial-sums-with-bias pattern."""

    module: str
    phase: str
    what: str
    local: torch.Tensor | None
    dense: torch.Tensor | None
    dim: int | None = None
    call: int = 0
    scale: float = 0.0
    bias: torch.Tensor | None = None
    any_dim: bool = False
    placement: Shard | None = None
    hints: tuple[Shard, ...] = ()
    # filled by classify():
    kind: str = "absent"  # "replicated", "sharded", "shape" (differs), "unmatched" or "absent" (not compared)
    sizes: list[int] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    errors: list[float] = field(default_factory=list)
    tol: float = 0.0

    def diverging(self) -> list[int]:
        return [r for r, e in enumerate(self.errors) if not e <= self.tol]

    def finding(self, diagnosis: str | None = None, *, downstream: bool = False) -> Finding:
        ranks = self.diverging()
        assert self.dense is not None
        return Finding(self.module, self.phase, self.what, tuple(ranks), max(self.errors[r] for r in ranks),
                       tuple(self.errors), tuple(self.dense.shape), tuple(self.shapes), self.call, diagnosis,
                       downstream)

    @property
    def blocks(self) -> int:
        """Equal blocks split alike along ``dim`` (1: none, or blocks that are not equal)."""
        p = self.placement
        return len(p.units) if p is not None and len(set(p.units)) == 1 and not p.replicated else 1

    def part(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of a full tensor."""
        assert self.dim is not None
        if self.placement is None:
            return full.narrow(self.dim, *self.bounds(rank))
        return shard(full, replace(self.placement, dim=self.dim), len(self.sizes), rank)

    def bounds(self, rank: int) -> tuple[int, int]:
        """``(offset, length)`` of ``rank``'s shard (of its piece of each block) along ``dim``."""
        lengths = [s // self.blocks for s in self.sizes]
        return sum(lengths[:rank]), lengths[rank]

    def take(self, full: torch.Tensor, offset: int, length: int) -> torch.Tensor:
        """Elements ``offset:offset + length`` along ``dim`` of a full tensor (of each block)."""
        assert self.dim is not None  # (..., blocks, length, ...)
        return full.unflatten(self.dim, (self.blocks, -1)).narrow(self.dim + 1, offset, length)


def _descriptor(item: Item) -> list[int]:
    t = item.local
    if t is None or item.dense is None or t.dim() > _MAX_DIMS:
        return [0] * (_MAX_DIMS + 3)
    return [1, zlib.crc32(str(t.dtype).encode()), t.dim(), *t.shape, *[0] * (_MAX_DIMS - t.dim())]


def _split_dim(item: Item, full: tuple[int, ...]) -> int | None:
    """The dim ``item`` may be split along on every rank, with its blocks set; ``None``: none."""
    if item.any_dim:
        differ = {d for s in item.shapes if len(s) == len(full) for d in range(len(full)) if s[d] != full[d]}
        if len(differ) != 1:
            return None
        (dim,) = differ
        fits = [p for p in item.hints if p.size == full[dim]] if dim == len(full) - 1 else []
        item.placement = fits[0] if fits else None
        return dim
    return None if item.dim is None or not full else item.dim % len(full)


def _sizes(item: Item, full: int, n: int, shard_sizes: list[int]) -> list[int]:
    """The shard sizes ``item`` must have along its dim of ``full`` elements over ``n`` ranks: its
    placement's, or any that add up to ``full``."""
    if item.placement is not None:
        try:
            return item.placement.sizes(n)
        except ValueError:
            return []
    return shard_sizes if sum(shard_sizes) == full else []


def classify(items: Sequence[Item], group: ProcessGroup, rtol: float | None,
             device: torch.device | None) -> None:
    """Decide every item's kind from all ranks' shapes, and its per-rank errors (two small
    exchanges, the same on every rank; no tensor data moves)."""
    rank, n = group_rank_size(group)
    width = _MAX_DIMS + 3
    rows = exchange_ints([v for item in items for v in _descriptor(item)], group, device) if items else []
    local_errors = []
    for i, item in enumerate(items):
        described = [row[i * width:(i + 1) * width] for row in rows]
        if not all(d[0] for d in described) or len({d[1] for d in described}) > 1:
            item.kind = "absent"  # missing on some rank or side, or dtypes that differ: not comparable
            local_errors.append(0.0)
            continue
        assert item.dense is not None and item.local is not None
        item.shapes = [tuple(d[3:3 + d[2]]) for d in described]
        full = tuple(item.dense.shape)
        item.tol = tolerance(item.dense.dtype, rtol)
        dim = _split_dim(item, full) if n > 1 else None
        if all(s == full for s in item.shapes):
            item.kind = "replicated"
            local_errors.append(rel_error(item.local, item.dense, item.scale))
        elif (dim is not None and all(s[:dim] + s[dim + 1:] == full[:dim] + full[dim + 1:] for s in item.shapes)
              and [s[dim] for s in item.shapes] == _sizes(item, full[dim], n, [s[dim] for s in item.shapes])):
            item.kind, item.dim, item.sizes = "sharded", dim, [s[dim] for s in item.shapes]
            local_errors.append(rel_error(item.local, item.part(item.dense, rank), item.scale))
        else:  # an activation may be laid out otherwise (a rank's selection of heads): not comparable
            item.kind = "unmatched" if item.any_dim else "shape"
            local_errors.append(float("inf"))
    bits = torch.tensor(local_errors, dtype=torch.float64).view(torch.int64).tolist()  # every rank's, bit for bit
    errors = torch.tensor(exchange_ints(bits, group, device)).view(torch.float64).tolist() if items else []
    for i, item in enumerate(items):
        item.errors = [row[i] for row in errors] if item.kind not in ("absent", "unmatched") else []


def _shards(item: Item, group: ProcessGroup) -> list[torch.Tensor]:
    """Every rank's shard of a sharded ``item``, in rank order (a collective)."""
    assert item.local is not None and item.dim is not None
    return list(all_gather_along(item.local.detach(), item.dim, item.sizes, group).split(item.sizes, item.dim))


def _joined(item: Item, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every rank's shard of ``item`` (a replicated tail: the first rank's)."""
    assert item.dim is not None
    if item.placement is None:
        return torch.cat(shards, item.dim)
    return join_shards(shards, replace(item.placement, dim=item.dim))


def gathered(item: Item, group: ProcessGroup) -> torch.Tensor:
    """Every rank's tensor of ``item`` (a collective): replicated ones stacked ``(tp, *full)``,
    sharded ones joined along their dim into the full shape (piece by piece)."""
    assert item.local is not None
    if item.kind != "sharded":
        return all_gather_along(item.local.detach().unsqueeze(0), 0, [1] * len(item.errors), group)
    return _joined(item, _shards(item, group))


def _tail_summed(item: Item, whole: torch.Tensor, shards: list[torch.Tensor]) -> torch.Tensor:
    """``whole`` with its replicated tail (rows every rank holds) replaced by the sum of the ranks' tails."""
    assert item.placement is not None and item.dim is not None
    dim, tail = item.dim, item.placement.replicated
    summed = torch.stack([s.narrow(dim, s.shape[dim] - tail, tail) for s in shards]).sum(0)
    return torch.cat([whole.narrow(dim, 0, whole.shape[dim] - tail), summed], dim)


def diagnose(item: Item, group: ProcessGroup) -> tuple[str | None, bool]:
    """The diagnosis of a diverging item (a collective: every rank's tensor is gathered), and
    whether the item is a partial sum (its ranks' tensors sum to the dense one)."""
    assert item.dense is not None
    d, tol, n = item.dense.detach(), item.tol, len(item.errors)
    noun = {"forward output": "output", "parameter": "parameter"}.get(item.phase, "gradient")
    if item.kind == "shape":
        shapes = "; ".join(f"rank {r}: {s}" for r, s in enumerate(item.shapes))
        return f"shapes differ from the dense {tuple(d.shape)} ({shapes})", False
    if n == 1:
        return None, False
    shards = _shards(item, group) if item.kind == "sharded" else None
    everyone = _joined(item, shards) if shards is not None else gathered(item, group)
    parts = list(everyone) if item.kind == "replicated" else None
    whole = everyone if item.kind == "sharded" else None
    for expected, says in ((n * d, f"{noun} is tp× too large: {DOUBLED}"),
                           (d / n, f"{noun} is 1/tp of the dense one: {MISSING}")):
        if all(rel_error(t, expected) <= tol for t in (parts or [everyone])):
            return says, False
    if whole is not None and shards is not None and item.placement is not None and item.placement.replicated \
            and rel_error(_tail_summed(item, whole, shards), d) <= tol:  # e.g. K/V rows of a c_attn's output gradient
        return (f"only this rank's part of the elements every rank holds (the ranks' {noun}s of them sum to the "
                f"dense one): {MISSING}", True)
    if whole is not None:
        return _misplaced(item, whole), False
    assert parts is not None
    total, zero = everyone.sum(0), [r for r, p in enumerate(parts) if not p.any()]
    if rel_error(total, d) <= tol:
        only = f", zero on rank{'s' * (len(zero) > 1)} {', '.join(map(str, zero))}" if zero else ""
        return f"only this rank's part (the ranks' {noun}s sum to the dense one{only}): {MISSING}", True
    b = item.bias
    if b is not None and b.dim() == 1 and d.dim() >= 1 and b.shape[0] == d.shape[-1] and \
            rel_error(total - (n - 1) * b.detach().to(total.dtype), d) <= tol:
        return f"only this rank's part (partial sums, each with the bias added): {MISSING}", False
    if zero and d.any():
        return f"{noun} is zero on rank{'s' * (len(zero) > 1)} {', '.join(map(str, zero))}: {MISSING}", False
    good = [r for r in range(n) if item.errors[r] <= tol]
    ref = good[0] if good else 0
    differ = [(r, rel_error(parts[r], parts[ref])) for r in range(n) if r != ref]
    differ = [(r, e) for r, e in differ if not e <= tol]
    if differ:
        return "replicated tensor differs across ranks: " + "; ".join(
            f"rank {r} vs rank {ref}, rel err {e:.3g}" for r, e in differ), False
    return None, False


def _misplaced(item: Item, whole: torch.Tensor) -> str | None:
    """Ranks whose shard equals the dense tensor's part at another rank's offset (of each block)."""
    assert item.dense is not None and item.dim is not None
    d, n, found = item.dense.detach(), len(item.sizes), []
    if item.placement is not None and item.blocks == 1 and len(item.placement.pieces(n, 0)) > 1:
        return None  # unequal blocks or a replicated tail: no common offsets to compare
    block = d.shape[item.dim] // item.blocks
    for r in item.diverging():
        offset, length = item.bounds(r)
        mine = item.take(whole, offset, length)
        for o in sorted({item.bounds(s)[0] for s in range(n)} - {offset}):
            if o + length <= block and rel_error(mine, item.take(d, o, length)) <= item.tol:
                found.append(f"rank {r} holds the shard for offset {o}:{o + length} "
                             f"but sits at {offset}:{offset + length}")
                break
    return "; ".join(found) + (f" (of each of {item.blocks} blocks)" if found and item.blocks > 1 else "") \
        if found else None


def parameter_items(sharded: nn.Module, dense: nn.Module) -> tuple[list[Item], list[Item], list[str]]:
    """Items for every parameter both models name, and for its gradient (a missing gradient counts as
    zeros where the twin has one); and the names only one model has. Gradients are measured against
    the whole dense gradient's norm where that is larger (some are round-off alone in exact zero)."""
    split = placements(sharded)
    mine, theirs = dict(sharded.named_parameters()), dict(dense.named_parameters())
    dense_grads = [q.grad.detach().double().norm() for q in theirs.values() if q.grad is not None]
    scale = torch.stack(dense_grads).norm().item() if dense_grads else 0.0
    values, grads = [], []
    for name, p in mine.items():
        if name not in theirs:
            continue
        q, (module, _, leaf) = theirs[name], name.rpartition(".")
        dim, placement = (split[name][0].dim, split[name][0]) if name in split else (None, None)
        placement = placement if placement is not None and len(placement.pieces(1, 0)) > 1 else None
        local = tp_local(p)
        values.append(Item(module, "parameter", leaf, local, q.detach(), dim, placement=placement))
        g = None if p.grad is None and q.grad is None else tp_local(p.grad) if p.grad is not None \
            else torch.zeros_like(local)
        g_dense = None if g is None else q.grad.detach() if q.grad is not None else torch.zeros_like(q)
        grads.append(Item(module, "parameter gradient", leaf, g, g_dense, dim, scale=scale, placement=placement))
    return values, grads, sorted(set(mine) ^ set(theirs))
