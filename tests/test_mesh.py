"""tensorpar.init: the (pp, dp, tp) mesh, its groups, defaults and misuse."""

import os
import re
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import tensorpar
from layers import ColumnParallelLinear


def check_mesh_2x2():
    mesh = tensorpar.init(tp=2, dp=2)
    rank = dist.get_rank()
    tp_sum, dp_sum = torch.tensor([float(rank)]), torch.tensor([float(rank)])
    dist.all_reduce(tp_sum, group=mesh.tp_group)
    dist.all_reduce(dp_sum, group=mesh.dp_group)
    dm = mesh.device_mesh
    return (mesh.tp, mesh.dp, mesh.tp_rank, mesh.dp_rank, mesh.rank, mesh.world_size, tp_sum.item(), dp_sum.item(),
            dm.mesh_dim_names, dm.mesh.tolist(), tensorpar.current_mesh() is mesh)


def test_init_builds_a_dp_by_tp_mesh_with_contiguous_tp_groups(worlds):
    results = worlds[4].run(check_mesh_2x2, mesh=False)
    for rank, (tp, dp, tp_rank, dp_rank, r, world, tp_sum, dp_sum, names, grid, is_default) in enumerate(results):
        assert (tp, dp, r, world) == (2, 2, rank, 4)
        assert (tp_rank, dp_rank) == (rank % 2, rank // 2)
        assert tp_sum == {0: 1, 1: 1, 2: 5, 3: 5}[rank]  # tp groups [0, 1] and [2, 3]
        assert dp_sum == {0: 2, 1: 4, 2: 2, 3: 4}[rank]  # dp groups [0, 2] and [1, 3]
        assert names == ("pp", "dp", "tp") and grid == [[[0, 1], [2, 3]]] and is_default


def check_mesh_3d(tp, dp, pp):
    mesh = tensorpar.init(tp=tp, dp=dp, pp=pp)
    sums = []
    for group in (mesh.tp_group, mesh.dp_group, mesh.pp_group):
        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total, group=group)
        sums.append(total.item())
    return (mesh.tp_rank, mesh.dp_rank, mesh.pp_rank), sums, mesh.device_mesh.mesh.tolist()


def test_pipeline_stages_are_the_outermost_dimension(worlds):
    # pp=2 x tp=2: stages {0, 1} and {2, 3}; each rank's twin in the other stage is its pp peer
    for rank, (ranks, (tp_sum, dp_sum, pp_sum), grid) in enumerate(worlds[4].run(check_mesh_3d, 2, 1, 2, mesh=False)):
        assert ranks == (rank % 2, 0, rank // 2) and grid == [[[0, 1]], [[2, 3]]]
        assert (tp_sum, dp_sum, pp_sum) == ({0: 1, 1: 1, 2: 5, 3: 5}[rank], rank, {0: 2, 1: 4, 2: 2, 3: 4}[rank])
    # pp=2 x dp=2 x tp=1: dp groups [0, 1] and [2, 3], pp groups [0, 2] and [1, 3]
    for rank, (ranks, (tp_sum, dp_sum, pp_sum), grid) in enumerate(worlds[4].run(check_mesh_3d, 1, 2, 2, mesh=False)):
        assert ranks == (0, rank % 2, rank // 2) and grid == [[[0], [1]], [[2], [3]]]
        assert (tp_sum, dp_sum, pp_sum) == (rank, {0: 1, 1: 1, 2: 5, 3: 5}[rank], {0: 2, 1: 4, 2: 2, 3: 4}[rank])


def check_defaults():
    meshes = (tensorpar.init(tp=2), tensorpar.init(dp=4), tensorpar.init(), tensorpar.init(pp=2),
              tensorpar.init(pp=2, dp=2), tensorpar.init(pp=4))
    return [(m.pp, m.dp, m.tp) for m in meshes]


def test_init_fills_in_the_missing_size(worlds):
    assert worlds[4].run(check_defaults, mesh=False)[0] == [(1, 2, 2), (1, 4, 1), (1, 1, 4), (2, 1, 2), (2, 2, 1),
                                                            (4, 1, 1)]


def check_init_errors():
    messages = []
    for kwargs in ({"tp": 3}, {"tp": 2, "dp": 1}, {"tp": 0}, {"dp": 2.5}, {"dp": 3}, {"pp": 3}, {"pp": 2, "tp": 4},
                   {"pp": 2, "dp": 3}, {"pp": 2, "tp": 1, "dp": 1}, {"pp": 0}):
        try:
            tensorpar.init(**kwargs)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_init_misuse_is_a_clear_error(worlds):
    messages = worlds[4].run(check_init_errors, mesh=False)[0]
    assert messages == [
        "tp (3) does not divide the world size (4)",
        "tp (2) x dp (1) = 2 does not match the world size (4)",
        "tp must be a positive integer, got 0",
        "dp must be a positive integer, got 2.5",
        "dp (3) does not divide the world size (4)",
        "pp (3) does not divide the world size (4)",
        "tp (4) does not divide the ranks of a pipeline stage (2 = 4 // pp (2))",
        "dp (3) does not divide the ranks of a pipeline stage (2 = 4 // pp (2))",
        "pp (2) x dp (1) x tp (1) = 2 does not match the world size (4)",
        "pp must be a positive integer, got 0",
    ]


def check_layer_without_init():
    try:
        ColumnParallelLinear(4, 4)
    except RuntimeError as e:
        return str(e)
    return None


def test_a_layer_built_before_init_says_to_call_init(worlds):
    message = worlds[2].run(check_layer_without_init, mesh=False)[0]
    assert message and "call tensorpar.init(tp=...) first" in message


def check_explicit_group_beats_the_default():
    world = tensorpar.init(tp=4)
    pairs = tensorpar.init(tp=2)  # now the default
    layer = ColumnParallelLinear(8, 8, group=world.tp_group)
    with tensorpar.use_mesh(world):
        inner = ColumnParallelLinear(8, 8).tp
    return layer.tp, ColumnParallelLinear(8, 8).tp, inner, tensorpar.current_mesh() is pairs


def test_group_argument_and_use_mesh_choose_the_group(worlds):
    assert worlds[4].run(check_explicit_group_beats_the_default, mesh=False)[0] == (4, 2, 4, True)


def _run(*command):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


SCRIPT = """
import os, torch, tensorpar
from layers import RowParallelLinear
mesh = tensorpar.init(tp=int(os.environ.get("WORLD_SIZE", 1)))
layer = RowParallelLinear(6, 3)
y = layer(torch.ones(2, layer.local_features))
print(f"rank={mesh.rank} tp={mesh.tp} dp={mesh.dp} shape={tuple(y.shape)}")
"""


def test_init_without_a_process_group_makes_a_world_of_one():
    assert _run(sys.executable, "-c", SCRIPT).strip() == "rank=0 tp=1 dp=1 shape=(2, 3)"


EXIT = """
import atexit, os
def gloo_threads():  # torch names the worker threads of a gloo group
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return names.count("pt_gloo_runloop")
atexit.register(lambda: print(gloo_threads()))  # registered first, so it runs after tensorpar's exit handlers
import torch, tensorpar
tensorpar.init()
print(gloo_threads())
"""


def test_a_world_of_one_ends_its_groups_threads_in_the_exit_handlers():
    """Gloo's worker threads are joined at a clean exit before the interpreter's teardown, where a thread
    reaching for the interpreter can abort the process ("terminate called without an active exception")."""
    running, at_exit = map(int, _run(sys.executable, "-c", EXIT).split())
    assert running > 0 and at_exit == 0, (running, at_exit)


def test_init_reads_torchrun_environment(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = _run(torchrun, "--standalone", "--nproc-per-node=2", str(script))
    # the two ranks share one stdout, so their lines may run together
    assert sorted(re.findall(r"rank=\d tp=\d dp=\d shape=\(2, 3\)", out)) == [
        f"rank={r} tp=2 dp=1 shape=(2, 3)" for r in (0, 1)]


CRASH = """
import torch, tensorpar
mesh = tensorpar.init(tp=2)
if mesh.rank == 1:
    raise SystemError("rank 1 gives up")
tensorpar.reduce_from_tp(torch.ones(3))  # rank 0 waits for rank 1, which has gone
"""


def test_a_crashing_rank_ends_a_torchrun_job_promptly(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    start = time.monotonic()
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", str(script)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "rank 1 gives up" in done.stderr
    assert time.monotonic() - start < 60  # not the 10-minute collective timeout
