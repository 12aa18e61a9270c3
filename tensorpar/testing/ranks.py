"""Local ranks in one process group and their supervision: what :func:`tensorpar.spawn` and the test
pool (:class:`tensorpar.testing.World`) start.

Ranks are children of ``multiprocessing``'s fork server, which imports torch once (the
``forkserver`` start method): each starts in milliseconds with the launcher's environment, working
directory, ``sys.path`` and ``__main__`` (imported afresh, as ``spawn`` does), and meets the others
through a TCP store the launcher hosts on loopback. Results and errors come back over a pipe as
pickles. Each rank also blocks reading a second pipe whose only writer is the launcher: the kernel
closes it when the launcher ends, however it ends, and the rank ends at once. The launcher blocks in
``multiprocessing.connection.wait`` on every pipe and process: the first rank that raises or dies
ends the wait, the others are killed, and the error names the rank most likely to be the root cause.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..mesh import DEFAULT_TIMEOUT, default_backend
from .sendable import missing_main_file_hidden

_LOOPBACK = "127.0.0.1"

#: What a rank runs once it has joined the group: it is given the pipe to the launcher.
RankMain = Callable[[mpc.Connection], None]


class RankError(RuntimeError):
    """An exception raised on a worker rank, re-raised in the launching process.

    ``rank`` is the failing rank, ``remote_traceback`` its traceback as text, and ``__cause__``
    the original exception when it could be pickled.
    """

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        self.rank, self.remote_traceback = rank, remote_traceback
        text = f"rank {rank}: {message}"
        if remote_traceback:
            text += f"\n\n--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


class RanksTimedOut(TimeoutError):
    """Ranks (``ranks``) did not reply in time."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


def _error_payload(error: BaseException) -> tuple[bytes | None, str, str]:
    """``error`` pickled (None if it does not travel), its text and its traceback."""
    blob: bytes | None
    try:
        blob = pickle.dumps(error)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - whatever stops it travelling: its text and traceback go
        blob = None
    return blob, f"{type(error).__name__}: {error}", "".join(traceback.format_exception(error))


def reply(conn: mpc.Connection, work: Callable[[], Any]) -> bool:
    """Send the launcher ``(True, work())``, or ``(False, error)`` if it raises; say which."""
    try:
        message: tuple[bool, Any] = (True, work())
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the launcher
        message = (False, _error_payload(e))
    conn.send_bytes(pickle.dumps(message))
    return message[0]


def _end_with_launcher(lifeline: mpc.Connection, rank: int) -> None:
    """On a thread: block until the launcher's end of ``lifeline`` closes, then end this process."""
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv_bytes()  # the launcher never writes: this ends only by EOFError, in the kernel until then
    sys.stderr.write(f"rank {rank}: the launching process exited; stopping this rank\n")
    sys.stderr.flush()
    os._exit(1)


def _rank_process(main: RankMain, rank: int, world_size: int, port: int, backend: str, timeout: timedelta,
                  threads: int, environ: dict[str, str], conn: mpc.Connection, lifeline: mpc.Connection) -> None:
    os.environ.clear()  # the launcher's environment of now, not the fork server's
    os.environ.update(environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=_LOOPBACK, MASTER_PORT=str(port))
    threading.Thread(target=_end_with_launcher, args=(lifeline, rank), daemon=True).start()
    try:
        try:
            if backend == "nccl":
                torch.cuda.set_device(rank)
            torch.set_num_threads(threads)
            store = dist.TCPStore(_LOOPBACK, port, is_master=False, timeout=timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        except BaseException as e:  # noqa: BLE001 - the launcher reports it
            conn.send_bytes(pickle.dumps((False, _error_payload(e))))
            return
        main(conn)
    finally:  # a forked rank ends with os._exit: run the exit handlers user code registered
        atexit._run_exitfuncs()


@dataclass
class Replies:
    """What :meth:`LocalRanks.collect` heard, by rank: results, errors, deaths (exit codes), silence."""

    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, tuple[bytes | None, str, str]] = field(default_factory=dict)
    dead: dict[int, int | None] = field(default_factory=dict)
    silent: list[int] = field(default_factory=list)

    def raise_first_error(self, what: str) -> None:
        """Raise for the likeliest root cause: a rank that died, else a rank whose error is not a failed
        collective (the peers of a failed rank see those), else the first to report."""
        if self.dead:
            rank, code = min(self.dead.items())
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            seen = "".join(f"; then rank {r} failed: {self.errors[r][1].splitlines()[0]}" for r in sorted(self.errors))
            raise RankError(rank, f"{what} {how} before returning{seen}")
        if self.errors:  # in arrival order: the root cause usually reports first
            order = list(self.errors)
            rank = min(order, key=lambda r: (self.errors[r][1].startswith("CollectiveError"), order.index(r)))
            blob, text, remote_tb = self.errors[rank]
            raise RankError(rank, text, remote_tb) from (pickle.loads(blob) if blob is not None else None)


class LocalRanks:
    """``nprocs`` new local processes joined in one process group, each running ``main(conn)`` once it
    has joined (one that fails to join replies with its error).

    ``threads`` is each rank's intra-op thread count (default: the cores shared out).
    """

    def __init__(self, main: RankMain, nprocs: int, *, backend: str | None = None,
                 collective_timeout: timedelta = DEFAULT_TIMEOUT, threads: int | None = None) -> None:
        if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
            raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
        backend = backend or default_backend(nprocs)
        threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["tensorpar.launch"])  # torch and this module, imported once by the server
        self.size = nprocs
        listener = socket.create_server((_LOOPBACK, 0))  # loopback only (a store would bind every interface)
        self._store = dist.TCPStore(_LOOPBACK, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                                    master_listen_fd=listener.fileno())
        self._listener = listener
        self.procs: list[Any] = []
        self.conns: list[mpc.Connection] = []
        self._lifelines: list[mpc.Connection] = []  # never written: they close when this process ends
        with missing_main_file_hidden():
            for rank in range(nprocs):
                conn, child_conn = ctx.Pipe()
                watched, held = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_rank_process, daemon=True, args=(
                    main, rank, nprocs, self._store.port, backend, collective_timeout, threads, dict(os.environ),
                    child_conn, watched))
                p.start()
                child_conn.close()
                watched.close()
                self.procs.append(p)
                self.conns.append(conn)
                self._lifelines.append(held)

    def send(self, message: Any) -> None:
        """Pickle ``message`` once and send it to every rank."""
        blob = pickle.dumps(message)
        for conn in self.conns:
            conn.send_bytes(blob)

    def collect(self, what: str, timeout: float | None, grace: float = 0.0) -> list[Any]:
        """One reply per rank, in rank order. Raise :class:`RankError` for a rank that raised or died
        (after ``grace`` more seconds for its peers to report what they saw), :class:`RanksTimedOut`
        for ranks still silent after ``timeout`` seconds; ranks that died or stayed silent are killed."""
        replies = self._read(timeout, grace)
        if replies.silent or replies.dead:
            self.kill()
        replies.raise_first_error(what)
        if replies.silent:
            raise RanksTimedOut(f"{what} did not finish within {timeout} s on ranks {replies.silent} of "
                                f"{self.size}", replies.silent)
        return [replies.results[r] for r in range(self.size)]

    def _read(self, timeout: float | None, grace: float) -> Replies:
        deadline = None if timeout is None else time.monotonic() + timeout
        replies, waiting = Replies(), set(range(self.size))
        owner = {c: r for r, c in enumerate(self.conns)} | {p.sentinel: r for r, p in enumerate(self.procs)}
        while waiting:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = mpc.wait([self.conns[r] for r in waiting] + [self.procs[r].sentinel for r in waiting], left)
            if not ready:
                break
            for rank in sorted({owner[item] for item in ready} & waiting):
                if self.conns[rank].poll():
                    try:
                        ok, value = pickle.loads(self.conns[rank].recv_bytes())
                    except EOFError:  # the pipe closed without a reply
                        self.procs[rank].join(5)
                        replies.dead[rank] = self.procs[rank].exitcode
                    else:
                        (replies.results if ok else replies.errors)[rank] = value
                elif not self.procs[rank].is_alive():
                    replies.dead[rank] = self.procs[rank].exitcode
                else:
                    continue
                waiting.discard(rank)
                if rank in replies.dead or rank in replies.errors:
                    soon = time.monotonic() + grace
                    deadline = soon if deadline is None else min(deadline, soon)
        replies.silent = sorted(waiting)
        return replies

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for the ranks to exit, then kill the rest."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()
        for lifeline in self._lifelines:
            lifeline.close()
