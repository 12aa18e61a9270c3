"""Run a function on several local processes joined in one process group.

Processes are started fresh (the ``spawn`` start method) and meet through a
TCP store that the parent hosts on loopback, so no port is guessed. Results and
errors travel back as plain pickles (tensors by value). The parent watches
every child: the first rank that raises or dies ends the run, the others are
stopped, and the error is re-raised naming that rank, so a failure never
leaves the caller waiting on ranks blocked in a collective.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .mesh import DEFAULT_TIMEOUT, shutdown

_LOOPBACK = "127.0.0.1"


class RankError(RuntimeError):
    """An exception raised on a worker rank, re-raised in the launching process.

    ``rank`` is the failing rank, ``remote_traceback`` its traceback as text,
    and ``__cause__`` the original exception when it could be pickled.
    """

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        self.rank, self.remote_traceback = rank, remote_traceback
        text = f"rank {rank}: {message}"
        if remote_traceback:
            text += f"\n\n--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


def error_payload(error: BaseException) -> tuple[bytes | None, str, str]:
    """What a worker sends back for ``error``: the pickled exception if it pickles, its text, its traceback."""
    try:
        blob: bytes | None = pickle.dumps(error)
        pickle.loads(blob)
    except Exception:
        blob = None
    text = f"{type(error).__name__}: {error}"
    return blob, text, "".join(traceback.format_exception(type(error), error, error.__traceback__))


def raise_rank_error(rank: int, payload: tuple[bytes | None, str, str]) -> None:
    blob, text, remote_tb = payload
    cause = pickle.loads(blob) if blob is not None else None
    raise RankError(rank, text, remote_tb) from cause


def host_store() -> dist.TCPStore:
    """A TCP store on a free loopback port, hosted by this process, for children to meet at."""
    return dist.TCPStore(_LOOPBACK, 0, is_master=True, wait_for_workers=False)


def join_group(rank: int, world_size: int, port: int, backend: str, timeout: timedelta) -> None:
    """In a child: set torchrun's variables and join the group through the parent's store."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=_LOOPBACK, MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:  # share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    store = dist.TCPStore(_LOOPBACK, port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _worker(fn: Callable[..., Any], args: Sequence[Any], rank: int, world_size: int, port: int, backend: str,
            timeout: timedelta, conn: multiprocessing.connection.Connection) -> None:
    try:
        join_group(rank, world_size, port, backend, timeout)
        conn.send_bytes(pickle.dumps((True, fn(*args))))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent, which stops the rest
        conn.send_bytes(pickle.dumps((False, error_payload(e))))
        return
    shutdown(timeout)


def default_backend_for(nprocs: int) -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo"


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, backend: str | None = None,
          timeout: float | None = None, collective_timeout: timedelta = DEFAULT_TIMEOUT) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local processes in one process group; return the per-rank results.

    The group is gloo on CPU, NCCL when there are at least ``nprocs`` GPUs (one
    per rank). ``fn`` must be importable (defined at module level). A rank that
    raises or exits makes the whole call raise :class:`RankError` naming it; so
    does a run longer than ``timeout`` seconds. Collectives inside time out
    after ``collective_timeout``.

    Example::

        def work():
            tensorpar.init(tp=2)
            return ColumnParallelLinear(8, 4).weight.shape

        tensorpar.spawn(work, 2)   # [torch.Size([2, 8]), torch.Size([2, 8])]
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    backend = backend or default_backend_for(nprocs)
    ctx = multiprocessing.get_context("spawn")
    store = host_store()
    procs, conns = [], []
    for rank in range(nprocs):
        parent_end, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, args=(fn, args, rank, nprocs, store.port, backend,
                                              collective_timeout, child_end), daemon=True)
        p.start()
        child_end.close()
        procs.append(p)
        conns.append(parent_end)
    clean_exit = 0.0
    try:
        replies = collect_replies(procs, conns, timeout, grace=5.0)  # time for peers of a failed rank to say so
        replies.raise_first_error("process")
        if replies.silent:
            raise RankError(replies.silent[0], f"timed out after {timeout} s; ranks {replies.silent} had not finished")
        clean_exit = collective_timeout.total_seconds()  # let the ranks leave the group together
        return [replies.results[r] for r in range(nprocs)]
    finally:
        deadline = time.monotonic() + clean_exit
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()


@dataclass
class Replies:
    """What :func:`collect_replies` heard: results and errors by rank, ranks that died
    (with exit codes), and ranks still silent when it stopped waiting."""

    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, tuple[bytes | None, str, str]] = field(default_factory=dict)
    dead: dict[int, int | None] = field(default_factory=dict)
    silent: list[int] = field(default_factory=list)

    def raise_first_error(self, what: str) -> None:
        """Raise for the likeliest root cause: a rank that died, else a rank whose error is
        not a failed collective (peers of a failed rank see those), else the first to fail."""
        if self.dead:
            rank = min(self.dead)
            code = self.dead[rank]
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            seen = "".join(f"; then rank {r} failed: {self.errors[r][1].splitlines()[0]}" for r in sorted(self.errors))
            raise RankError(rank, f"{what} {how} before returning{seen}")
        if self.errors:  # errors are in arrival order: the root cause usually reports first
            arrival = {r: i for i, r in enumerate(self.errors)}
            rank = min(self.errors, key=lambda r: (self.errors[r][1].startswith("CollectiveError"), arrival[r]))
            raise_rank_error(rank, self.errors[rank])


def collect_replies(procs: Sequence[Any], conns: Sequence[multiprocessing.connection.Connection],
                    timeout: float | None, grace: float = 0.0) -> Replies:
    """Read one pickled ``(ok, value)`` reply per rank.

    Stops waiting ``grace`` seconds after the first error or death (the other
    ranks may be blocked in a collective the failed rank never joined), or
    after ``timeout`` seconds.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    replies = Replies()
    waiting = set(range(len(procs)))
    owner = {c: r for r, c in enumerate(conns)} | {p.sentinel: r for r, p in enumerate(procs)}
    while waiting:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait([conns[r] for r in waiting] + [procs[r].sentinel for r in waiting],
                                                timeout=left)
        if not ready:
            break
        for rank in sorted({owner[item] for item in ready} & waiting):
            if conns[rank].poll():
                try:
                    ok, value = pickle.loads(conns[rank].recv_bytes())
                except EOFError:  # the pipe closed without a reply
                    procs[rank].join(5)
                    replies.dead[rank] = procs[rank].exitcode
                else:
                    (replies.results if ok else replies.errors)[rank] = value
            elif not procs[rank].is_alive():
                replies.dead[rank] = procs[rank].exitcode
            else:
                continue
            waiting.discard(rank)
            if rank in replies.dead or rank in replies.errors:
                soon = time.monotonic() + grace
                deadline = soon if deadline is None else min(deadline, soon)
    replies.silent = sorted(waiting)
    return replies
