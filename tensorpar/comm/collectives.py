"""Out-of-place collectives along any dim, with uneven shard sizes.

These are the plain (non-autograd) building blocks of :mod:`tensorpar.comm`. They never write into their input,
record themselves with the active collective counters, and turn a backend failure (a peer died, a timeout) into an
error that names this rank. A CPU all-reduce among gloo ranks on one host goes through shared memory
(:mod:`tensorpar.comm.shm`, through the channels the current mesh owns); elsewhere small ones are a point-to-point
exchange and large ones gloo's ring. Inside a ``torch.compile`` graph every collective is a functional collective,
under a dispatch mode (``CommDebugMode``) every collective takes the plain ``c10d`` route, and under
``torch.profiler`` each shows as a span ``tensorpar::<op>`` on the route it takes (:mod:`tensorpar.comm.traced`).
gloo cannot all-gather tensors of unequal sizes, so uneven shards are padded to the largest and trimmed afterwards;
counts exclude the padding.

``counters``, when given, marks the call as backward work for the collective counters captured by the matching
forward (see :mod:`tensorpar.comm.counter`).

A tensor is viewed as ``(pre, n, post)`` around the split dim, so that shard ``r`` of every rank is one contiguous
block of a ``(world, pre, n_max, post)`` buffer, which is the layout ``all_gather`` / ``reduce_scatter`` work on.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..mesh import current_mesh_or_none
from . import shm_routes, traced
from .checks import REDUCE_OPS, agree, dtype_code, enabled
from .counter import CollectiveCounter, record

# torch >= 2.12 renamed the tensor-in/tensor-out collectives: these names work on every torch (use them, not dist's).
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _flat_collective(op: Any, out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> None:
    """Run a flat tensor-in/tensor-out collective; gloo gets CUDA tensors staged through host memory."""
    if inp.is_cuda and dist.get_backend(group) == "gloo":
        host_out = out.cpu()
        op(host_out, inp.cpu(), group=group)
        out.copy_(host_out)
    else:
        op(out, inp, group=group)


class CollectiveError(RuntimeError):
    """A collective failed on this rank (a peer exited, or the group timed out)."""


@contextlib.contextmanager
def _tagged(op: str, x: torch.Tensor, group: ProcessGroup, *, waiting: bool = False) -> Iterator[None]:
    """Around a collective's start (or, ``waiting``, its wait): a backend failure becomes a
    :class:`CollectiveError` naming this rank, and the profiler records the span ``tensorpar::<op>``
    (``tensorpar::<op>.wait``) whatever route the collective takes."""
    span = (torch.profiler.record_function(f"tensorpar::{op}{'.wait' if waiting else ''}") if traced.profiling()
            else contextlib.nullcontext())
    try:
        with span:
            yield
    except RuntimeError as e:
        raise CollectiveError(
            f"rank {dist.get_rank()}: {op} of a {tuple(x.shape)} {x.dtype} tensor over a group of "
            f"{dist.get_world_size(group)} failed: {e}"
        ) from e


def _checking(group: ProcessGroup) -> bool:
    """Whether to compare a call's arguments across ranks (eager mode only: see :mod:`.traced`): when
    checks are :func:`~.checks.enabled`, and always over a group whose shared-memory channel failed
    (its ranks disagreed once: a later mismatch on gloo would give each rank another answer)."""
    if traced.tracing():
        return False
    mesh = current_mesh_or_none()
    return enabled() or (mesh is not None and shm_routes.failed(mesh.channels, group))


def _layout(x: torch.Tensor, dim: int, sizes: Sequence[int], n: int) -> tuple[dict[str, int], str | None]:
    """How a call along ``dim`` split as ``sizes`` over ``n`` ranks looks on this rank, in integers (the
    same fields on every rank, for :func:`~tensorpar.comm.checks.agree`), and what is wrong with it
    that every rank can tell."""
    fields = {"dtype": dtype_code(x.dtype), "before": 0, "along": 0, "after": 0}
    padded = [*sizes, *[0] * n][:n]  # n fields on every rank, whatever the length of sizes
    fields |= {f"sizes[{r}]": s if isinstance(s, int) else -1 for r, s in enumerate(padded)}
    if not -x.dim() <= dim < x.dim():
        return fields, f"dim {dim} is out of range for a {x.dim()}-d tensor"
    dim %= x.dim()
    fields |= {"before": math.prod(x.shape[:dim]), "along": x.shape[dim], "after": math.prod(x.shape[dim + 1:])}
    if len(sizes) != n:
        return fields, f"the split {list(sizes)} has {len(sizes)} parts for {n} ranks"
    return fields, None


def _split_view(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """``x`` as ``(pre, n, post)`` around ``dim``, and ``dim`` made non-negative."""
    dim = dim % x.dim()
    pre, post = math.prod(x.shape[:dim]), math.prod(x.shape[dim + 1:])
    return x.reshape(pre, x.shape[dim], post), dim


#: Below this many bytes sent per rank, a CPU all-reduce on gloo is one exchange of point-to-point messages: every
#: rank sends its tensor to every other and reduces the pieces in rank order (the same order, so the same bits, on
#: every rank). That is one message latency instead of the ring's 2 (n - 1), for (n - 1) times the bytes: on
#: loopback gloo with 2 ranks it is 2-4x faster up to 256 KiB, and slower from about 1 MiB.
EXCHANGE_BYTES = 256 * 1024

#: c10d's op and the reduction of stacked pieces, by the name functional collectives give the op
_REDUCE: Mapping[str, tuple[dist.ReduceOp.RedOpType, Callable[[torch.Tensor], torch.Tensor]]] = MappingProxyType(
    {"sum": (dist.ReduceOp.SUM, lambda t: t.sum(0)), "max": (dist.ReduceOp.MAX, lambda t: t.amax(0))})


class PendingAllReduce:
    """An all-reduce in flight; ``wait()`` returns the reduced tensor (written into the input buffer)."""

    def __init__(self, tensor: torch.Tensor, group: ProcessGroup, work: Any = None,
                 exchange: tuple[str, list[torch.Tensor], list[Any]] | None = None) -> None:
        self._tensor, self._group, self._work, self._exchange = tensor, group, work, exchange

    def wait(self) -> torch.Tensor:
        if self._work is None and self._exchange is None:
            return self._tensor  # nothing in flight (one rank)
        with _tagged("all_reduce", self._tensor, self._group, waiting=True):
            if self._work is not None:
                self._work.wait()
            if self._exchange is not None:
                op, pieces, requests = self._exchange
                for request in requests:
                    request.wait()
                self._tensor.copy_(_REDUCE[op][1](torch.stack(pieces)))
                self._exchange = None
        return self._tensor


def _exchange(x: torch.Tensor, group: ProcessGroup, op: str) -> PendingAllReduce:
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    pieces = [x if r == rank else torch.empty_like(x) for r in range(n)]  # x is sent before it is overwritten
    requests = []
    for r in range(n):
        if r != rank:
            peer = dist.get_global_rank(group, r)
            requests += [dist.isend(x, peer, group=group), dist.irecv(pieces[r], peer, group=group)]
    return PendingAllReduce(x, group, exchange=(op, pieces, requests))


def start_all_reduce_(x: torch.Tensor, group: ProcessGroup,
                      counters: tuple[CollectiveCounter, ...] | None = None, *,
                      op: str = "sum", counted: bool = True) -> PendingAllReduce | traced.PendingTraced:
    """Start reducing ``x`` over the group (``op``: ``"sum"`` or ``"max"``) and return at once;
    ``wait()`` returns the result. Eagerly it is written into ``x``, so ``x`` must be a buffer the
    caller owns (never an autograd input); in a traced graph it is a new tensor. Use the result of
    ``wait()``, never ``x``. ``counted=False``: the caller records the call (one of several chunks)."""
    if op not in _REDUCE:  # by name: torch 2.11's Dynamo cannot compare a ReduceOp in a traced region
        raise ValueError(f"all-reduce: op {op!r} is neither 'sum' nor 'max'")
    n = dist.get_world_size(group)
    if n == 1:
        return PendingAllReduce(x, group)
    if traced.tracing():  # a new tensor, in the graph; x is left alone
        return traced.start_all_reduce(x, group, op)
    reduce_op = _REDUCE[op][0]
    if _checking(group):
        agree("all-reduce", group, {"numel": x.numel(), "dtype": dtype_code(x.dtype), "op": REDUCE_OPS.index(op)},
              device=x.device, compare=True)
    if counted:
        record("all_reduce", x.dtype, x.numel(), n, counters)
    with _tagged("all_reduce", x, group):
        if not x.is_cuda and dist.get_backend(group) == "gloo" and not traced.dispatch_watched():
            mesh = current_mesh_or_none()  # its channels: ranks on one host reduce through shared memory
            started = shm_routes.start_all_reduce(mesh.channels, group, x, reduce_op) if mesh is not None else None
            if started is not None:
                return PendingAllReduce(x, group, work=started)  # finished by wait()
            if x.numel() * x.element_size() * (n - 1) <= EXCHANGE_BYTES:  # by size alone: the same route everywhere
                return _exchange(x, group, op)
        return PendingAllReduce(x, group, work=dist.all_reduce(x, op=reduce_op, group=group, async_op=True))


def all_reduce_sum(x: torch.Tensor, group: ProcessGroup,
                   counters: tuple[CollectiveCounter, ...] | None = None) -> torch.Tensor:
    """Sum of ``x`` over the group, in a new tensor."""
    return start_all_reduce_(x.clone(memory_format=torch.contiguous_format), group, counters).wait()


def broadcast_from_first_(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Overwrite ``x`` in place with the group's first rank's ``x``."""
    n = dist.get_world_size(group)
    if n == 1:
        return x
    if _checking(group):
        agree("broadcast", group, {"numel": x.numel(), "dtype": dtype_code(x.dtype)}, device=x.device, compare=True)
    record("broadcast", x.dtype, x.numel(), n)
    with _tagged("broadcast", x, group):
        dist.broadcast(x, dist.get_global_rank(group, 0), group=group)
    return x


class Pending:
    """A collective in flight; ``wait()`` returns its result (finishing it where work remains)."""

    def __init__(self, what: str, x: torch.Tensor, group: ProcessGroup, work: Any,
                 finish: Callable[[], torch.Tensor], *buffers: torch.Tensor) -> None:
        self._what, self._x, self._group, self._work, self._finish = what, x, group, work, finish
        self._buffers = buffers  # alive until the collective that reads or writes them is done

    def wait(self) -> torch.Tensor:
        with _tagged(self._what, self._x, self._group, waiting=True):
            self._work is None or self._work.wait()
        return self._finish()


def _start_flat(what: str, op: Any, out: torch.Tensor, send: torch.Tensor, x: torch.Tensor,
                group: ProcessGroup, async_op: bool) -> Any:
    """Run (or, with ``async_op``, start) a flat collective of ``send`` into ``out``; its work or ``None``.
    CPU ranks of a gloo group on one host go through shared memory (a round, finished by ``wait()``)."""
    mesh = current_mesh_or_none()
    if not send.is_cuda and dist.get_backend(group) == "gloo" and not traced.dispatch_watched() and mesh is not None:
        start = shm_routes.start_all_gather if what == "all_gather" else shm_routes.start_reduce_scatter
        with _tagged(what, x, group):
            started = start(mesh.channels, group, out, send)
        if started is not None:
            return started  # finished by wait()
    with _tagged(what, x, group):  # flat buffers: the backends concatenate along dim 0
        if async_op and not (send.is_cuda and dist.get_backend(group) == "gloo"):  # staged through the host
            return op(out.view(-1), send.view(-1), group=group, async_op=True)
        _flat_collective(op, out.view(-1), send.view(-1), group)
    return None


def all_gather_along(x: torch.Tensor, dim: int, sizes: Sequence[int], group: ProcessGroup,
                     counters: tuple[CollectiveCounter, ...] | None = None) -> torch.Tensor:
    """Concatenation along ``dim`` of every rank's ``x``; rank ``r`` holds ``sizes[r]`` there."""
    return start_all_gather_along(x, dim, sizes, group, counters, async_op=False).wait()


def start_all_gather_along(x: torch.Tensor, dim: int, sizes: Sequence[int], group: ProcessGroup,
                           counters: tuple[CollectiveCounter, ...] | None = None, *,
                           async_op: bool = True, counted: bool = True) -> Pending:
    """Start :func:`all_gather_along` and return at once; ``wait()`` returns the concatenation.
    ``counted=False``: the caller records the call."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    checking = _checking(group)
    if len(sizes) != n or not -x.dim() <= dim < x.dim() or x.shape[dim] != sizes[rank] or checking:
        fields, problem = _layout(x, dim, sizes, n)  # only where something is wrong, or checks are on
        if problem is None and x.shape[dim] != sizes[rank]:
            problem = (f"all-gather along dim {dim}: rank {rank} of {n} holds {x.shape[dim]} "
                       f"elements there but the split is {list(sizes)}")
        agree("all-gather", group, fields | {"along": 0}, problem, device=x.device,  # each rank's own part
              compare=checking)
    if n == 1:
        return Pending("all_gather", x, group, None, lambda: x.clone(memory_format=torch.contiguous_format))
    x3, dim = _split_view(x, dim)
    pre, local, post = x3.shape
    big = max(sizes)
    send = x3.new_zeros(pre, big, post) if local < big else x3.contiguous()
    if local < big:
        send[:, :local] = x3
    if counted:
        record("all_gather", x.dtype, pre * sum(sizes) * post, n, counters, pre * (n * big - sum(sizes)) * post)
    work = None
    if traced.tracing():
        buf = traced.all_gather_flat(send.view(-1), n, group).view(n, pre, big, post)
    else:
        buf = x3.new_empty(n, pre, big, post)
        work = _start_flat("all_gather", all_gather_into_tensor, buf, send, x, group, async_op)

    def finish() -> torch.Tensor:
        if all(s == big for s in sizes):  # contiguous: a view would be copied by whatever saves it
            out = buf.transpose(0, 1).reshape(pre, n * big, post).contiguous()
        else:
            out = torch.cat([buf[r, :, :s] for r, s in enumerate(sizes)], dim=1)
        return out.reshape(*x.shape[:dim], sum(sizes), *x.shape[dim + 1:])

    return Pending("all_gather", x, group, work, finish, send, buf)


def reduce_scatter_along(x: torch.Tensor, dim: int, sizes: Sequence[int], group: ProcessGroup,
                         counters: tuple[CollectiveCounter, ...] | None = None) -> torch.Tensor:
    """This rank's slice (``sizes[rank]`` elements along ``dim``) of the sum of ``x`` over the group."""
    return start_reduce_scatter_along(x, dim, sizes, group, counters, async_op=False).wait()


def start_reduce_scatter_along(x: torch.Tensor, dim: int, sizes: Sequence[int], group: ProcessGroup,
                               counters: tuple[CollectiveCounter, ...] | None = None, *,
                               async_op: bool = True, counted: bool = True) -> Pending:
    """Start :func:`reduce_scatter_along` and return at once; ``wait()`` returns this rank's slice.
    ``counted=False``: the caller records the call (one of several chunks of one reduce-scatter)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    checking = _checking(group)
    if len(sizes) != n or not -x.dim() <= dim < x.dim() or x.shape[dim] != sum(sizes) or checking:
        fields, problem = _layout(x, dim, sizes, n)  # only where something is wrong, or checks are on
        if problem is None and x.shape[dim] != sum(sizes):
            problem = (f"reduce-scatter along dim {dim}: size {x.shape[dim]} does not match "
                       f"the split {list(sizes)} over {n} ranks")
        agree("reduce-scatter", group, fields, problem, device=x.device, compare=checking)
    if n == 1:
        return Pending("reduce_scatter", x, group, None, lambda: x.clone(memory_format=torch.contiguous_format))
    x3, dim = _split_view(x, dim)
    pre, _, post = x3.shape
    big = max(sizes)
    if all(s == big for s in sizes):
        send = x3.reshape(pre, n, big, post).transpose(0, 1).contiguous()
    else:
        send = x3.new_zeros(n, pre, big, post)
        for r, chunk in enumerate(x3.split(list(sizes), dim=1)):
            send[r, :, :sizes[r]] = chunk
    if counted:
        record("reduce_scatter", x.dtype, x.numel(), n, counters, pre * (n * big - sum(sizes)) * post)
    work = None
    if traced.tracing():
        out = traced.reduce_scatter_flat(send.view(-1), n, group).view(pre, big, post)
    else:
        out = x3.new_empty(pre, big, post)
        work = _start_flat("reduce_scatter", reduce_scatter_tensor, out, send, x, group, async_op)
    return Pending("reduce_scatter", x, group, work,
                   lambda: out[:, :sizes[rank]].reshape(*x.shape[:dim], sizes[rank], *x.shape[dim + 1:]), send, out)
