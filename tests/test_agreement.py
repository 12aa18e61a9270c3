"""Arguments that only some ranks can check are compared across ranks, so every rank raises together.

``init`` compares its arguments always (once per mesh). Collectives are compared by torch under
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (see ``tests/test_faults.py``); arguments every rank can check
(a bad ``dim``, a split that fits no rank's shard: ``tests/test_comm.py``) raise before any collective.
"""

import os
import subprocess
import sys

import torch
import torch.distributed as dist

import tensorpar


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
