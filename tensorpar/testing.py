"""Testing tensor-parallel code in real processes: a persistent worker pool,
hypothesis strategies, and comparisons against unsharded twins.

Draw examples with hypothesis in the test process and send each example to
every rank of a :class:`World`; never run ``@given`` inside the ranks (their
draws would diverge and their collectives deadlock). A function sent to a
world must be importable (defined at module level).

Example (a pytest test)::

    WORLDS = tensorpar.testing.Worlds()          # one pool per world size, started on first use

    def check(n, seed):                          # runs on every rank, default mesh tp = world size
        torch.manual_seed(seed)
        dense = torch.nn.Linear(n, 3 * n)
        return assert_sharded_equivalent(ColumnParallelLinear.from_linear(dense), dense,
                                         torch.randn(4, n), output_shard=Shard(-1, 3 * n))

    @given(tp=tp_sizes(), n=st.integers(4, 64), seed=st.integers(0, 2**31))
    def test_column(tp, n, seed):
        WORLDS[tp].run(check, n, seed)
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import nn
from torch.distributed import ProcessGroup

from .collectives import unshard
from .launch import RankError, collect_replies, error_payload, host_store, join_group
from .mesh import Mesh, current_mesh, group_rank_size, init, shutdown, use_mesh
from .sharding import Shard, shard
from .state import full_grads

#: Norm-wise relative tolerances of a sharded result against its dense twin.
TOLERANCES: dict[torch.dtype, float] = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}


# ---------------------------------------------------------------- worker pool

def _serve(rank: int, size: int, port: int, timeout: timedelta, path: list[str],
           conn: multiprocessing.connection.Connection) -> None:
    """A pool worker: join the group, then run tasks until told to stop."""
    sys.path[:] = path
    try:
        join_group(rank, size, port, "gloo", timeout)
        torch.set_num_threads(1)
        conn.send_bytes(pickle.dumps((True, None)))
    except BaseException as e:  # noqa: BLE001
        conn.send_bytes(pickle.dumps((False, error_payload(e))))
        return
    meshes: dict[tuple[int, int], Mesh] = {}
    while True:
        kind, payload = pickle.loads(conn.recv_bytes())
        if kind == "stop":
            break
        if kind == "path":
            sys.path[:] = payload
            continue
        fn, args, tp, dp, with_mesh = payload
        try:
            mesh = None
            if with_mesh:
                mesh = meshes.get((tp, dp)) or meshes.setdefault((tp, dp), init(tp, dp))
            with use_mesh(mesh):
                reply = (True, fn(*args))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            reply = (False, error_payload(e))
        conn.send_bytes(pickle.dumps(reply))
    shutdown(timedelta(seconds=10))


class World:
    """``size`` worker processes joined in one gloo group, started once and reused.

    ``run(fn, *args)`` calls ``fn(*args)`` on every rank with a default mesh
    (``tp`` = the world size unless given) and returns the per-rank results. A
    rank that raises fails the call with :class:`tensorpar.RankError` naming it
    and its traceback; if other ranks do not answer within ``grace`` seconds
    (blocked in a collective the failed rank never joined), or the call takes
    longer than ``timeout`` seconds, the pool is killed, restarted on next use,
    and the call raises.
    """

    def __init__(self, size: int, *, timeout: float = 60.0, grace: float = 3.0, startup: float = 120.0) -> None:
        self.size, self.timeout, self.grace, self.startup = size, timeout, grace, startup
        self.runs = 0
        self._procs: list[Any] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._path: list[str] = []
        self._store: dist.TCPStore | None = None
        self._broken: str | None = None

    def _start(self) -> None:
        if self._broken:  # do not pay the start-up timeout again for every example
            raise RuntimeError(self._broken)
        ctx = multiprocessing.get_context("spawn")
        self._store = host_store()  # must outlive the workers' joining
        self._path = list(sys.path)
        collective_timeout = timedelta(seconds=self.timeout + 30)
        for rank in range(self.size):
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(rank, self.size, self._store.port, collective_timeout, self._path,
                                                 child_end), daemon=True)
            p.start()
            child_end.close()
            self._procs.append(p)
            self._conns.append(parent_end)
        try:
            self._collect("start-up", self.startup)
        except (RankError, TimeoutError) as e:
            self._kill()
            self._broken = f"the pool of {self.size} workers failed to start: {e}"
            raise RuntimeError(self._broken) from e

    def close(self) -> None:
        """Stop the workers (killing any that do not stop at once)."""
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(("stop", None)))
            except OSError:
                pass
        for p in self._procs:
            p.join(15)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs, self._conns, self._store = [], [], None

    def _kill(self) -> None:
        for p in self._procs:
            p.kill()
            p.join()
        self._procs, self._conns, self._store = [], [], None

    def _send(self, message: tuple[str, Any]) -> None:
        blob = pickle.dumps(message)
        for conn in self._conns:
            conn.send_bytes(blob)

    def run(self, fn: Callable[..., Any], *args: Any, tp: int | None = None, dp: int | None = None,
            mesh: bool = True, timeout: float | None = None) -> list[Any]:
        """``fn(*args)`` on every rank; the per-rank results, in rank order.

        ``mesh=False`` runs with no default mesh (to test code that needs one).
        """
        if not self._procs:
            self._start()
        if sys.path != self._path:
            self._path = list(sys.path)
            self._send(("path", self._path))
        self.runs += 1
        self._send(("run", (fn, args, tp or self.size, dp, mesh)))
        return self._collect(getattr(fn, "__name__", repr(fn)), self.timeout if timeout is None else timeout)

    def _collect(self, name: str, timeout: float) -> list[Any]:
        replies = collect_replies(self._procs, self._conns, timeout, self.grace)
        if replies.silent or replies.dead:  # some rank is stuck or gone: the group is unusable
            self._kill()
        replies.raise_first_error(f"pool worker running {name}")
        if replies.silent:
            raise TimeoutError(f"{name} did not finish within {timeout} s on ranks {replies.silent} of a world "
                               f"of {self.size}; the pool was killed and will restart")
        return [replies.results[r] for r in range(self.size)]


class Worlds(Mapping[int, World]):
    """One :class:`World` per size, each started on first use: ``worlds[2].run(fn, ...)``."""

    def __init__(self, sizes: Sequence[int] = (1, 2, 3, 4), **options: Any) -> None:
        self._worlds = {n: World(n, **options) for n in sizes}

    def __getitem__(self, size: int) -> World:
        return self._worlds[size]

    def __iter__(self) -> Any:
        return iter(self._worlds)

    def __len__(self) -> int:
        return len(self._worlds)

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()


# ---------------------------------------------------------------- strategies

def tp_sizes(max_tp: int = 4) -> st.SearchStrategy[int]:
    """Tensor-parallel sizes 1..``max_tp``, shrinking towards 1."""
    return st.integers(1, max_tp)


def features(tp: int, max_value: int = 64, *, multiple_of: int = 1) -> st.SearchStrategy[int]:
    """Feature counts at least ``tp`` (units of ``multiple_of``), divisible by ``tp`` or not."""
    return st.integers(tp, max(tp, max_value // multiple_of)).map(lambda n: n * multiple_of)


def batch_shapes(max_dims: int = 2, max_side: int = 5) -> st.SearchStrategy[tuple[int, ...]]:
    """Leading batch dims for a linear layer, including none at all."""
    return st.lists(st.integers(1, max_side), max_size=max_dims).map(tuple)


def dtypes() -> st.SearchStrategy[torch.dtype]:
    return st.sampled_from([torch.float64, torch.float32, torch.bfloat16])


# ---------------------------------------------------------------- comparisons

def rel_error(actual: torch.Tensor, expected: torch.Tensor, scale: float = 0.0) -> float:
    """``‖actual − expected‖ / max(‖expected‖, scale)`` in float64 (absolute when both are zero).

    ``scale`` is for values whose true size is zero or near it, where any
    round-off is a large fraction of the value: e.g. one gradient measured
    against the norm of the whole model's gradient.
    """
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.shape != e.shape:
        raise AssertionError(f"shape {tuple(a.shape)} does not match the expected {tuple(e.shape)}")
    norm = max(e.norm().item(), scale)
    return (a - e).norm().item() / (norm if norm > 0 else 1.0)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float | None = None, name: str = "",
                 scale: float = 0.0) -> float:
    """Raise unless the norm-wise relative error (see :func:`rel_error`) is within ``rtol``
    (default: by dtype); return it."""
    rtol = TOLERANCES[expected.dtype] if rtol is None else rtol
    err = rel_error(actual, expected, scale)
    if not err <= rtol:
        raise AssertionError(f"{name or 'tensor'}: relative error {err:.3g} exceeds {rtol:.1g} ({expected.dtype})")
    return err


def assert_sharded_equivalent(sharded: nn.Module, dense: nn.Module, x: torch.Tensor, *,
                              input_shard: Shard | None = None, output_shard: Shard | None = None,
                              rtol: float | None = None, seed: int = 0,
                              group: ProcessGroup | None = None) -> dict[str, float]:
    """Check a sharded module against its dense twin; return the relative error of each quantity.

    ``x`` is the full input, the same on every rank. The sharded module gets
    this rank's slice of it when ``input_shard`` is given, and its output is
    gathered along ``output_shard`` when given. Compared: the output, the
    input gradient, and every parameter gradient (gathered to full size; keys
    must match the dense module's parameter names) after backward of the same
    random output gradient. Norm-wise relative errors, each parameter gradient
    against the larger of its own norm and the whole gradient's (see
    :func:`rel_error`). All collectives run before any comparison, so a
    mismatch fails every rank alike instead of hanging the others.
    """
    group = current_mesh().tp_group if group is None else group
    rank, n = group_rank_size(group)
    x_dense = x.detach().clone().requires_grad_()
    x_full = x.detach().clone().requires_grad_()
    y_dense = dense(x_dense)
    y = sharded(shard(x_full, input_shard, n, rank) if input_shard else x_full)
    g = torch.randn(y_dense.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g = g.to(y_dense.dtype).to(y_dense.device)
    y_dense.backward(g)
    y.backward(shard(g, output_shard, n, rank) if output_shard else g)

    y_full = unshard(y, output_shard, group) if output_shard else y.detach()
    dx = x_full.grad
    if input_shard:  # each rank holds the gradient of its own slice only
        dx = unshard(shard(dx, input_shard, n, rank), input_shard, group)
    grads = full_grads(sharded)
    dense_grads = {k: p.grad for k, p in dense.named_parameters() if p.grad is not None}

    if set(grads) != set(dense_grads):
        raise AssertionError(f"sharded gradients {sorted(grads)} do not match the dense {sorted(dense_grads)}")
    # a parameter gradient is measured against the whole gradient's norm when that is larger: some
    # are zero in exact arithmetic (a key bias shifts a whole softmax row) and hold only round-off
    scale = torch.cat([g.detach().double().flatten().cpu() for g in dense_grads.values()]).norm().item() \
        if dense_grads else 0.0
    pairs = {"output": (y_full, y_dense), "input grad": (dx, x_dense.grad)}
    pairs.update({f"grad {k}": (grads[k], dense_grads[k], scale) for k in sorted(dense_grads)})
    return assert_all_close(pairs, rtol=rtol, what=f"sharded module differs from its dense twin at tp={n}")


def assert_all_close(pairs: Mapping[str, tuple[Any, ...]], *, rtol: float | None = None,
                     what: str = "results differ") -> dict[str, float]:
    """:func:`assert_close` on every ``name: (actual, expected[, scale])``; one error listing
    every failure, else the relative errors by name. Call it after the last collective, so that
    a mismatch fails every rank alike instead of leaving the others waiting."""
    errors, failures = {}, []
    for name, (actual, expected, *scale) in pairs.items():
        try:
            errors[name] = assert_close(actual, expected, rtol=rtol, name=name, scale=scale[0] if scale else 0.0)
        except AssertionError as e:
            failures.append(str(e))
    if failures:
        raise AssertionError(f"{what}:\n  " + "\n  ".join(failures))
    return errors
