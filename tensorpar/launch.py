"""``tensorpar.spawn``: a function run once on local ranks (started and supervised by :mod:`.testing.ranks`)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .testing.ranks import LocalRanks, RankError
from .testing.sendable import call, pack
from .world import DEFAULT_TIMEOUT

__all__ = ["RankError", "spawn"]


def _running_job() -> str | None:
    """How this process is a rank of a running job (torchrun, spawn, the pool), in words; None if not."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return f"this process is rank {dist.get_rank()} of a process group of {dist.get_world_size()}"
    if (run_id := os.environ.get("TORCHELASTIC_RUN_ID")) is not None:
        return f"this process is a rank started by torchrun (TORCHELASTIC_RUN_ID={run_id!r})"
    return None


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, backend: str | None = None,
          timeout: float | None = None, collective_timeout: timedelta = DEFAULT_TIMEOUT) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local processes in one process group (gloo, or NCCL with a GPU
    per rank, on loopback); return the per-rank results.

    ``fn`` must be importable: defined at the top level of a .py file (a function of a REPL, stdin,
    ``python -c`` or a notebook cell is a ``ValueError``, a lambda or a local function a ``TypeError``,
    raised before any rank starts, as is a ``RuntimeError`` inside a rank of a running job). A rank
    that raises or exits, or a run past ``timeout`` seconds, raises :class:`RankError` naming the
    rank. Collectives time out after ``collective_timeout``. The ranks end when this process ends.
    E.g. ``tensorpar.spawn(work, 2)``, ``work`` calling ``tensorpar.init(tp=2)``: ``[work's result on rank 0, 1]``.
    """
    if (job := _running_job()) is not None:
        raise RuntimeError(f"tensorpar.spawn cannot start {nprocs} ranks here: {job}, so every rank of that job "
                           "would start a job of its own. Call the function directly on the existing ranks "
                           "(tensorpar.init reads torchrun's environment), or spawn from a plain process")
    packed = pack(fn, args, caller="tensorpar.spawn")
    end = time.monotonic() + (math.inf if timeout is None else timeout)
    ranks = LocalRanks(call, nprocs, backend=backend, collective_timeout=collective_timeout)
    clean_exit = 0.0
    try:
        ranks.collect("process", timeout)  # every rank has joined the group
        ranks.send(packed)
        results = ranks.collect("process", end - time.monotonic(), grace=5.0)
        ranks.send(None)  # grace above: for a failed rank's peers to report; now leave the group together
        clean_exit = collective_timeout.total_seconds()
        return results
    except TimeoutError as e:
        raise RankError(e.args[1][0], f"timed out after {timeout} s; ranks {e.args[1]} had not finished") from None
    finally:
        ranks.kill(clean_exit)
