"""All-reduce through shared memory for the CPU ranks of a gloo group on one host.

gloo moves CPU tensors between local processes over loopback TCP: every byte
is copied through the kernel, and a small all-reduce costs a few hundred
microseconds of message latency. Ranks on one host can instead share one
memory segment: each writes its tensor into its own slot, raises a flag, and,
once every flag is up, sums the slots in rank order (the same order, so the
same bits, on every rank); a second flag says the slots may be reused.

The segment is a file in ``/dev/shm`` that every rank maps; the creator
unlinks its name as soon as all have mapped it, so nothing outlives the
processes. Waiting spins on the flags, yielding the core, and checks that
every peer process is still alive: a dead peer raises at once rather than
leaving this rank waiting. The flags rely on x86's ordered stores, so the
channel is used on x86-64 only (elsewhere gloo does the work).
"""

from __future__ import annotations

import mmap
import os
import platform
import socket
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

_HEADER = 4096  # per-rank words: [0] pid, [8] posted sequence, [16] done sequence, 64 bytes per rank
_STRIDE = 8  # int64 words per rank (one cache line)


class PeerGone(RuntimeError):
    """A peer of the shared-memory channel exited or stopped answering."""


class SharedMemoryChannel:
    """One group's shared segment: ``all_reduce_(x, op)`` for CPU tensors up to ``capacity`` bytes each."""

    def __init__(self, group: ProcessGroup, path: str, capacity: int, timeout: timedelta) -> None:
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.capacity, self.timeout = capacity, timeout.total_seconds()
        length = _HEADER + self.size * capacity
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), length)
        dist.barrier(group=group)
        if self.rank == 0:
            os.unlink(path)  # every rank holds a mapping: the name is no longer needed
        self._words = torch.frombuffer(self._map, dtype=torch.int64, count=_HEADER // 8)
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=_HEADER)
        self._words[self.rank * _STRIDE] = os.getpid()
        self._seq = 0
        dist.barrier(group=group)
        self._pids = [int(self._words[r * _STRIDE]) for r in range(self.size)]

    def _slot(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        start = rank * self.capacity
        return self._data[start:start + x.numel() * x.element_size()].view(x.dtype).view(x.shape)

    def _wait_all(self, word: int, value: int) -> None:
        deadline, spins = time.monotonic() + self.timeout, 0
        for r in range(self.size):
            while int(self._words[r * _STRIDE + word]) < value:
                spins += 1
                os.sched_yield()
                if spins % 2048 == 0:
                    self._check_peers(deadline)

    def _check_peers(self, deadline: float) -> None:
        for r, pid in enumerate(self._pids):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise PeerGone(f"rank {r} of the group (pid {pid}) exited during an all-reduce") from None
        if time.monotonic() > deadline:
            raise PeerGone(f"an all-reduce waited more than {self.timeout:.0f} s for its peers")

    def all_reduce_(self, x: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
        """Reduce ``x`` (contiguous, CPU) over the group in place; every rank gets the same bits."""
        self._seq += 1
        self._wait_all(2, self._seq - 1)  # everyone has finished reading the previous round's slots
        self._slot(self.rank, x).copy_(x)
        self._words[self.rank * _STRIDE + 1] = self._seq  # posted: x86 keeps the copy before this store
        self._wait_all(1, self._seq)
        slots = [self._slot(r, x) for r in range(self.size)]
        total = slots[0].clone()
        for other in slots[1:]:
            total.add_(other) if op == dist.ReduceOp.SUM else torch.maximum(total, other, out=total)
        x.copy_(total)
        self._words[self.rank * _STRIDE + 2] = self._seq  # done reading
        return x


def open_channel(group: ProcessGroup, capacity: int, timeout: timedelta) -> SharedMemoryChannel | None:
    """A channel with room for ``capacity`` bytes per rank, or ``None`` when ``/dev/shm`` lacks the space
    (a collective: every rank of the group calls it, and all get a channel or all get ``None``)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    name: list[str | None] = [None]
    if rank == 0 and os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize > 2 * (_HEADER + n * capacity):
        name[0] = f"/dev/shm/tensorpar-{uuid.uuid4().hex}"
        with open(name[0], "wb") as f:
            f.truncate(_HEADER + n * capacity)
    dist.broadcast_object_list(name, dist.get_global_rank(group, 0), group=group)
    if name[0] is None:
        return None
    dist.barrier(group=group)
    return SharedMemoryChannel(group, name[0], capacity, timeout)


def supported(group: ProcessGroup) -> bool:
    """Whether the group's ranks can share memory: gloo, x86-64, every rank on this host."""
    if dist.get_backend(group) != "gloo" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if not os.path.isdir("/dev/shm"):
        return False
    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts)) == 1
