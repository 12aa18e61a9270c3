"""Ranks end with the process that launched them.

A rank whose launcher is gone (killed by a signal, or crashed) would otherwise
go on computing, writing logs and checkpoints that a restarted job in the same
directory then races. Each rank watches its launcher on a thread of its own
and ends at once (``os._exit``) when it disappears:

* ranks started by :mod:`tensorpar.launch` watch the pipe to their parent: the
  kernel hangs it up the moment the parent exits, however it ends;
* ranks started by ``torchrun`` watch their parent process id, which changes
  when the agent that started them is gone (checked four times a second).

Between the launcher's end and the watcher's, a rank may still be running
(up to a quarter of a second under ``torchrun``): code about to make something
visible that outlives the rank (a checkpoint renamed into place, ``latest``
moved) asks :func:`launcher_gone` first, which looks at once.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import select
import sys
import threading
import time

WATCH_INTERVAL = 0.25  # seconds between two looks at a torchrun rank's parent


def _end(rank: int, why: str) -> None:
    sys.stderr.write(f"rank {rank}: {why}; stopping this rank\n")
    sys.stderr.flush()
    os._exit(1)


class Lifeline(threading.Thread):
    """The thread that ends this rank when its launcher is gone: the other end of ``conn`` hangs up, or
    (without ``conn``) this process's parent is no longer ``parent``."""

    def __init__(self, rank: int, *, conn: multiprocessing.connection.Connection | None = None,
                 parent: int | None = None) -> None:
        super().__init__(name="tensorpar-lifeline", daemon=True)
        self.rank, self._conn, self._parent = rank, conn, parent

    def _hung_up(self, timeout: float | None) -> bool | None:
        """Whether the pipe hung up within ``timeout`` seconds (None: this rank closed it itself)."""
        assert self._conn is not None
        poller = select.poll()
        try:
            poller.register(self._conn.fileno(), 0)  # no events asked for: poll reports only hang-ups and errors
        except (OSError, ValueError):  # closed by this rank: it is exiting
            return None
        events = [e for _, e in poller.poll(None if timeout is None else int(timeout * 1000))]
        if any(e & select.POLLNVAL for e in events):
            return None
        return any(e & (select.POLLHUP | select.POLLERR) for e in events)

    def gone(self) -> str | None:
        """Why the launcher is gone, looked at now; None while it runs."""
        if self._conn is not None:
            return "the launching process exited" if self._hung_up(0) else None
        return None if os.getppid() == self._parent else f"the launching process (pid {self._parent}) exited"

    def run(self) -> None:
        if self._conn is not None:
            while (hung_up := self._hung_up(None)) is not None:
                if hung_up:
                    _end(self.rank, "the launching process exited")
            return
        while os.getppid() == self._parent:
            time.sleep(WATCH_INTERVAL)
        _end(self.rank, f"the launching process (pid {self._parent}) exited")


def end_with_pipe(conn: multiprocessing.connection.Connection, rank: int) -> None:
    """End this process when the other end of ``conn`` (its launcher) hangs up."""
    Lifeline(rank, conn=conn).start()


def end_with_parent(rank: int) -> None:
    """End this process when its parent process exits (this process is then given another parent)."""
    Lifeline(rank, parent=os.getppid()).start()


def launcher_gone() -> str | None:
    """Why this rank's launcher is gone ("the launching process exited"), looked at now, or None while
    it runs (and in a process that watches no launcher: one not started by :func:`tensorpar.spawn`,
    the test pool or ``torchrun``).

    Example::

        if (why := tensorpar.lifeline.launcher_gone()) is not None:
            raise RuntimeError(f"{why}: not publishing")
    """
    for thread in threading.enumerate():
        if isinstance(thread, Lifeline):
            return thread.gone()
    return None
