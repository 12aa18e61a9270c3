"""Arguments that only some ranks can check are compared across ranks, so every rank raises together.

``init`` compares its arguments always (once per mesh). Collectives compare
theirs under the debugging switch (``TENSORPAR_CHECK_COLLECTIVES=1``, or
``TORCH_DISTRIBUTED_DEBUG=DETAIL``); without it a rank that finds its own
arguments wrong raises alone.
"""

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import tensorpar
from tensorpar.comm import checks
from tensorpar.comm.collectives import start_all_reduce_


def _error(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def init_with_rank_dependent_tp():
    return _error(lambda: tensorpar.init(tp=(2, 1)[dist.get_rank()]))


def test_ranks_that_call_init_differently_all_raise(worlds):
    errors = worlds[2].run(init_with_rank_dependent_tp, mesh=False)
    assert errors[0] == errors[1] == (
        "ValueError: the ranks called tensorpar.init with different arguments "
        "(rank 0: tp=2, dp=None, pp=1, backend=None; rank 1: tp=1, dp=None, pp=1, backend=None)")


def init_with_another_backend():
    return [_error(lambda: tensorpar.init(tp=2, backend="nccl")), _error(lambda: tensorpar.init(tp=True))]


def test_init_refuses_a_backend_other_than_the_groups_and_a_bool_size(worlds):
    backend, flag = worlds[2].run(init_with_another_backend, mesh=False)[0]
    assert backend == ("ValueError: init(backend='nccl'): the process group already exists with backend "
                       "'gloo'; destroy it first or leave backend out")
    assert flag == "ValueError: tp must be a positive integer, got True"


FAILED_INIT = """
import torch.distributed as dist, tensorpar
try:
    tensorpar.init(tp=2)
except ValueError as e:
    print(f"refused: {e}")
print(f"initialised after the failure: {dist.is_initialized()}")
mesh = tensorpar.init(tp=1)
print(f"then: tp={mesh.tp} world={mesh.world_size}")
"""


def test_a_failed_init_leaves_no_process_group_behind():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", FAILED_INIT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["refused: tp (2) does not divide the world size (1)",
                                        "initialised after the failure: False", "then: tp=1 world=1"]


@contextlib.contextmanager
def _env(**values):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def gather_with_a_wrong_size_on_rank_zero(switch):
    mesh = tensorpar.current_mesh()
    size = 7 if mesh.tp_rank == 0 else 6  # rank 0 alone believes the full size is 7
    local = torch.ones(2, 3)  # 6 split over 2 ranks: 3 each
    with _env(**switch):
        gather = _error(lambda: tensorpar.gather_from_tp(local, -1, size))
        with tensorpar.use_mesh(None):  # no shared memory: gloo's own all-reduce, which would abort
            numel = (4, 8)[mesh.tp_rank]
            reduce = _error(lambda: start_all_reduce_(torch.ones(numel), mesh.tp_group).wait())
    return gather, reduce


@pytest.mark.parametrize("switch", [{"TENSORPAR_CHECK_COLLECTIVES": "1"}, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}])
def test_with_checks_on_every_rank_raises_when_one_rank_finds_a_collective_wrong(worlds, switch):
    (gather0, reduce0), (gather1, reduce1) = worlds[2].run(gather_with_a_wrong_size_on_rank_zero, switch)
    assert gather0 == gather1 and gather0.startswith("ValueError: all-gather: the ranks' calls do not match")
    assert "rank 0: sizes[0]=4, sizes[1]=3" in gather0.replace("dtype=float32, before=2, along=0, after=1, ", "")
    assert "rank 0: all-gather along dim -1: rank 0 of 2 holds 3 elements there but the split is [4, 3]" in gather0
    assert reduce0 == reduce1 == ("ValueError: all-reduce: the ranks' calls do not match (rank 0: numel=4, "
                                  "dtype=float32, op=sum; rank 1: numel=8, dtype=float32, op=sum)")


def test_the_checks_are_off_unless_asked_for():
    with _env(TENSORPAR_CHECK_COLLECTIVES="0", TORCH_DISTRIBUTED_DEBUG="INFO"):
        assert not checks.enabled()
    with _env(TENSORPAR_CHECK_COLLECTIVES="1"):
        assert checks.enabled()


def functional_linears_with_bad_arguments():
    w = torch.ones(3, 4)
    cases = [lambda: tensorpar.column_parallel_linear([1.0] * 4, w),
             lambda: tensorpar.row_parallel_linear(torch.ones(2, 4, dtype=torch.int64), w),
             lambda: tensorpar.column_parallel_linear(torch.ones(2, 5), w),
             lambda: tensorpar.row_parallel_linear(torch.ones(2, 4), w, bias="b")]
    return [_error(case) for case in cases]


def test_the_functional_linears_reject_bad_arguments_on_every_rank(worlds):
    first, second = worlds[2].run(functional_linears_with_bad_arguments)
    assert first == second == [
        "TypeError: column_parallel_linear: x must be a tensor, got list",
        "TypeError: row_parallel_linear: x dtype torch.int64 is not a floating-point dtype",
        "ValueError: column_parallel_linear: input of shape (2, 5) does not fit a weight of shape (3, 4) "
        "(its last dim must equal the weight's second)",
        "TypeError: row_parallel_linear: bias must be a tensor, got str"]
