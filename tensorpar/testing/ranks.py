"""Local ranks in one process group and their supervision, for :func:`tensorpar.spawn` and the test pool:
fork-server children (torch imported once) with the launcher's environment of now, meeting through a TCP
store the launcher hosts on loopback, replying over a pipe, ending with the launcher however it ends (their
``multiprocessing`` parent sentinel, a pipe the kernel closes); the launcher sleeps in ``mpc.wait`` meanwhile."""

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
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..checks import check_int
from ..world import DEFAULT_TIMEOUT, default_backend, shutdown

_LOOPBACK = "127.0.0.1"


class RankError(RuntimeError):
    """An exception of rank ``rank`` re-raised by its launcher, with ``remote_traceback`` (text) and
    the original exception as ``__cause__`` when it could be pickled."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        self.rank, self.remote_traceback = rank, remote_traceback
        where = f"\n\n--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}" if remote_traceback else ""
        super().__init__(f"rank {rank}: {message}{where}")


def _reply(conn: mpc.Connection, work: Callable[[], Any]) -> bool:
    """Send the launcher ``(True, work())``, or if that fails ``(False, (text, traceback, exception or None))``."""
    try:
        conn.send_bytes(pickle.dumps((True, work())))
        return True
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the launcher
        text, remote_traceback = f"{type(e).__name__}: {e}", "".join(traceback.format_exception(e))
        try:
            conn.send_bytes(pickle.dumps((False, (text, remote_traceback, pickle.loads(pickle.dumps(e))))))
        except Exception:  # noqa: BLE001 - whatever stops the exception travelling: its text and traceback go
            conn.send_bytes(pickle.dumps((False, (text, remote_traceback, None))))
        return False


def _end_with_launcher(rank: int) -> None:
    """On a thread: block until the launcher has ended, then end this process."""
    multiprocessing.parent_process().join()  # type: ignore[union-attr]  # its pipe closes when the launcher ends
    print(f"rank {rank}: the launching process exited; stopping this rank", file=sys.stderr, flush=True)
    os._exit(1)


def _join(rank: int, world_size: int, port: int, backend: str, timeout: timedelta, threads: int) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.set_num_threads(threads)
    store = dist.TCPStore(_LOOPBACK, port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _rank_process(run: Callable[[Any], Any], rank: int, world_size: int, port: int, backend: str, timeout: timedelta,
                  threads: int, environ: dict[str, str], conn: mpc.Connection) -> None:
    """Join the group and say so, reply ``run(task)`` to each task until a None, then leave the group."""
    os.environ.clear()  # the launcher's environment of now, not the fork server's
    os.environ.update(environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=_LOOPBACK, MASTER_PORT=str(port))
    dist.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG as the launcher has it (c10d read it at import)
    threading.Thread(target=_end_with_launcher, args=(rank,), daemon=True).start()
    try:
        if _reply(conn, lambda: _join(rank, world_size, port, backend, timeout, threads)):
            while (task := pickle.loads(conn.recv_bytes())) is not None:
                _reply(conn, lambda: run(task))
            shutdown(timeout)  # leave the group together with the other ranks
    finally:  # the fork server ends its children with os._exit: run the exit handlers user code registered
        atexit._run_exitfuncs()


@contextlib.contextmanager
def _missing_main_file_hidden() -> Iterator[None]:
    """Hide a ``__main__.__file__`` naming no file (``<stdin>``): ``multiprocessing`` would run it in new processes."""
    main, path = sys.modules["__main__"], getattr(sys.modules["__main__"], "__file__", None)
    hidden = isinstance(path, str) and not os.path.isfile(path) and main.__dict__.pop("__file__")
    try:
        yield
    finally:
        if hidden:
            main.__file__ = path


class LocalRanks:
    """``nprocs`` new local processes joining one process group: each replies once it has joined (or with
    its error), then with ``run(task)`` for each task sent; ``threads``: each rank's intra-op threads."""

    def __init__(self, run: Callable[[Any], Any], nprocs: int, *, backend: str | None = None,
                 collective_timeout: timedelta = DEFAULT_TIMEOUT, threads: int | None = None) -> None:
        check_int(nprocs, "nprocs")
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["tensorpar.launch"])  # torch and this module, imported once by the server
        listener = socket.create_server((_LOOPBACK, 0))  # loopback only (a store binds every interface)
        self._store = dist.TCPStore(_LOOPBACK, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                                    master_listen_fd=listener.detach())  # the store's alone: it closes it
        self.size, self.procs, self.conns = nprocs, [], []
        args = (nprocs, self._store.port, backend or default_backend(nprocs), collective_timeout,
                threads or max(1, (os.cpu_count() or 1) // nprocs), dict(os.environ))
        with _missing_main_file_hidden():
            for rank in range(nprocs):
                conn, child_conn = ctx.Pipe()
                self.procs.append(ctx.Process(target=_rank_process, args=(run, rank, *args, child_conn), daemon=True))
                self.procs[-1].start()
                child_conn.close()
                self.conns.append(conn)

    def send(self, message: Any) -> None:
        """Pickle ``message`` once and send it to every rank still there (None: leave the group and exit)."""
        blob = pickle.dumps(message)
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(blob)

    def collect(self, what: str, timeout: float | None, grace: float = 0.0) -> list[Any]:
        """One reply per rank, in rank order. Raise :class:`RankError` for a rank that raised or died
        (after ``grace`` more seconds for its peers to report what they saw), ``TimeoutError(message,
        silent ranks)`` for ranks still silent after ``timeout`` seconds; those ranks are killed."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        replies: dict[int, tuple[bool, Any]] = {}  # in arrival order; (False, None): ended without a reply
        while (waiting := [r for r in range(self.size) if r not in replies]) and (
                left := deadline - time.monotonic()) > 0:
            ready = set(mpc.wait([self.conns[r] for r in waiting] + [self.procs[r].sentinel for r in waiting],
                                 None if left == math.inf else left))
            for rank in waiting:
                if not ready & {self.conns[rank], self.procs[rank].sentinel}:
                    continue
                with contextlib.suppress(EOFError):  # EOFError: the pipe closed without a reply
                    if self.conns[rank].poll():
                        replies[rank] = pickle.loads(self.conns[rank].recv_bytes())
                    elif self.procs[rank].is_alive():
                        continue
                if rank not in replies:  # it ended without a reply
                    self.procs[rank].join(5)  # reaped: its exit code is known
                    replies[rank] = (False, None)
                if not replies[rank][0]:
                    deadline = min(deadline, time.monotonic() + grace)
        errors = {r: value for r, (ok, value) in replies.items() if not ok}
        dead = sorted(r for r, error in errors.items() if error is None)
        if waiting or dead:
            self.kill()  # the group is unusable
        if dead:  # the likeliest root cause: a rank that died, else the first to report an error
            code = self.procs[dead[0]].exitcode
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            seen = "".join(f"; then rank {r} failed: {e[0].splitlines()[0]}" for r, e in sorted(errors.items()) if e)
            raise RankError(dead[0], f"{what} {how} before returning{seen}")
        if errors:
            rank, (text, remote_traceback, error) = next(iter(errors.items()))
            raise RankError(rank, text, remote_traceback) from error
        if waiting:
            raise TimeoutError(f"{what} did not finish within {timeout} s on ranks {waiting} of {self.size}", waiting)
        return [replies[r][1] for r in range(self.size)]

    def kill(self, wait: float = 0.0) -> None:
        """Give the ranks ``wait`` seconds in all to exit, then kill the rest; reap them all."""
        deadline = time.monotonic() + wait
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            p.kill()  # a no-op once it has exited
            p.join()
