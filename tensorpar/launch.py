"""Start local ranks joined in one process group: :func:`spawn`, and the test pool's workers.

Processes are started by ``multiprocessing``'s fork server with torch and
tensorpar already imported in it (the ``forkserver`` start method; ``spawn``
where a platform has no fork server): each rank is a fork of that clean,
single-threaded server, not of the launcher, so it starts in milliseconds
instead of importing torch again, and inherits nothing of the launcher but
what it is sent: the launcher's environment and working directory, its
``sys.path``, and its ``__main__`` module imported afresh, as ``spawn`` would.
The ranks meet through a TCP store that the parent hosts, listening on
loopback only, so no port is guessed and nothing is reachable from another
host. Each rank talks to the
parent over a pipe: results and errors travel back as plain pickles (tensors
by value), between the parent and its own children only. Each rank also
watches that pipe: when the parent is gone (killed by any signal, or exited),
the rank ends at once, so no rank outlives its launcher to keep training or
writing. The parent watches every child in turn: the first rank
that raises or dies ends the wait, the others are stopped, and the error is
re-raised naming the rank most likely to be the root cause, so a failure never
leaves the caller waiting on ranks blocked in a collective.

:class:`LocalRanks` is that machinery; :func:`spawn` runs a function once on
its ranks, and :class:`tensorpar.testing.World` keeps them serving tasks. Both
send the function as its module and name (:mod:`tensorpar.sendable`): one that
a new process cannot import is refused before any rank starts.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import lifeline
from .mesh import DEFAULT_TIMEOUT, default_backend, shutdown
from .sendable import Packed, missing_main_file_hidden, pack, unpack

_LOOPBACK = "127.0.0.1"

#: What a rank runs once it has joined the group: it is given the pipe to the parent.
RankMain = Callable[[multiprocessing.connection.Connection], None]


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
    """What a rank sends back for ``error``: the pickled exception if it pickles, its text, its traceback."""
    blob: bytes | None
    try:
        blob = pickle.dumps(error)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - whatever stops it pickling or unpickling: the text and traceback go
        blob = None
    text = f"{type(error).__name__}: {error}"
    return blob, text, "".join(traceback.format_exception(type(error), error, error.__traceback__))


def reply(conn: multiprocessing.connection.Connection, work: Callable[[], Any]) -> bool:
    """Send the parent ``(True, work())``, or ``(False, error)`` if it raises; say whether it succeeded."""
    try:
        message = (True, work())
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent, which stops the rest
        message = (False, error_payload(e))
    conn.send_bytes(pickle.dumps(message))
    return message[0]


def _join_group(rank: int, world_size: int, port: int, backend: str, timeout: timedelta, threads: int) -> None:
    """In a child: set torchrun's variables and join the group through the parent's store."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=_LOOPBACK, MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.set_num_threads(threads)
    store = dist.TCPStore(_LOOPBACK, port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


#: What the fork server imports once, before it forks any rank: torch, torch.distributed and the launcher.
PRELOADED = ("tensorpar.launch",)


def _start_context() -> multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext:
    """The fork server with :data:`PRELOADED` imported (``spawn`` where the platform has none)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOADED))  # read when the server starts (once per launching process)
    return ctx


def _rank_process(main: RankMain, rank: int, world_size: int, port: int, backend: str, timeout: timedelta,
                  threads: int, environ: dict[str, str], conn: multiprocessing.connection.Connection) -> None:
    # the launcher's environment now, not the fork server's when it started (variables read at torch's
    # import, such as TORCH_LOGS, are the server's)
    os.environ.clear()
    os.environ.update(environ)
    lifeline.end_with_pipe(conn, rank)
    try:
        try:
            _join_group(rank, world_size, port, backend, timeout, threads)
        except BaseException as e:  # noqa: BLE001 - the parent reports it
            conn.send_bytes(pickle.dumps((False, error_payload(e))))
            return
        main(conn)
    finally:
        # A forked rank ends with os._exit, as multiprocessing ends fork server children: run the exit
        # handlers a spawned interpreter would have run (user code may have registered some).
        atexit._run_exitfuncs()


class RanksTimedOut(TimeoutError):
    """Ranks (``ranks``) did not reply in time."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


@dataclass
class Replies:
    """What :meth:`LocalRanks.collect` heard: results and errors by rank, ranks that died
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
            blob, text, remote_tb = self.errors[rank]
            raise RankError(rank, text, remote_tb) from (pickle.loads(blob) if blob is not None else None)


class LocalRanks:
    """``nprocs`` new local processes joined in one process group, each running ``main(conn)``
    once it has joined (one that fails to join replies with its error).

    ``threads`` is each rank's intra-op thread count (default: the cores shared out).
    """

    def __init__(self, main: RankMain, nprocs: int, *, backend: str | None = None,
                 collective_timeout: timedelta = DEFAULT_TIMEOUT, threads: int | None = None) -> None:
        if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
            raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
        backend = backend or default_backend(nprocs)
        threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
        ctx = _start_context()
        self.size = nprocs
        self._listener = socket.create_server((_LOOPBACK, 0))  # loopback only (a store binds every interface)
        self._store = dist.TCPStore(_LOOPBACK, self._listener.getsockname()[1], is_master=True,
                                    wait_for_workers=False, master_listen_fd=self._listener.fileno())
        self.procs: list[Any] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        with missing_main_file_hidden():
            for rank in range(nprocs):
                parent_end, child_end = ctx.Pipe()
                p = ctx.Process(target=_rank_process, args=(main, rank, nprocs, self._store.port, backend,
                                                            collective_timeout, threads, dict(os.environ),
                                                            child_end), daemon=True)
                p.start()
                child_end.close()
                self.procs.append(p)
                self.conns.append(parent_end)

    def send(self, message: Any) -> None:
        """Pickle ``message`` once and send it to every rank."""
        blob = pickle.dumps(message)
        for conn in self.conns:
            conn.send_bytes(blob)

    def collect(self, what: str, timeout: float | None, grace: float = 0.0) -> list[Any]:
        """One reply per rank, in rank order; raise :class:`RankError` for a rank that raised or died
        (after ``grace`` more seconds for its peers to report what they saw), and
        :class:`RanksTimedOut` when ranks are still silent after ``timeout`` seconds. Ranks that died or stayed silent
        are killed: the group is unusable."""
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
        replies = Replies()
        waiting = set(range(self.size))
        owner = {c: r for r, c in enumerate(self.conns)} | {p.sentinel: r for r, p in enumerate(self.procs)}
        while waiting:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait(
                [self.conns[r] for r in waiting] + [self.procs[r].sentinel for r in waiting], timeout=left)
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


def _running_job() -> str | None:
    """How this process is a rank of a running job (started by ``torchrun``, by :func:`spawn` or by
    the test pool, or in a process group of several ranks), in words; None for a plain process."""
    env = os.environ
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return f"this process is rank {dist.get_rank()} of a process group of {dist.get_world_size()}"
    if "TORCHELASTIC_RUN_ID" in env:
        return f"this process is a rank started by torchrun (TORCHELASTIC_RUN_ID={env['TORCHELASTIC_RUN_ID']!r})"
    if "WORLD_SIZE" in env and ("RANK" in env or "LOCAL_RANK" in env):
        rank = env.get("RANK", env.get("LOCAL_RANK"))
        return f"this process is rank {rank} of {env['WORLD_SIZE']} (its RANK and WORLD_SIZE are set, as torchrun's)"
    return None


def _run_once(packed: Packed, timeout: timedelta, conn: multiprocessing.connection.Connection) -> None:
    def work() -> Any:
        fn, args = unpack(packed)
        return fn(*args)
    if reply(conn, work):
        shutdown(timeout)  # leave the group together with the other ranks


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, backend: str | None = None,
          timeout: float | None = None, collective_timeout: timedelta = DEFAULT_TIMEOUT) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local processes in one process group; return the per-rank results.

    The group is gloo on CPU, NCCL when there are at least ``nprocs`` GPUs (one
    per rank). ``fn`` must be importable: defined at the top level of a .py
    file, not in a REPL, on stdin, with ``python -c`` or in a notebook cell
    (``ValueError``), nor a lambda or a function inside a function
    (``TypeError``); both are raised before any rank starts, and so is a
    ``RuntimeError`` when this process is itself a rank of a running job (under
    ``torchrun``, say: call ``fn`` directly there). A rank that raises or exits
    makes the whole call raise :class:`RankError` naming it; so does a run
    longer than ``timeout`` seconds. Collectives inside time out after
    ``collective_timeout``.

    Example::

        def work():
            tensorpar.init(tp=2)
            return ColumnParallelLinear(8, 4).weight.shape

        tensorpar.spawn(work, 2)   # [torch.Size([2, 8]), torch.Size([2, 8])]
    """
    job = _running_job()
    if job is not None:
        raise RuntimeError(f"tensorpar.spawn cannot start {nprocs} ranks here: {job}, so every rank of that job "
                           "would start a job of its own. Call the function directly on the existing ranks "
                           "(tensorpar.init reads torchrun's environment), or spawn from a plain process")
    packed = pack(fn, args, caller="tensorpar.spawn")
    ranks = LocalRanks(functools.partial(_run_once, packed, collective_timeout), nprocs, backend=backend,
                       collective_timeout=collective_timeout)
    clean_exit = 0.0
    try:
        try:  # grace: time for the peers of a failed rank to say what they saw
            results = ranks.collect("process", timeout, grace=5.0)
        except RanksTimedOut as e:
            raise RankError(e.ranks[0], f"timed out after {timeout} s; ranks {e.ranks} had not finished") from None
        clean_exit = collective_timeout.total_seconds()  # let the ranks leave the group together
        return results
    finally:
        ranks.join(clean_exit)

