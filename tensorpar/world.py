"""torch.distributed's world: joining it (from torchrun's environment, or a world of one) and leaving it,
the backend and the device its collectives use, and small integer rows compared across it, so that an
argument only some ranks can check makes every rank raise alike (one all-reduce, nothing pickled)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["DEFAULT_TIMEOUT", "agree", "collective_device", "default_backend", "exchange_ints", "join", "shutdown"]

#: How long a collective waits for its peers before it raises (torch's own default for gloo and NCCL).
DEFAULT_TIMEOUT = timedelta(minutes=10)


def default_backend(nprocs: int = 1) -> str:
    """NCCL when this host has a GPU for each of its ``nprocs`` ranks, else gloo."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo"


def collective_device(group: ProcessGroup | None = None) -> torch.device | None:
    """The current CUDA device for an NCCL ``group`` (default: the world), else ``None`` (host memory)."""
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(group)) else None


def join(backend: str | None, timeout: timedelta) -> None:
    """Join the world described by torchrun's environment, or a world of one; :func:`shutdown` leaves it at
    the latest at exit (gloo threads alive in the interpreter's teardown can abort the process: a group still
    held then, e.g. by a model in a module global, ends there, as in plain torch). Under torchrun the kernel
    ends this rank when torchrun's agent ends."""
    backend = backend or default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "WORLD_SIZE" not in os.environ:  # plain `python`, a notebook: a single-process world
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        if "TORCHELASTIC_RUN_ID" in os.environ:  # the kernel kills this rank when torchrun's agent ends
            with contextlib.suppress(OSError, AttributeError):  # Linux only
                ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
        dist.init_process_group(backend, timeout=timeout)
    atexit.register(_close_at_exit, timeout)


def shutdown(timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Wait for every rank (up to ``timeout``; a peer tearing gloo down under another can abort it), then
    destroy the process group; a no-op without one, and with a peer gone the group is left to the exit."""
    if not dist.is_initialized():
        return
    try:  # gloo's barrier names the ranks that did not come
        dist.monitored_barrier(timeout=timeout) if dist.get_backend() == "gloo" else dist.barrier()
    except RuntimeError:
        return
    dist.destroy_process_group()


def _close_at_exit(timeout: timedelta) -> None:
    """:func:`shutdown` at a clean exit; after an uncaught exception, exit at once (peers may be blocked)."""
    if getattr(sys, "last_value", None) is None:
        shutdown(timeout)


def exchange_ints(row: list[int], group: ProcessGroup | None = None,
                  device: torch.device | None = None) -> list[list[int]]:
    """Every rank's ``row`` (the same length on all), in rank order: one all-reduce of a zero matrix in which
    each rank fills its own row. ``device``: the group's."""
    rows = torch.zeros(dist.get_world_size(group), len(row), dtype=torch.int64, device=device)
    rows[dist.get_rank(group)] = torch.tensor(row, dtype=torch.int64)
    dist.all_reduce(rows, group=group)
    return rows.tolist()


def agree(row: list[int], what: str, describe: Callable[..., str]) -> None:
    """Compare ``row`` across the world; where the ranks differ every rank raises alike:
    "the ranks {what} (rank 0: {describe(*row_0)}; ...)"."""
    if dist.get_world_size() == 1:
        return
    everyone = exchange_ints(row, device=collective_device())
    if any(other != everyone[0] for other in everyone):
        views = "; ".join(f"rank {r}: {describe(*other)}" for r, other in enumerate(everyone))
        raise ValueError(f"the ranks {what} ({views})")
