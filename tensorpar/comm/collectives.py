"""Collectives along any dim over balanced (uneven) shards: one function each, on torch.

Eagerly each is c10d's own op (``async_op=True``; the all-reduce in place on a buffer the caller owns);
inside ``torch.compile`` the same function issues the functional collective, which the graph can schedule:
the one branch. ``wait()`` returns the result where it is needed, so the caller computes meanwhile. Nothing
here reads the environment, looks up a mesh or counts: ``CommDebugMode`` and ``torch.profiler`` see c10d's
ops and functional collectives alike, and nothing changes while they watch.

Agreement across ranks is torch's: byte sizes that differ abort gloo ("Is there a distributed collective
mismatch in your code?"); the same bytes in another dtype return garbage unless ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
was set before the group was made (every rank then raises). Other mismatches, and a stopped peer, end at the
group's timeout. gloo cannot all-gather unequal sizes, so uneven shards travel padded to the largest: a
tensor is viewed as ``(pre, n, post)`` around the split dim, shard ``r`` one block of ``(world, pre, n_max,
post)`` (the layout of ``all_gather_into_tensor``); CUDA tensors on gloo travel through host memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

_functional = torch.ops._c10d_functional

#: the reductions, by the name functional collectives give them (a name: torch 2.11's Dynamo cannot
#: compare a ``ReduceOp`` in a traced region)
REDUCE_OPS = ("sum", "max")
# torch 2.13 renamed these two (the old names warn, FutureWarning); torch 2.11 has only the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """A collective in flight: c10d's ``work`` eagerly, a functional collective's result where ``traced``
    (neither: a group of one). ``wait()`` returns the result, moved back to ``device`` and finished by
    ``finish`` where given."""

    def __init__(self, result: torch.Tensor, work: dist.Work | None = None, *, traced: bool = False,
                 finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 device: torch.device | None = None) -> None:
        self._result, self._work, self._traced, self._finish, self._device = result, work, traced, finish, device

    def wait(self) -> torch.Tensor:
        out = self._result
        if self._traced:
            out = _functional.wait_tensor(out)
        elif self._work is not None:
            self._work.wait()
        if self._device is not None:  # staged through host memory
            out = out.to(self._device)
        return out if self._finish is None else self._finish(out)


def _host(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``x``, or its host copy for a gloo group (which moves CUDA tensors through host memory)."""
    return x.cpu() if x.is_cuda and dist.get_backend(group) == "gloo" else x


def _back(x: torch.Tensor, sent: torch.Tensor) -> torch.device | None:
    """Where a result must go back to: ``x``'s device when it was staged through the host."""
    return x.device if sent is not x else None


def start_all_reduce_(x: torch.Tensor, group: ProcessGroup, *, op: str = "sum") -> Pending:
    """Start reducing ``x`` over the group (``op``: ``"sum"`` or ``"max"``) and return at once; ``wait()``
    returns the result. Eagerly ``x`` is reduced in place (pass a buffer of your own, never an autograd
    input); traced, the result is a new tensor."""
    if op not in REDUCE_OPS:
        raise ValueError(f"all-reduce: op {op!r} is neither 'sum' nor 'max'")
    if group.size() == 1:
        return Pending(x)
    sent = _host(x, group)
    if torch.compiler.is_compiling():
        return Pending(_functional.all_reduce(sent, op, group.group_name), traced=True, device=_back(x, sent))
    # the group's own method, c10d's op as dist.all_reduce issues it, without its Python checks (a 16 KB
    # all-reduce between two gloo ranks: 405 µs against 467 µs through dist.all_reduce, 713 µs functional)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return Pending(sent, group.allreduce([sent], options), device=_back(x, sent))


def all_reduce_sum(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum of ``x`` over the group, in a new tensor (``x`` is left alone)."""
    return start_all_reduce_(x.clone(memory_format=torch.contiguous_format), group).wait()


def broadcast_from_first_(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Overwrite ``x`` in place with the group's first rank's ``x``."""
    if group.size() == 1:
        return x
    sent = _host(x, group)
    if torch.compiler.is_compiling():
        return x.copy_(_functional.wait_tensor(_functional.broadcast(sent, 0, group.group_name)))  # 0: in the group
    dist.broadcast(sent, group=group, group_src=0)
    return x if sent is x else x.copy_(sent)


def _prepare(what: str, x: torch.Tensor, dim: int, sizes: Sequence[int], group: ProcessGroup
             ) -> tuple[int, int, torch.Tensor, int]:
    """The group's size, this rank, ``x`` as ``(pre, n, post)`` around ``dim`` and ``dim`` made non-negative."""
    n, rank = group.size(), group.rank()
    if len(sizes) != n:
        raise ValueError(f"{what}: the split {list(sizes)} has {len(sizes)} parts for {n} ranks")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a {x.dim()}-d tensor")
    dim %= x.dim()
    return n, rank, x.reshape(math.prod(x.shape[:dim]), x.shape[dim], math.prod(x.shape[dim + 1:])), dim


def all_gather_along(x: torch.Tensor, dim: int, sizes: Sequence[int], group: ProcessGroup) -> torch.Tensor:
    """Concatenation along ``dim`` of every rank's ``x``; rank ``r`` holds ``sizes[r]`` there."""
    return start_all_gather_along(x, dim, sizes, group).wait()


def start_all_gather_along(x: torch.Tensor, dim: int, sizes: Sequence[int], group: ProcessGroup) -> Pending:
    """Start :func:`all_gather_along` and return at once; ``wait()`` returns the concatenation."""
    n, rank, x3, dim = _prepare("all-gather", x, dim, sizes, group)
    pre, local, post = x3.shape
    if local != sizes[rank]:
        raise ValueError(f"all-gather along dim {dim}: rank {rank} of {n} holds {local} elements there "
                         f"but the split is {list(sizes)}")
    if n == 1:
        return Pending(x.clone(memory_format=torch.contiguous_format))
    big = max(sizes)
    send = x3.new_zeros(pre, big, post) if local < big else x3.contiguous()  # (pre, big, post)
    if local < big:
        send[:, :local] = x3
    sent = _host(send, group)

    def finish(flat: torch.Tensor) -> torch.Tensor:
        buf = flat.view(n, pre, big, post)
        if all(s == big for s in sizes):  # contiguous: a view would be copied by whatever saves it
            out = buf.transpose(0, 1).reshape(pre, n * big, post).contiguous()
        else:
            out = torch.cat([buf[r, :, :s] for r, s in enumerate(sizes)], dim=1)
        return out.reshape(*x.shape[:dim], sum(sizes), *x.shape[dim + 1:])

    if torch.compiler.is_compiling():
        return Pending(_functional.all_gather_into_tensor(sent.view(-1), n, group.group_name), traced=True,
                       finish=finish, device=_back(send, sent))
    out = sent.new_empty(n * sent.numel())  # (n * pre * big * post)
    return Pending(out, _all_gather_single(out, sent.view(-1), group, async_op=True), finish=finish,
                   device=_back(send, sent))


def reduce_scatter_along(x: torch.Tensor, dim: int, sizes: Sequence[int], group: ProcessGroup) -> torch.Tensor:
    """This rank's slice (``sizes[rank]`` elements along ``dim``) of the sum of ``x`` over the group."""
    return start_reduce_scatter_along(x, dim, sizes, group).wait()


def start_reduce_scatter_along(x: torch.Tensor, dim: int, sizes: Sequence[int], group: ProcessGroup) -> Pending:
    """Start :func:`reduce_scatter_along` and return at once; ``wait()`` returns this rank's slice."""
    n, rank, x3, dim = _prepare("reduce-scatter", x, dim, sizes, group)
    pre, full, post = x3.shape
    if full != sum(sizes):
        raise ValueError(f"reduce-scatter along dim {dim}: size {full} does not match "
                         f"the split {list(sizes)} over {n} ranks")
    if n == 1:
        return Pending(x.clone(memory_format=torch.contiguous_format))
    big = max(sizes)
    if all(s == big for s in sizes):
        send = x3.reshape(pre, n, big, post).transpose(0, 1).contiguous()  # (n, pre, big, post)
    else:
        send = x3.new_zeros(n, pre, big, post)
        for r, chunk in enumerate(x3.split(list(sizes), dim=1)):
            send[r, :, :sizes[r]] = chunk
    sent = _host(send, group)
    shape = (*x.shape[:dim], sizes[rank], *x.shape[dim + 1:])
    def finish(flat: torch.Tensor) -> torch.Tensor:
        return flat.view(pre, big, post)[:, :sizes[rank]].reshape(shape)

    if torch.compiler.is_compiling():
        return Pending(_functional.reduce_scatter_tensor(sent.view(-1), "sum", n, group.group_name), traced=True,
                       finish=finish, device=_back(send, sent))
    out = sent.new_empty(sent.numel() // n)  # (pre * big * post)
    return Pending(out, _reduce_scatter_single(out, sent.view(-1), group=group, async_op=True), finish=finish,
                   device=_back(send, sent))
