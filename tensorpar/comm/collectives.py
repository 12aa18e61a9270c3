"""Out-of-place collectives along any dim over balanced (uneven) shards: one route each, on torch.

Every collective is a functional collective (``torch.ops._c10d_functional``), eager and traced alike: an
op that starts c10d's collective and returns a new tensor, and ``wait_tensor`` where the result is needed
(eagerly the caller computes meanwhile; in a graph the compiler schedules work between them). Nothing here
reads the environment, looks up a mesh or counts: ``CommDebugMode`` and ``torch.profiler`` see these ops.

Agreement across ranks is torch's: byte sizes that differ abort gloo ("Is there a distributed collective
mismatch in your code?"), ending every rank; the same bytes in another dtype return garbage unless
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` was set before the group was made (c10d then compares each all-reduce's
and broadcast's op, dtype and shape, and every rank raises). An all-gather against a reduce-scatter of the
same bytes, or a stopped peer, ends at the group's timeout. CUDA tensors on gloo travel through host memory.

gloo cannot all-gather unequal sizes, so uneven shards travel padded to the largest and are trimmed after:
a tensor is viewed as ``(pre, n, post)`` around the split dim, shard ``r`` being one contiguous block of a
``(world, pre, n_max, post)`` buffer (the layout of ``all_gather_into_tensor`` and ``reduce_scatter_tensor``).
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


class Pending:
    """A collective in flight (``in_flight=False``: the result of a group of one); ``wait()`` returns its
    result, moved back to ``device`` and finished by ``finish`` where given."""

    def __init__(self, started: torch.Tensor, finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 device: torch.device | None = None, *, in_flight: bool = True) -> None:
        self._started, self._finish, self._device, self._in_flight = started, finish, device, in_flight

    def wait(self) -> torch.Tensor:
        out = _functional.wait_tensor(self._started) if self._in_flight else self._started
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
    """Start reducing ``x`` over the group (``op``: ``"sum"`` or ``"max"``) and return at once;
    ``wait()`` returns the result, a new tensor (``x`` is left alone)."""
    if op not in REDUCE_OPS:
        raise ValueError(f"all-reduce: op {op!r} is neither 'sum' nor 'max'")
    if dist.get_world_size(group) == 1:
        return Pending(x, in_flight=False)
    sent = _host(x, group)
    return Pending(_functional.all_reduce(sent, op, group.group_name), device=_back(x, sent))


def all_reduce_sum(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum of ``x`` over the group, in a new tensor."""
    if dist.get_world_size(group) == 1:
        return x.clone(memory_format=torch.contiguous_format)
    return start_all_reduce_(x, group).wait()


def broadcast_from_first_(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Overwrite ``x`` in place with the group's first rank's ``x``."""
    if dist.get_world_size(group) == 1:
        return x
    sent = _host(x, group)
    return x.copy_(_functional.wait_tensor(_functional.broadcast(sent, 0, group.group_name)))  # 0: in the group


def _split_view(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """``x`` as ``(pre, n, post)`` around ``dim``, and ``dim`` made non-negative."""
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a {x.dim()}-d tensor")
    dim %= x.dim()
    pre, post = math.prod(x.shape[:dim]), math.prod(x.shape[dim + 1:])
    return x.reshape(pre, x.shape[dim], post), dim


def _prepare(what: str, x: torch.Tensor, dim: int, sizes: Sequence[int], group: ProcessGroup
             ) -> tuple[int, int, torch.Tensor, int]:
    """The group's size, this rank, ``x`` as ``(pre, n, post)`` and ``dim`` made non-negative."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(sizes) != n:
        raise ValueError(f"{what}: the split {list(sizes)} has {len(sizes)} parts for {n} ranks")
    return n, rank, *_split_view(x, dim)


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
        return Pending(x.clone(memory_format=torch.contiguous_format), in_flight=False)
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

    return Pending(_functional.all_gather_into_tensor(sent.view(-1), n, group.group_name), finish,
                   _back(send, sent))


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
        return Pending(x.clone(memory_format=torch.contiguous_format), in_flight=False)
    big = max(sizes)
    if all(s == big for s in sizes):
        send = x3.reshape(pre, n, big, post).transpose(0, 1).contiguous()  # (n, pre, big, post)
    else:
        send = x3.new_zeros(n, pre, big, post)
        for r, chunk in enumerate(x3.split(list(sizes), dim=1)):
            send[r, :, :sizes[r]] = chunk
    sent = _host(send, group)
    shape = (*x.shape[:dim], sizes[rank], *x.shape[dim + 1:])
    return Pending(_functional.reduce_scatter_tensor(sent.view(-1), "sum", n, group.group_name),
                   lambda flat: flat.view(pre, big, post)[:, :sizes[rank]].reshape(shape), _back(send, sent))
