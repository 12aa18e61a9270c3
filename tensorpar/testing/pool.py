"""Persistent pools of ranks for tests: start a world once (the ranks of :func:`tensorpar.spawn`), send it
many examples, each a few milliseconds instead of the ~1 s of starting processes."""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from ..bitwise.settings import Bitwise, use_bitwise
from ..mesh import Mesh, init, use_mesh
from .ranks import LocalRanks, RankError
from .sendable import Packed, call, pack


class _Tasks:
    """What a pool rank runs for each task: the function and its arguments under the mesh they ask for (kept
    for the next task of that layout: each init creates process groups) and the bitwise mode they ask for."""

    def __init__(self) -> None:
        self.meshes: dict[tuple[int, int | None, int], Mesh] = {}

    def __call__(self, task: tuple[Packed, list[str], int, int | None, int, bool, Bitwise | None]) -> Any:
        packed, path, tp, dp, pp, with_mesh, bitwise = task
        sys.path[:] = path  # the test process's of now
        mesh = None
        if with_mesh:
            mesh = self.meshes.get((tp, dp, pp)) or self.meshes.setdefault((tp, dp, pp), init(tp, dp, pp=pp))
            if bitwise is not None:
                bitwise.check_tp(tp)  # the pool's ranks run one thread each already
        with use_mesh(mesh), use_bitwise(bitwise if with_mesh else None):
            return call(packed)


class World:
    """``size`` worker processes joined in one gloo group, started once and reused. A rank that raises
    fails :meth:`run` with :class:`tensorpar.RankError` naming it, with its traceback; if other ranks do not
    answer within ``grace`` seconds (blocked in a collective the failed rank never joined), or the call
    takes longer than ``timeout`` seconds, the pool is killed, restarted on next use, and the call raises."""

    def __init__(self, size: int, *, timeout: float = 60.0, grace: float = 3.0, startup: float = 120.0) -> None:
        self.size, self.timeout, self.grace, self.startup = size, timeout, grace, startup
        self.runs = 0
        self._ranks: LocalRanks | None = None
        self._broken: str | None = None

    def _start(self) -> LocalRanks:
        if self._broken:  # do not pay the start-up timeout again for every example
            raise RuntimeError(self._broken)
        ranks = LocalRanks(_Tasks(), self.size, backend="gloo", threads=1,
                           collective_timeout=timedelta(seconds=self.timeout + 30))
        try:
            ranks.collect("pool worker starting", self.startup)
        except (RankError, TimeoutError) as e:
            ranks.kill()
            self._broken = f"the pool of {self.size} workers failed to start: {e}"
            raise RuntimeError(self._broken) from e
        return ranks

    def run(self, fn: Callable[..., Any], *args: Any, tp: int | None = None, dp: int | None = None, pp: int = 1,
            mesh: bool = True, timeout: float | None = None, bitwise: bool | Bitwise = False) -> list[Any]:
        """``fn(*args)`` on every rank; the per-rank results, in rank order.

        The default mesh is ``tensorpar.init(tp, dp, pp=pp)`` (``tp``: every rank of a pipeline stage unless
        given), with ``bitwise`` the mode modules are built in (``tensorpar.bitwise.use_bitwise(bitwise)``);
        ``mesh=False`` runs with no default mesh and the mode off (to test code that needs one).
        """
        packed = pack(fn, args, caller="World.run")  # before any worker starts
        if self._ranks is None:
            self._ranks = self._start()
        ranks = self._ranks
        self.runs += 1
        ranks.send((packed, sys.path, tp or self.size // pp, dp, pp, mesh, Bitwise.of(bitwise)))
        name = getattr(fn, "__name__", repr(fn))
        try:
            return ranks.collect(f"pool worker running {name}", self.timeout if timeout is None else timeout,
                                 self.grace)
        except TimeoutError as e:
            raise TimeoutError(f"{e.args[0]}; the pool was killed and will restart") from None
        finally:
            if not all(p.is_alive() for p in ranks.procs):  # collect killed a stuck or broken group
                self._ranks = None

    def _stop(self) -> None:
        if self._ranks is not None:
            self._ranks.send(None)

    def close(self) -> None:
        """Stop the workers (killing any that do not stop in time)."""
        self._stop()
        if self._ranks is not None:
            self._ranks.kill(15)
            self._ranks = None


class Worlds(dict[int, World]):
    """One :class:`World` per size, each started on first use: ``worlds[2].run(fn, ...)``."""

    def __init__(self, sizes: Sequence[int] = (1, 2, 3, 4), **options: Any) -> None:
        super().__init__((n, World(n, **options)) for n in sizes)

    def close(self) -> None:
        for world in self.values():
            world._stop()  # all worlds stop at once
        for world in self.values():
            world.close()


def run_script(path: str | os.PathLike[str], *argv: str) -> None:
    """Run a Python script in this process as ``python path *argv`` would: as ``__main__``, with
    ``sys.argv`` set and the script's folder first on ``sys.path`` (both restored afterwards). On every
    rank of a :class:`World` this runs a training script as ``torchrun`` does, e.g.
    ``WORLDS[4].run(run_script, "examples/train_gpt.py", "--tp=2")``."""
    path = os.fspath(path)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv[:] = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path
