"""Local ranks in one process group, and their supervision: what :func:`tensorpar.spawn` and the test
pool (:class:`tensorpar.testing.World`) start.

Ranks are children of ``multiprocessing``'s fork server (torch imported once), with the launcher's
environment, working directory and ``__main__``; they meet through a TCP store the launcher hosts on
loopback and reply over a pipe. Each also blocks reading a pipe only its launcher holds: the kernel
closes it when the launcher ends, however it ends, and the rank ends at once. The launcher blocks in
``multiprocessing.connection.wait`` on every pipe and process, so a rank that raises or dies ends
the wait, and the error names the rank most likely to be the root cause.
"""

from __future__ import annotations

import atexit
import contextlib
import math
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
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..mesh import DEFAULT_TIMEOUT, default_backend
from .sendable import missing_main_file_hidden

_LOOPBACK = "127.0.0.1"

#: What a rank runs once it has joined the group, given its pipe to the launcher.
RankMain = Callable[[mpc.Connection], None]


class RankError(RuntimeError):
    """An exception of rank ``rank`` re-raised by its launcher, with ``remote_traceback`` (text) and
    the original exception as ``__cause__`` when it could be pickled."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        self.rank, self.remote_traceback = rank, remote_traceback
        text = f"rank {rank}: {message}"
        if remote_traceback:
            text += f"\n\n--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


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
    dist.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG as the launcher has it (c10d read it at import)
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


class LocalRanks:
    """``nprocs`` new local processes joined in one process group, each running ``main(conn)`` once it has
    joined (one that fails to join replies with its error); ``threads``: each rank's intra-op threads."""

    def __init__(self, main: RankMain, nprocs: int, *, backend: str | None = None,
                 collective_timeout: timedelta = DEFAULT_TIMEOUT, threads: int | None = None) -> None:
        if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
            raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["tensorpar.launch"])  # torch and this module, imported once by the server
        self._listener = socket.create_server((_LOOPBACK, 0))  # loopback only (a store binds every interface)
        self._store = dist.TCPStore(_LOOPBACK, self._listener.getsockname()[1], is_master=True,
                                    wait_for_workers=False, master_listen_fd=self._listener.fileno())
        self.size, self.procs, self.conns, self._lifelines = nprocs, [], [], []
        with missing_main_file_hidden():
            for rank in range(nprocs):
                (conn, child_conn), (watched, held) = ctx.Pipe(), ctx.Pipe(duplex=False)
                self.procs.append(ctx.Process(target=_rank_process, daemon=True, args=(
                    main, rank, nprocs, self._store.port, backend or default_backend(nprocs), collective_timeout,
                    threads or max(1, (os.cpu_count() or 1) // nprocs), dict(os.environ), child_conn, watched)))
                self.procs[-1].start()
                child_conn.close()
                watched.close()  # the launcher keeps only `held`, and never writes to it
                self.conns.append(conn)
                self._lifelines.append(held)

    def send(self, message: Any) -> None:
        """Pickle ``message`` once and send it to every rank."""
        blob = pickle.dumps(message)
        for conn in self.conns:
            conn.send_bytes(blob)

    def collect(self, what: str, timeout: float | None, grace: float = 0.0) -> list[Any]:
        """One reply per rank, in rank order. Raise :class:`RankError` for a rank that raised or died
        (after ``grace`` more seconds for its peers to report what they saw), ``TimeoutError(message,
        silent ranks)`` for ranks still silent after ``timeout`` seconds; those ranks are killed."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, tuple[bytes | None, str, str]] = {}  # in arrival order
        dead: dict[int, int | None] = {}  # exit codes
        waiting = set(range(self.size))
        while waiting and (left := deadline - time.monotonic()) > 0:
            ready = mpc.wait([self.conns[r] for r in waiting] + [self.procs[r].sentinel for r in waiting],
                             None if left == math.inf else left)
            for rank in sorted(r for r in waiting if self.conns[r] in ready or self.procs[r].sentinel in ready):
                if self.conns[rank].poll():
                    try:
                        ok, value = pickle.loads(self.conns[rank].recv_bytes())
                        (results if ok else errors)[rank] = value
                    except EOFError:  # the pipe closed without a reply
                        self.procs[rank].join(5)
                        dead[rank] = self.procs[rank].exitcode
                elif not self.procs[rank].is_alive():
                    dead[rank] = self.procs[rank].exitcode
                else:
                    continue
                waiting.discard(rank)
                if rank not in results:
                    deadline = min(deadline, time.monotonic() + grace)
        if waiting or dead:
            self.kill()  # the group is unusable
        if dead:  # the likeliest root cause: a rank that died, else the first to report an error
            rank, code = min(dead.items())
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            seen = "".join(f"; then rank {r} failed: {errors[r][1].splitlines()[0]}" for r in sorted(errors))
            raise RankError(rank, f"{what} {how} before returning{seen}")
        if errors:
            rank = next(iter(errors))
            blob, text, remote_tb = errors[rank]
            raise RankError(rank, text, remote_tb) from (pickle.loads(blob) if blob is not None else None)
        if waiting:
            raise TimeoutError(f"{what} did not finish within {timeout} s on ranks {sorted(waiting)} of "
                                f"{self.size}", sorted(waiting))
        return [results[r] for r in range(self.size)]

    def kill(self, wait: float = 0.0) -> None:
        """Give the ranks ``wait`` seconds in all to exit, then kill the rest; reap them all."""
        deadline = time.monotonic() + wait
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for lifeline in self._lifelines:
            lifeline.close()
