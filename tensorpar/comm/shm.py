"""All-reduce, all-gather and reduce-scatter through shared memory for the CPU ranks of a gloo
group on one host.

gloo moves CPU tensors between local processes over loopback TCP: every byte
is copied through the kernel, and a small all-reduce costs a few hundred
microseconds of message latency. Ranks on one host can instead share one
memory segment: each writes its tensor into its own slot, describes it (element
count, dtype, reduce op) next to its flag and raises the flag; once every flag
is up, each rank checks that all descriptions agree and sums the slots in rank
order (the same order, so the same bits, on every rank), or copies every
slot out (all-gather), or sums its own part of every slot (reduce-scatter); a
second flag says the slots may be reused. Ranks that disagree all see the same descriptions, so
every rank raises the same :class:`ChannelError`. A channel that failed is never used again: its
group's collectives then go through gloo, and compare each call across ranks first
(:mod:`tensorpar.comm.checks`), so that ranks that disagree later still all raise. A tensor too large for the
segment is seen as such by every rank at once, and they grow it together.

The segment is an anonymous memory file (``memfd``): the first rank creates
it, the others open it through ``/proc/<pid>/fd`` while the creator still holds
it, and from then on it exists only as long as some rank maps it. Nothing is
ever named in ``/dev/shm``, so no failure at any point can leave one behind.
Waiting yields the core for a moment, then sleeps in growing steps; it checks
that every peer process still exists and gives up after the group's timeout,
naming a peer that is stopped. The flags rely on x86's ordered stores, so the
channel is used on x86-64 Linux only (elsewhere gloo does the work).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import platform
import secrets
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..procfs import process_state
from .checks import dtype_code, dtype_name

_STRIDE = 8  # int64 words per rank, one cache line: pid, posted, done, token (rank 0), numel, dtype, op
_PID, _POSTED, _DONE, _TOKEN, _NUMEL, _DTYPE, _OP = range(7)
OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, "all_gather", "reduce_scatter")  # what a round does, by number
_SPIN = 1e-3  # seconds of yielding before a waiting rank starts to sleep
_NAP = 1e-3  # the longest sleep between two looks at the flags
_LOOK = 0.1  # seconds between two checks that the peers are alive
DEFAULT_CAPACITY = 1 << 20  # bytes per rank of a new channel


class ChannelError(RuntimeError):
    """A shared-memory collective failed: the ranks disagreed, or a peer exited or stopped answering."""


def _header(n: int) -> int:
    return -(-n * _STRIDE * 8 // 4096) * 4096


def group_timeout(group: ProcessGroup) -> timedelta:
    """The timeout the group's collectives were configured with (gloo's default where it is not known)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return timedelta(minutes=30)


def _describe(numel: int, dtype: int, op: int) -> str:
    how = ("sum", "max", "all-gather", "reduce-scatter")[op] if 0 <= op < len(OPS) else "another op"
    return f"{numel} {dtype_name(dtype)} elements ({how})"


class Round:
    """A posted round of a channel; ``wait()`` finishes it (once)."""

    def __init__(self, channel: SharedMemoryChannel, mine: tuple[int, int, int],
                 read: Callable[[], None] | None) -> None:
        self._channel, self._mine, self._read, self.done = channel, mine, read, False

    def wait(self) -> None:
        if not self.done:
            self.done = True
            self._channel._finish(self._mine, self._read)


class SharedMemoryChannel:
    """One group's shared segment: ``all_reduce_(x, op)`` for CPU tensors up to ``capacity`` bytes each."""

    def __init__(self, group: ProcessGroup, fd: int, token: int, capacity: int, timeout: timedelta) -> None:
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.capacity, self.timeout = capacity, timeout.total_seconds()
        length = _header(self.size) + self.size * capacity
        if os.fstat(fd).st_size != length:  # not the segment rank 0 made (another process's descriptor)
            raise OSError(f"the shared segment has {os.fstat(fd).st_size} bytes, expected {length}")
        self._map = mmap.mmap(fd, length)
        # the flags, read and written as machine words (a memoryview: ~20x cheaper than tensor indexing)
        self._words = memoryview(self._map)[:_header(self.size)].cast("q")
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=_header(self.size))
        self._words[self.rank * _STRIDE + _PID] = os.getpid()
        self._seq, self.broken = 0, False
        self._open: Round | None = None  # the round posted and not yet finished
        self._token = token
        self._pids: list[int] = []

    def verify(self) -> bool:
        """After every rank has mapped the segment: do they all see one memory and one another?"""
        self._pids = [self._words[r * _STRIDE + _PID] for r in range(self.size)]
        return self._words[_TOKEN] == self._token and all(process_state(p) != "X" for p in self._pids)

    def _slot(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        start = rank * self.capacity
        return self._data[start:start + x.numel() * x.element_size()].view(x.dtype).view(x.shape)

    def _wait_all(self, word: int, value: int) -> None:
        start = time.monotonic()
        look, nap = start + _LOOK, 0.0
        words = self._words
        for r in range(self.size):
            while words[r * _STRIDE + word] < value:
                now = time.monotonic()
                if now < start + _SPIN:
                    os.sched_yield()
                    continue
                nap = min(_NAP, max(2 * nap, 5e-5))
                time.sleep(nap)
                if now > look:
                    self._check_peers(now - start)
                    look = now + _LOOK

    def _check_peers(self, waited: float) -> None:
        states = {r: process_state(pid) for r, pid in enumerate(self._pids) if r != self.rank}
        for r, state in states.items():
            if state in "XZ":
                raise ChannelError(f"rank {r} of the group (pid {self._pids[r]}) exited during a collective")
        if waited > self.timeout:
            stopped = [r for r, state in states.items() if state in "Tt"]
            why = f"; rank {stopped[0]} (pid {self._pids[stopped[0]]}) is stopped" if stopped else ""
            raise ChannelError(f"a collective waited {waited:.1f} s for its peers, past the group's "
                               f"timeout of {self.timeout:g} s{why}")

    def all_reduce_(self, x: torch.Tensor, op: dist.ReduceOp.RedOpType) -> Round | None:
        """Start reducing ``x`` (CPU) over the group in place; ``wait()`` on the round finishes it, and
        every rank gets the same bits. ``None`` (and ``x`` untouched) when ``x`` is larger than the
        channel, which every rank then finds together."""

        def reduce(slots: list[torch.Tensor]) -> None:
            total = slots[0].clone()
            for other in slots[1:]:
                total.add_(other) if op == dist.ReduceOp.SUM else torch.maximum(total, other, out=total)
            x.copy_(total)

        return self.post(x, OPS.index(op), reduce)

    def post(self, x: torch.Tensor, kind: int, read: Callable[[list[torch.Tensor]], None]) -> Round | None:
        """Start a round: put ``x`` (CPU, contiguous) in this rank's slot and say so. The returned round's
        ``wait()`` waits until every rank has posted the same kind of call (``kind``: an index of
        ``OPS``), then calls ``read`` on every rank's slot, in rank order. Work done in between overlaps the
        wait for the peers. A round still open when the next is posted is finished first. ``None``
        when ``x`` is larger than the channel, which every rank then finds together."""
        if self.broken:
            raise ChannelError("this shared-memory channel failed earlier and cannot be used")
        if os.getpid() != self._pids[self.rank]:
            raise ChannelError("a shared-memory channel cannot be used from a forked process")
        if self._open is not None:
            self._open.wait()
        mine = (x.numel(), dtype_code(x.dtype), kind)
        fits = x.numel() * x.element_size() <= self.capacity
        try:
            self._seq += 1
            self._wait_all(_DONE, self._seq - 1)  # everyone has finished reading the previous round's slots
            if fits:
                self._slot(self.rank, x).copy_(x)
            for word, value in zip((_NUMEL, _DTYPE, _OP), mine, strict=True):
                self._words[self.rank * _STRIDE + word] = value
            self._words[self.rank * _STRIDE + _POSTED] = self._seq  # x86 keeps the writes above before this one
        except BaseException:
            self.broken = True  # the peers' view of the sequence is lost: never use this channel again
            raise
        self._open = Round(self, mine, (lambda: read([self._slot(r, x) for r in range(self.size)])) if fits else None)
        if not fits:
            self._open.wait()  # an empty round, so that every rank finds x too large
            return None
        return self._open

    def _finish(self, mine: tuple[int, int, int], read: Callable[[], None] | None) -> None:
        self._open = None
        try:
            self._wait_all(_POSTED, self._seq)
            self._check_agreement(mine)
            if read is not None:
                read()
            self._words[self.rank * _STRIDE + _DONE] = self._seq  # done reading
        except BaseException:
            self.broken = True
            raise

    def _check_agreement(self, mine: tuple[int, int, int]) -> None:
        flat = self._words[:self.size * _STRIDE].tolist()  # one read of every header
        rows = [flat[r * _STRIDE:(r + 1) * _STRIDE] for r in range(self.size)]
        views = [(row[_NUMEL], row[_DTYPE], row[_OP]) for row in rows]
        posted = [row[_POSTED] for row in rows]
        if all(v == mine for v in views) and all(p == self._seq for p in posted):
            return
        self._words[self.rank * _STRIDE + _DONE] = self._seq  # peers may finish their own check
        ranks = "; ".join(f"rank {r}: {_describe(*v)}" + (f" in all-reduce #{p}" if p != self._seq else "")
                          for r, (v, p) in enumerate(zip(views, posted, strict=True)))
        what = ("all-reduce", "all-reduce", "all-gather", "reduce-scatter")[mine[2]]
        raise ChannelError(f"the ranks disagree on {what} #{self._seq} ({ranks})")


def open_channel(group: ProcessGroup, capacity: int, timeout: timedelta) -> SharedMemoryChannel | None:
    """A channel with room for the first rank's ``capacity`` bytes per rank, or ``None`` where the ranks
    cannot share one (no memory for it, or ranks that do not see one another's processes). A collective:
    every rank of the group calls it, and all get a channel or all get ``None``."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    offer = torch.zeros(4, dtype=torch.int64)  # pid, fd, token, capacity; all zero: no segment
    fd = -1
    try:
        if rank == 0 and hasattr(os, "memfd_create"):
            with contextlib.suppress(OSError):
                fd = os.memfd_create("tensorpar-all-reduce", os.MFD_CLOEXEC)
                os.posix_fallocate(fd, 0, _header(n) + n * capacity)  # the pages exist now: no SIGBUS later
                token = secrets.randbits(62)
                os.pwrite(fd, token.to_bytes(8, "little"), _TOKEN * 8)
                offer = torch.tensor([os.getpid(), fd, token, capacity], dtype=torch.int64)
        dist.broadcast(offer, dist.get_global_rank(group, 0), group=group)
        pid, their_fd, token, capacity = offer.tolist()
        channel = None
        if pid:
            with contextlib.suppress(OSError, ValueError):
                if rank == 0:
                    channel = SharedMemoryChannel(group, fd, token, capacity, timeout)
                else:
                    mine = os.open(f"/proc/{pid}/fd/{their_fd}", os.O_RDWR | os.O_CLOEXEC)
                    try:
                        channel = SharedMemoryChannel(group, mine, token, capacity, timeout)
                    finally:
                        os.close(mine)
        ok = torch.tensor([channel is not None], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank has mapped it (or failed)
    finally:
        if fd >= 0:
            os.close(fd)  # from now on the segment lives only in the ranks' mappings
    ok = torch.tensor([bool(ok.item()) and channel is not None and channel.verify()], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return channel if ok.item() else None


def _host_id() -> int:
    return int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:7], "little")


def supported(group: ProcessGroup) -> bool:
    """Whether the group's ranks may share memory: gloo, x86-64 Linux, one host name (a collective;
    :func:`open_channel` then checks that they really share the memory)."""
    eligible = (dist.get_backend(group) == "gloo" and platform.machine().lower() in ("x86_64", "amd64")
                and hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"))
    host = _host_id()
    votes = torch.tensor([host, -host, 0 if eligible else 1], dtype=torch.int64)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)  # one host: max == min; all eligible: max 0
    return votes[0].item() == -votes[1].item() and votes[2].item() == 0
