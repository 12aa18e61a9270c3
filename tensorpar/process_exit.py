"""The end of a process that joined a process group: leave the group together, then let gloo's
threads finish before the interpreter goes.

:func:`tensorpar.init` registers both at exit when it creates the group:
:func:`shutdown` (after a clean run only) and :func:`wait_for_idle_gloo_workers`.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

from .procfs import process_state, thread_name

DEFAULT_TIMEOUT = timedelta(minutes=10)


def shutdown(timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Wait for every rank, then destroy the process group (a no-op when there is none).

    Ranks that tear gloo down while a peer still uses it can abort; the barrier
    first avoids that. If a peer is gone the barrier fails and the group is
    left for the process exit to drop.
    """
    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timeout)
        else:
            dist.barrier()
    except RuntimeError:
        return
    dist.destroy_process_group()


def _shutdown_at_exit(timeout: timedelta) -> None:
    # After an uncaught exception, exit at once: waiting in a barrier for peers that are
    # blocked in a collective would only hide the failure from the launcher.
    if getattr(sys, "last_value", None) is None:
        shutdown(timeout)
    wait_for_idle_gloo_workers()


def shutdown_at_exit(timeout: timedelta | None) -> None:
    """Close the process group this process created when it exits, waiting up to ``timeout`` for the
    other ranks (see the module docstring); ``None``: no longer (the group is already gone)."""
    atexit.unregister(_shutdown_at_exit)
    if timeout is not None:
        atexit.register(_shutdown_at_exit, timeout)


def wait_for_gloo_at_exit() -> None:
    """Run :func:`wait_for_idle_gloo_workers` when this process exits (once, however often asked)."""
    atexit.unregister(wait_for_idle_gloo_workers)
    atexit.register(wait_for_idle_gloo_workers)


def wait_for_idle_gloo_workers(limit: float = 5.0) -> None:
    """Let gloo's worker threads finish their last task before the interpreter shuts down.

    A gloo process group runs its collectives on worker threads, which drop each
    finished task afterwards. When the task held a tensor whose Python object
    is already gone (a temporary of the caller), dropping it takes the GIL. The
    groups, and so their threads, live as long as Python objects refer to them
    (a mesh, a layer's ``tp_group``), which for a script's globals is until the
    interpreter shuts down; a worker that the scheduler delays until then finds
    the interpreter finalizing, is ended by CPython while in C++ code, and the
    process aborts (``terminate called without an active exception``) after the
    script has succeeded. So, at exit, the GIL is left free until every worker
    has been seen asleep waiting for work three times in a row (Linux: the
    threads' states in ``/proc``), or ``limit`` seconds have passed.
    """
    if not os.path.isdir("/proc/self/task"):
        return
    deadline, quiet = time.monotonic() + limit, 0
    while quiet < 3 and time.monotonic() < deadline:
        time.sleep(0.002)  # the GIL is free meanwhile
        quiet = quiet + 1 if all(state == "S" for state in _gloo_worker_states()) else 0


def _gloo_worker_states() -> Iterator[str]:
    for tid in os.listdir("/proc/self/task"):
        if thread_name(tid) == "pt_gloo_runloop":
            state = process_state("self", tid)
            if state != "X":  # the thread has exited
                yield state
