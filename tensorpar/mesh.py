"""The (pp, dp, tp) process mesh and the default-mesh context.

Ranks are laid out row-major on a ``(pp, dp, tp)`` grid: tp groups are runs of ``tp`` consecutive ranks (one node
under torchrun), dp groups stride across them, pipeline stages are the outermost blocks of ``dp * tp`` ranks;
4 ranks at ``tp=2``: tp groups [0, 1], [2, 3]; dp groups [0, 2], [1, 3].
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .world import DEFAULT_TIMEOUT, agree, collective_device, join

__all__ = ["Mesh", "current_mesh", "current_mesh_or_none", "group_rank_size", "init", "tp_group", "use_mesh"]


@dataclass(frozen=True)
class Mesh:
    """A 3-D ``("pp", "dp", "tp")`` mesh over the world, with its groups, this rank's place and the sizes."""

    device_mesh: DeviceMesh = field(repr=False)
    tp_group: ProcessGroup = field(repr=False)
    dp_group: ProcessGroup = field(repr=False)
    pp_group: ProcessGroup = field(repr=False)
    tp: int
    dp: int
    pp: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    rank: int
    world_size: int
    device: torch.device


# The default mesh of modules built without a ``group``: scoped by ``use_mesh``, per thread.
_current: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("tensorpar_mesh", default=None)

_BACKENDS = (None, "gloo", "nccl")


def init(tp: int | None = None, dp: int | None = None, *, pp: int = 1, backend: str | None = None,
         timeout: timedelta = DEFAULT_TIMEOUT) -> Mesh:
    """Build the ``(pp, dp, tp)`` mesh over the world and make it the default.

    Initialises ``torch.distributed`` from torchrun's environment when it is not yet (a world of one
    without one; :func:`tensorpar.world.join`). ``pp`` defaults to 1, ``dp`` to ``world // (pp * tp)``,
    ``tp`` to ``world // (pp * dp)`` (a whole stage when neither is given). Every rank calls it with the
    same arguments (compared: ranks that differ all raise); one that raises leaves no group behind.
    E.g. ``init(tp=2)`` on 4 ranks: dp = 2; ``init(tp=2, pp=2)`` on 8: 2 stages of tp=2 x dp=2.
    """
    for name, value in (("tp", tp), ("dp", dp), ("pp", pp)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    created = not dist.is_initialized()
    if created:
        join(backend, timeout)
    elif backend is not None and backend not in dist.get_backend():
        raise ValueError(f"init(backend={backend!r}): the process group already exists with backend "
                         f"{dist.get_backend()!r}; destroy it first or leave backend out")
    try:
        agree([tp or 0, dp or 0, pp, _BACKENDS.index(backend) if backend in _BACKENDS else -1],
              "called tensorpar.init with different arguments", lambda t, d, p, b:
              f"tp={t or None}, dp={d or None}, pp={p}, backend={_BACKENDS[b] if b >= 0 else 'other'!r}")
        pp, dp, tp = _sizes(tp, dp, pp)  # ranks row-major on (pp, dp, tp)
        device = collective_device() or torch.device("cpu")
        grid = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        pp_rank, dp_rank, tp_rank = grid.get_coordinate() or (0, 0, 0)
        mesh = Mesh(grid, grid.get_group("tp"), grid.get_group("dp"), grid.get_group("pp"), tp, dp, pp,
                    tp_rank, dp_rank, pp_rank, dist.get_rank(), dist.get_world_size(), device)
    except BaseException:
        if created:  # leave nothing half-initialised
            dist.destroy_process_group()
        raise
    _current.set(mesh)
    if created:  # forgotten before the exit's shutdown, so that its groups end there (see world.join)
        atexit.register(_current.set, None)
    return mesh


def _sizes(tp: int | None, dp: int | None, pp: int) -> tuple[int, int, int]:
    """``(pp, dp, tp)`` with the missing sizes filled in, or a ``ValueError`` naming the numbers."""
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
    return pp, dp, tp


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


def tp_group(group: ProcessGroup | None = None) -> ProcessGroup:
    """``group`` itself, or the default mesh's tensor-parallel group when it is ``None``."""
    return current_mesh().tp_group if group is None else group


def group_rank_size(group: ProcessGroup) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size."""
    return dist.get_rank(group), dist.get_world_size(group)
