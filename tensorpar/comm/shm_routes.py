"""Collectives routed through a group's shared-memory channel (:mod:`tensorpar.comm.shm`).

Each function opens the group's channel on first use (in the mapping a mesh
owns), grows it by powers of two when every rank finds a tensor too large for
it, and starts a round: ``wait()`` on the returned round finishes it, so work
done in between overlaps the wait for the peers. ``None`` where the ranks
cannot share memory or the channel failed earlier: the caller then uses gloo,
and every rank makes the same choice (after a failure, :func:`failed`: the
caller then compares every call across ranks, see :mod:`tensorpar.comm.checks`).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .shm import DEFAULT_CAPACITY, OPS, Round, SharedMemoryChannel, group_timeout, open_channel, supported


def start_all_reduce(channels: MutableMapping[ProcessGroup, SharedMemoryChannel | None], group: ProcessGroup,
                     x: torch.Tensor, op: dist.ReduceOp.RedOpType) -> Round | None:
    """Start reducing ``x`` in place through ``group``'s channel in ``channels`` (a mesh's own, see
    :class:`tensorpar.Mesh`), opening it on first use and growing it, by powers of two, when the ranks
    find ``x`` too large for it; ``wait()`` on the round finishes it. ``None`` where the ranks cannot
    share memory or the channel failed earlier: the caller then uses gloo (every rank makes the same
    choice)."""
    return _through(channels, group, x, lambda channel: channel.all_reduce_(x, op))


def start_all_gather(channels: MutableMapping[ProcessGroup, SharedMemoryChannel | None], group: ProcessGroup,
                     out: torch.Tensor, x: torch.Tensor) -> Round | None:
    """Start gathering every rank's ``x`` (CPU, contiguous, the same shape on all) into ``out[r]``,
    routed as :func:`start_all_reduce`."""
    def read(slots: list[torch.Tensor]) -> None:
        for r, slot in enumerate(slots):
            out[r].copy_(slot)

    return _through(channels, group, x, lambda channel: channel.post(x, OPS.index("all_gather"), read))


def start_reduce_scatter(channels: MutableMapping[ProcessGroup, SharedMemoryChannel | None], group: ProcessGroup,
                         out: torch.Tensor, x: torch.Tensor) -> Round | None:
    """Start summing, into ``out``, every rank's ``x[rank]`` (``x``: CPU, contiguous, ``(n, *out.shape)``),
    in rank order; routed as :func:`start_all_reduce`."""
    rank = dist.get_rank(group)

    def read(slots: list[torch.Tensor]) -> None:
        out.copy_(slots[0][rank])
        for slot in slots[1:]:
            out.add_(slot[rank])

    return _through(channels, group, x, lambda channel: channel.post(x, OPS.index("reduce_scatter"), read))


def failed(channels: MutableMapping[ProcessGroup, SharedMemoryChannel | None], group: ProcessGroup) -> bool:
    """Whether ``group``'s channel in ``channels`` failed earlier (its collectives now go through gloo)."""
    channel = channels.get(group)
    return channel is not None and channel.broken


def _through(channels: MutableMapping[ProcessGroup, SharedMemoryChannel | None], group: ProcessGroup,
             x: torch.Tensor, start: Callable[[SharedMemoryChannel], Round | None]) -> Round | None:
    nbytes = x.numel() * x.element_size()
    channel = channels.get(group)
    if group not in channels:
        channel = channels[group] = (open_channel(group, max(DEFAULT_CAPACITY, nbytes), group_timeout(group))
                                     if supported(group) else None)
    while channel is not None and not channel.broken:
        started = start(channel)
        if started is not None:
            return started
        # every rank found x too large, with the same size: grow together (the first rank's size decides)
        channels[group] = channel = open_channel(group, 1 << (nbytes - 1).bit_length(), group_timeout(group))
    return None
