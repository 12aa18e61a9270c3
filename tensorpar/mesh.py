"""The (pp, dp, tp) process mesh and the default-mesh context.

Ranks are laid out row-major on a ``(pp, dp, tp)`` grid: tp groups are runs of ``tp`` consecutive
ranks (one node under torchrun), dp groups stride across them, pipeline stages are the outermost blocks
of ``dp * tp`` ranks. 4 ranks at ``tp=2``: tp groups [0, 1], [2, 3]; dp groups [0, 2], [1, 3].
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .random import RNGStatesTracker

__all__ = ["DEFAULT_TIMEOUT", "Mesh", "agree", "collective_device", "current_mesh", "current_mesh_or_none",
           "default_backend", "exchange_ints", "group_rank_size", "init", "manual_seed", "shutdown", "tp_group",
           "use_mesh"]


@dataclass(frozen=True)
class Mesh:
    """A 3-D ``("pp", "dp", "tp")`` mesh over the world, with its groups, ranks and sizes; ``rng`` is this
    rank's random stream for sharded regions (:mod:`tensorpar.random`)."""

    device_mesh: DeviceMesh
    tp_group: ProcessGroup
    dp_group: ProcessGroup
    pp_group: ProcessGroup
    tp: int
    dp: int
    pp: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    rank: int
    world_size: int
    device: torch.device
    rng: RNGStatesTracker = field(compare=False)

    def __repr__(self) -> str:
        return (f"Mesh(tp={self.tp}, dp={self.dp}, pp={self.pp}, rank={self.rank}, tp_rank={self.tp_rank}, "
                f"dp_rank={self.dp_rank}, pp_rank={self.pp_rank}, device={self.device})")


# The default mesh of modules built without a ``group``: scoped by ``use_mesh``, per thread.
_current: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("tensorpar_mesh", default=None)

#: How long a collective waits for its peers before it raises (torch's own default for gloo and NCCL).
DEFAULT_TIMEOUT = timedelta(minutes=10)


def default_backend(nprocs: int = 1) -> str:
    """NCCL when this host has a GPU for each of its ``nprocs`` ranks, else gloo."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo"


def _init_process_group(backend: str | None, timeout: timedelta) -> None:
    """Join the world described by torchrun's environment, or a world of one."""
    backend = backend or default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "WORLD_SIZE" not in os.environ:  # plain `python`, a notebook: a single-process world
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise RuntimeError(f"WORLD_SIZE is set but {', '.join(missing)} is not: launch with torchrun "
                               "or tensorpar.spawn, or initialise torch.distributed yourself")
        if "TORCHELASTIC_RUN_ID" in os.environ:
            _end_with_parent()
        dist.init_process_group(backend, timeout=timeout)


def _end_with_parent() -> None:
    """Have the kernel kill this process when its parent (torchrun's agent) ends, even by SIGKILL. Linux only."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG


def init(tp: int | None = None, dp: int | None = None, *, pp: int = 1, backend: str | None = None,
         timeout: timedelta = DEFAULT_TIMEOUT) -> Mesh:
    """Build the ``(pp, dp, tp)`` mesh over the world and make it the default.

    Initialises ``torch.distributed`` from torchrun's environment when it is not yet (a world of one
    without one). ``pp`` defaults to 1, ``dp`` to ``world // (pp * tp)``, ``tp`` to ``world // (pp * dp)``
    (a whole stage when neither is given). Every rank calls it with the same arguments (compared: ranks
    that differ all raise); one that raises leaves no group behind. A group it creates is closed by
    :func:`shutdown` at the latest at exit (gloo threads alive at interpreter exit abort the process).
    Under torchrun the kernel ends this rank when torchrun's agent ends.

    Example::

        mesh = tensorpar.init(tp=2)          # under `torchrun --nproc-per-node 4`: dp = 2
        layer = ColumnParallelLinear(768, 3072)   # uses mesh.tp_group
        mesh = tensorpar.init(tp=2, pp=2)    # 8 ranks: 2 stages of tp=2 x dp=2
    """
    for name, value in (("tp", tp), ("dp", dp), ("pp", pp)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    created = not dist.is_initialized()
    if created:
        _init_process_group(backend, timeout)
        atexit.register(_close_at_exit, timeout)
    elif backend is not None and backend not in dist.get_backend():
        raise ValueError(f"init(backend={backend!r}): the process group already exists with backend "
                         f"{dist.get_backend()!r}; destroy it first or leave backend out")
    try:
        agree([tp or 0, dp or 0, pp, _BACKENDS.index(backend) if backend in _BACKENDS else -1],
              "called tensorpar.init with different arguments", lambda t, d, p, b:
              f"tp={t or None}, dp={d or None}, pp={p}, backend={_BACKENDS[b] if b >= 0 else 'other'!r}")
        mesh = _build_mesh(tp, dp, pp)
    except BaseException:
        if created:  # leave nothing half-initialised
            dist.destroy_process_group()
        raise
    _current.set(mesh)
    return mesh


def shutdown(timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Wait for every rank (up to ``timeout``; a peer tearing gloo down under another can abort it), then
    destroy the process group; a no-op without one, and with a peer gone the group is left to the exit."""
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


def _close_at_exit(timeout: timedelta) -> None:
    """:func:`shutdown` at a clean exit; after an uncaught exception, exit at once (peers may be blocked)."""
    if getattr(sys, "last_value", None) is None:
        shutdown(timeout)


_BACKENDS = (None, "gloo", "nccl")


def exchange_ints(row: list[int], group: ProcessGroup | None = None,
                  device: torch.device | None = None) -> list[list[int]]:
    """Every rank's ``row`` (the same length on all), in rank order: one all-reduce of a zero matrix in which
    each rank fills its own row (nothing pickled). ``device``: the group's."""
    rows = torch.zeros(dist.get_world_size(group), len(row), dtype=torch.int64)
    rows[dist.get_rank(group)] = torch.tensor(row, dtype=torch.int64)
    everyone = rows.to(device)
    dist.all_reduce(everyone, group=group)
    return everyone.tolist()


def collective_device(group: ProcessGroup | None = None) -> torch.device | None:
    """The current CUDA device for an NCCL ``group`` (default: the world), else ``None`` (host memory)."""
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(group)) else None


def agree(row: list[int], what: str, describe: Callable[..., str]) -> None:
    """Compare ``row`` across the world (one small all-reduce); where the ranks differ every rank raises
    alike: "the ranks {what} (rank 0: {describe(*row_0)}; ...)"."""
    if dist.get_world_size() == 1:
        return
    everyone = exchange_ints(row, device=collective_device())
    if any(other != everyone[0] for other in everyone):
        views = "; ".join(f"rank {r}: {describe(*other)}" for r, other in enumerate(everyone))
        raise ValueError(f"the ranks {what} ({views})")


def _build_mesh(tp: int | None, dp: int | None, pp: int) -> Mesh:
    world = dist.get_world_size()
    if world % pp:
        raise ValueError(f"pp ({pp}) does not divide the world size ({world})")
    stage = world // pp  # ranks per pipeline stage
    where = f"the ranks of a pipeline stage ({stage} = {world} // pp ({pp}))" if pp > 1 else f"the world size ({world})"
    if dp is not None and stage % dp:
        raise ValueError(f"dp ({dp}) does not divide {where}")
    tp = tp or stage // (dp or 1)
    if stage % tp:
        raise ValueError(f"tp ({tp}) does not divide {where}")
    dp = dp or stage // tp
    if pp * dp * tp != world:
        shape = (f"pp ({pp}) x dp ({dp}) x tp ({tp}) = {pp * dp * tp}" if pp > 1
                 else f"tp ({tp}) x dp ({dp}) = {tp * dp}")
        raise ValueError(f"{shape} does not match the world size ({world})")
    device = collective_device() or torch.device("cpu")
    device_mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    return Mesh(
        device_mesh=device_mesh,
        tp_group=device_mesh.get_group("tp"),
        dp_group=device_mesh.get_group("dp"),
        pp_group=device_mesh.get_group("pp"),
        tp=tp, dp=dp, pp=pp, tp_rank=rank % tp, dp_rank=rank // tp % dp, pp_rank=rank // (tp * dp),
        rank=rank, world_size=world, device=device, rng=RNGStatesTracker(rank % tp),
    )


def current_mesh_or_none() -> Mesh | None:
    """The default mesh, or ``None`` when there is none."""
    return _current.get()


def current_mesh() -> Mesh:
    """The default mesh, or a clear error when ``init`` has not been called."""
    mesh = _current.get()
    if mesh is None:
        raise RuntimeError("no tensor-parallel mesh: call tensorpar.init(tp=...) first, "
                           "or pass group= explicitly")
    return mesh


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None) -> Iterator[Mesh | None]:
    """Make ``mesh`` the default inside the ``with`` block (``None``: no default)."""
    token = _current.set(mesh)
    try:
        yield mesh
    finally:
        _current.reset(token)


def manual_seed(seed: int, mesh: Mesh | None = None) -> None:
    """Seed torch's default generators (the same on every rank: replicated regions)
    and the mesh's tp streams (different on each tp rank: sharded regions)."""
    torch.manual_seed(seed)
    (mesh or current_mesh()).rng.seed(seed)


def tp_group(group: ProcessGroup | None = None) -> ProcessGroup:
    """``group`` itself, or the default mesh's tensor-parallel group when it is ``None``."""
    return current_mesh().tp_group if group is None else group


def group_rank_size(group: ProcessGroup) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size."""
    return dist.get_rank(group), dist.get_world_size(group)
