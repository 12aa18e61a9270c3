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

import contextlib
import mmap
import os
import platform
import socket
import time
import uuid
from collections.abc import MutableMapping
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

#: How long an all-reduce waits for its peers before it gives up.
TIMEOUT = timedelta(minutes=10)

_STRIDE = 8  # int64 words per rank, one cache line: [0] pid, [1] posted sequence, [2] done sequence, [3] token


def _header(n: int) -> int:
    return -(-n * _STRIDE * 8 // 4096) * 4096


class PeerGone(RuntimeError):
    """A peer of the shared-memory channel exited or stopped answering."""


class SharedMemoryChannel:
    """One group's shared segment: ``all_reduce_(x, op)`` for CPU tensors up to ``capacity`` bytes each."""

    def __init__(self, group: ProcessGroup, path: str, token: int, capacity: int, timeout: timedelta) -> None:
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.capacity, self.timeout = capacity, timeout.total_seconds()
        header = _header(self.size)
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), header + self.size * capacity)
        self._words = torch.frombuffer(self._map, dtype=torch.int64, count=header // 8)
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=header)
        self._words[self.rank * _STRIDE] = os.getpid()
        self._seq, self.broken = 0, False
        self._token = token
        self._pids: list[int] = []

    def verify(self) -> bool:
        """After every rank has mapped the segment: do they all see one memory and one another?"""
        self._pids = [int(self._words[r * _STRIDE]) for r in range(self.size)]
        if int(self._words[3]) != self._token:  # rank 0 wrote it: not there means another /dev/shm
            return False
        try:
            for pid in self._pids:
                os.kill(pid, 0)  # every peer is a process this rank can see
        except OSError:
            return False
        return True

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
            except OSError:
                raise PeerGone(f"rank {r} of the group (pid {pid}) exited during an all-reduce") from None
        if time.monotonic() > deadline:
            raise PeerGone(f"an all-reduce waited more than {self.timeout:.0f} s for its peers")

    def all_reduce_(self, x: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
        """Reduce ``x`` (CPU) over the group in place; every rank gets the same bits."""
        if os.getpid() != self._pids[self.rank]:
            raise RuntimeError("a shared-memory channel cannot be used from a forked process")
        try:
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
        except BaseException:
            self.broken = True  # the peers' view of the sequence is lost: never use this channel again
            raise
        return x


def open_channel(group: ProcessGroup, capacity: int, timeout: timedelta) -> SharedMemoryChannel | None:
    """A channel with room for ``capacity`` bytes per rank, or ``None`` where the ranks cannot share one
    (no space in ``/dev/shm``, or ranks that do not see the same ``/dev/shm`` or one another's processes).
    A collective: every rank of the group calls it, and all get a channel or all get ``None``."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    length = _header(n) + n * capacity
    offer: list[tuple[str, int] | None] = [None]
    if rank == 0:
        path, token = f"/dev/shm/tensorpar-{uuid.uuid4().hex}", uuid.uuid4().int >> 65
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, length)  # the pages exist now: no SIGBUS later if /dev/shm fills
                os.pwrite(fd, token.to_bytes(8, "little"), 3 * 8)
            finally:
                os.close(fd)
            offer[0] = (path, token)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
    dist.broadcast_object_list(offer, dist.get_global_rank(group, 0), group=group)
    if offer[0] is None:
        return None
    path, token = offer[0]
    try:
        channel: SharedMemoryChannel | None = SharedMemoryChannel(group, path, token, capacity, timeout)
    except OSError:
        channel = None
    dist.barrier(group=group)
    if rank == 0:
        os.unlink(path)  # every rank that could has mapped it: the name is no longer needed
    ok = torch.tensor([channel is not None and channel.verify()], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return channel if ok.item() else None


def supported(group: ProcessGroup) -> bool:
    """Whether the group's ranks may share memory: gloo, x86-64, ``/dev/shm``, one host name (a collective;
    :func:`open_channel` then checks that they really share the memory)."""
    eligible = (dist.get_backend(group) == "gloo" and platform.machine().lower() in ("x86_64", "amd64")
                and os.path.isdir("/dev/shm"))
    hosts: list[tuple[str, bool] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, (socket.gethostname(), eligible), group=group)
    return len({h for h, _ in hosts}) == 1 and all(e for _, e in hosts)


def channel_for(channels: MutableMapping[ProcessGroup, SharedMemoryChannel | None], group: ProcessGroup,
                nbytes: int) -> SharedMemoryChannel | None:
    """``group``'s channel in ``channels`` (a mesh's own, see :class:`tensorpar.Mesh`), opened on first
    use and reopened twice as large when ``nbytes`` per rank no longer fits; ``None`` where the ranks
    cannot share memory or the channel broke. A collective whenever it opens one: every rank of the
    group calls it with the same ``nbytes`` (so every rank makes the same choice)."""
    if group in channels:
        channel = channels[group]
        if channel is None or channel.broken:
            return None
        if nbytes <= channel.capacity:
            return channel
    elif not supported(group):
        channels[group] = None
        return None
    capacity = max(1 << 20, 1 << (nbytes - 1).bit_length())  # grows by powers of two
    channels[group] = open_channel(group, capacity, TIMEOUT)
    return channels[group]
