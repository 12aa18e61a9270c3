"""Ranks end with the process that launched them.

A rank whose launcher is gone (killed by a signal, or crashed) would otherwise
go on computing, writing logs and checkpoints that a restarted job in the same
directory then races. Each rank watches its launcher on a thread of its own
and ends at once (``os._exit``) when it disappears:

* ranks started by :mod:`tensorpar.launch` watch the pipe to their parent: the
  kernel hangs it up the moment the parent exits, however it ends;
* ranks started by ``torchrun`` watch their parent process id, which changes
  when the agent that started them is gone (checked four times a second).
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


def _watch_pipe(conn: multiprocessing.connection.Connection, rank: int) -> None:
    poller = select.poll()
    poller.register(conn.fileno(), 0)  # no events asked for: poll reports only hang-ups and errors
    while True:
        events = [e for _, e in poller.poll()]
        if any(e & select.POLLNVAL for e in events):  # this rank closed the pipe itself: it is exiting
            return
        if any(e & (select.POLLHUP | select.POLLERR) for e in events):
            _end(rank, "the launching process exited")


def end_with_pipe(conn: multiprocessing.connection.Connection, rank: int) -> None:
    """End this process when the other end of ``conn`` (its launcher) hangs up."""
    threading.Thread(target=_watch_pipe, args=(conn, rank), name="tensorpar-lifeline", daemon=True).start()


def _watch_parent(parent: int, rank: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL)
    _end(rank, f"the launching process (pid {parent}) exited")


def end_with_parent(rank: int) -> None:
    """End this process when its parent process exits (this process is then given another parent)."""
    threading.Thread(target=_watch_parent, args=(os.getppid(), rank), name="tensorpar-lifeline",
                     daemon=True).start()
