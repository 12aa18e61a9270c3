"""Faults end every rank with a clear error within the timeout and leave nothing behind.

Each fault is real: a launcher killed by a signal, a rank stopped with SIGSTOP,
a rank that exits while a shared segment is being set up, ranks that pass
different tensors to one all-reduce. Each test bounds its own waiting with
short timeouts, measures the time to the error, and checks that no process
and no ``/dev/shm`` entry is left.
"""

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import weakref
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tensorpar
import tensorpar.checkpoint
from tensorpar.comm import shm
from tensorpar.comm.collectives import CollectiveError, all_gather_along, reduce_scatter_along, start_all_reduce_

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def _running(pids: list[int]) -> list[int]:
    """Those of ``pids`` that are still processes (a zombie has ended: it only awaits its reaper)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in "ZX":
            alive.append(pid)
    return alive


def _wait_gone(pids: list[int], limit: float) -> float:
    start = time.monotonic()
    while _running(pids) and time.monotonic() - start < limit:
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture
def no_leftover_segments():
    before = set(os.listdir("/dev/shm"))
    yield
    assert set(os.listdir("/dev/shm")) - before == set(), "a shared-memory segment was left in /dev/shm"


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


# ---------------------------------------------------------------- the launcher dies

def _kill_launcher(cmd, cwd, ready, written, sig=signal.SIGKILL):
    """Start the launcher ``cmd``, wait until ``ready()``, then kill it with ``sig``: every process it
    started must be gone within 10 s, and ``written()`` (what the ranks write) unchanged after that.
    Returns the seconds from the signal until the last rank was gone."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-3000:]
            time.sleep(0.05)
        ranks = _descendants(proc.pid)
        assert len(_running(ranks)) >= 2
        os.kill(proc.pid, sig)
        took = _wait_gone(ranks, 10)
        assert not _running(ranks), f"processes {_running(ranks)} outlived their launcher (killed by {sig.name})"
        seen = written()
        time.sleep(1.0)  # nothing is written after the ranks are gone
        assert written() == seen
        return took
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_ranks_stop_when_the_training_launcher_is_killed(tmp_path, sig, no_leftover_segments):
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--tp=2", "--steps=100000", f"--out={out}",
           "--ckpt-every=3", "--no-progress", "--n-layer=1", "--n-embd=16", "--n-head=2", "--block-size=8",
           "--batch-size=2", "--sample-tokens=0"]
    took = _kill_launcher(cmd, tmp_path, lambda: _lines(out / "metrics.jsonl") >= 4 and (out / "latest").exists(),
                          lambda: (_lines(out / "metrics.jsonl"), (out / "latest").read_text(),
                                   sorted(p.name for p in out.iterdir())), sig)
    assert tensorpar.checkpoint.read_meta(out)["step"] >= 2  # the last checkpoint is whole: nothing lost
    from examples.train.rundir import check_out  # here: this module is also imported where only tests/ is importable

    check_out(out, resume="must", overwrite=False)  # the killed job's lock on --out went with it
    print(f"train_gpt.py launcher killed by {sig.name}: every rank gone after {took:.2f} s")


_POOL = """
import sys
from tensorpar.testing import World
import test_faults
World(2).run(test_faults.write_forever, sys.argv[1], timeout=600)
"""

_TORCHRUN = """
import os, sys, time, tensorpar
tensorpar.init(tp=2)
while True:
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()} {time.time()}\\n")
    time.sleep(0.01)
"""


def write_forever(path):
    while True:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {time.time()}\n")
        time.sleep(0.01)


@pytest.mark.parametrize("launcher", ["pool", "torchrun"])
def test_ranks_stop_when_a_pool_or_torchrun_launcher_is_killed(tmp_path, launcher, no_leftover_segments):
    log = tmp_path / "log"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = {"pool": [sys.executable, "-c", _POOL, str(log)],
           "torchrun": [torchrun, "--standalone", "--nproc-per-node=2", str(tmp_path / "job.py"), str(log)]}[launcher]
    (tmp_path / "job.py").write_text(_TORCHRUN)
    took = _kill_launcher(cmd, TESTS if launcher == "pool" else tmp_path,
                          lambda: log.exists() and len({line.split()[0] for line in log.read_text().splitlines()}) == 2,
                          lambda: _lines(log))
    print(f"{launcher} launcher killed by SIGKILL: every rank gone after {took:.2f} s")


# ---------------------------------------------------------------- ranks that disagree

def _fresh_channels(mesh):
    """The same mesh with channels of its own: a test that breaks one leaves the pool's intact."""
    return dataclasses.replace(mesh, channels=weakref.WeakKeyDictionary())


def disagreeing_all_reduce(case):
    mesh = _fresh_channels(tensorpar.current_mesh())
    rank = mesh.tp_rank
    numel, dtype, op = {
        "count": ((4, 8)[rank], torch.float32, "sum"),
        "dtype": (4, (torch.float32, torch.float64)[rank], "sum"),
        "op": (4, torch.float32, ("sum", "max")[rank]),
        "capacity": ((256, 600_000)[rank], torch.float32, "sum"),  # rank 1 past 1 MiB
    }[case]
    with tensorpar.use_mesh(mesh):
        start_all_reduce_(torch.ones(2), mesh.tp_group).wait()  # the channel is open and working
        began = time.monotonic()
        try:
            start_all_reduce_(torch.full((numel,), 100.0 + rank, dtype=dtype), mesh.tp_group, op=op).wait()
        except CollectiveError as e:
            error = f"{e} [after {time.monotonic() - began:.4f} s]"
        else:
            error = None
        # the channel is closed on every rank alike: what follows goes through gloo, correctly
        after = start_all_reduce_(torch.full((3,), float(rank + 1)), mesh.tp_group).wait()
    return error, after.tolist(), mesh.channels[mesh.tp_group].broken


@pytest.mark.parametrize("case", ["count", "dtype", "op", "capacity"])
def test_ranks_that_disagree_on_a_shared_memory_all_reduce_all_raise_the_same_error(worlds, case):
    results = worlds[2].run(disagreeing_all_reduce, case)
    assert all(error is not None for error, _, _ in results), f"a rank returned without error: {results}"
    errors, times = zip(*(error.rsplit(" [after ", 1) for error, _, _ in results), strict=True)
    assert errors[0].startswith("rank 0: ") and errors[1].startswith("rank 1: ")
    # each names its own call, then the same words on every rank
    assert errors[0].split(" failed: ", 1)[1] == errors[1].split(" failed: ", 1)[1]
    assert "the ranks disagree on all-reduce" in errors[0]
    expected = {"count": ["4 float32", "8 float32"], "dtype": ["float32", "float64"],
                "op": ["(sum)", "(max)"], "capacity": ["256 float32", "600000 float32"]}[case]
    assert all(word in errors[0] for word in expected), errors[0]
    assert all(after == [3.0, 3.0, 3.0] and broken for _, after, broken in results)
    print(f"shared-memory all-reduce, ranks disagree on {case}: "
          + ", ".join(t.rstrip("]") for t in times) + " to the error on ranks 0, 1")


def matching_all_reduces(sizes, seed):
    mesh = _fresh_channels(tensorpar.current_mesh())
    g = torch.Generator().manual_seed(seed + mesh.tp_rank)
    out = []
    with tensorpar.use_mesh(mesh):
        for numel in sizes:  # growth past the first capacity is agreed by every rank
            x = torch.randn(numel, generator=g, dtype=torch.float64)
            out.append((x.clone(), start_all_reduce_(x, mesh.tp_group).wait()))
    return out, mesh.channels[mesh.tp_group].capacity


def test_a_shared_memory_channel_grows_together_and_stays_exact(worlds):
    sizes = [5, 300_000, 7, 1_000_000]  # doubles: 2.4 MB and 8 MB per rank, past the first 1 MiB
    results = worlds[2].run(matching_all_reduces, sizes, 3)
    for i in range(len(sizes)):
        expected = results[0][0][i][0] + results[1][0][i][0]
        for out, _ in results:
            assert torch.equal(out[i][1], expected)
    assert results[0][1] == results[1][1] >= 8_000_000


def disagreeing_after_a_failure():
    """The shared-memory channel fails (the ranks disagree on the op), then the ranks disagree again,
    on gloo: on the op, on the kind of call, on the call itself."""
    mesh = _fresh_channels(tensorpar.current_mesh())
    rank, group = mesh.tp_rank, mesh.tp_group
    errors = []
    with tensorpar.use_mesh(mesh):
        start_all_reduce_(torch.ones(2), group).wait()
        with pytest.raises(CollectiveError):
            start_all_reduce_(torch.ones(4), group, op=("sum", "max")[rank]).wait()
        assert mesh.channels[group].broken
        calls = [lambda: start_all_reduce_(torch.full((3,), 100.0 + rank), group, op=("sum", "max")[rank]).wait(),
                 lambda: (all_gather_along, reduce_scatter_along)[rank](torch.ones(2, 4), 0, [(2, 2), (1, 1)][rank],
                                                                        group),
                 lambda: start_all_reduce_(torch.ones(8), group).wait() if rank == 0
                 else all_gather_along(torch.ones(2, 2), 0, [2, 2], group)]
        for call in calls:
            try:
                call()
            except ValueError as e:
                errors.append(str(e))
            else:
                errors.append(None)
        after = start_all_reduce_(torch.full((3,), float(rank + 1)), group).wait()  # agreeing calls still work
    return errors, after.tolist()


def test_after_a_shared_memory_failure_every_later_disagreement_is_still_an_error(worlds):
    (errors0, after0), (errors1, after1) = worlds[2].run(disagreeing_after_a_failure)
    assert after0 == after1 == [3.0, 3.0, 3.0]
    assert errors0[0] == errors1[0] == ("all-reduce: the ranks' calls do not match (rank 0: numel=3, dtype=float32, "
                                        "op=sum; rank 1: numel=3, dtype=float32, op=max)")
    assert errors0[1].startswith("all-gather: the ranks' calls do not match (")
    assert "rank 1: reduce-scatter" in errors0[1]
    assert errors1[1].startswith("reduce-scatter: the ranks' calls do not match (")
    assert "rank 0: all-gather" in errors1[1]
    assert "rank 1: all-gather" in errors0[2] and "rank 0: all-reduce" in errors1[2]


# ---------------------------------------------------------------- a peer stops or dies

def stop_one_rank():
    mesh = tensorpar.init(tp=2)
    pids = torch.zeros(2, dtype=torch.int64)
    pids[mesh.rank] = os.getpid()
    dist.all_reduce(pids)
    start_all_reduce_(torch.ones(4), mesh.tp_group).wait()  # the shared-memory channel is open
    if mesh.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return "resumed"
    time.sleep(0.2)  # rank 1 is stopped now
    began, cpu = time.monotonic(), time.process_time()
    try:
        start_all_reduce_(torch.ones(4), mesh.tp_group).wait()
    except CollectiveError as e:
        error = str(e)
    else:
        error = None
    waited, busy = time.monotonic() - began, time.process_time() - cpu
    os.kill(int(pids[1]), signal.SIGCONT)  # rank 1 may finish now
    return error, waited, busy


def test_a_stopped_peer_is_reported_within_the_group_timeout_without_spinning(no_leftover_segments):
    (error, waited, busy), resumed = tensorpar.spawn(stop_one_rank, 2, collective_timeout=timedelta(seconds=2),
                                                     timeout=60)
    assert resumed == "resumed"
    assert error is not None and error.startswith("rank 0: ")
    assert "past the group's timeout of 2 s" in error and "rank 1 (pid" in error and "is stopped" in error
    assert 2.0 <= waited < 4.0, f"the stopped peer was reported after {waited:.2f} s (timeout 2 s)"
    assert busy < 0.3 * waited, f"the waiting rank used {busy:.2f} s of CPU in {waited:.2f} s"
    print(f"stopped peer: reported after {waited:.2f} s, waiting rank used {busy / waited:.0%} of a core")


def exit_while_the_channel_opens():
    mesh = tensorpar.init(tp=2)
    if mesh.rank == 1:  # rank 1 maps the segment, then exits before the others know
        real = shm.SharedMemoryChannel.__init__

        def mapped_then_gone(self, *args, **kwargs):
            real(self, *args, **kwargs)
            os._exit(3)
        shm.SharedMemoryChannel.__init__ = mapped_then_gone
    began = time.monotonic()
    try:
        start_all_reduce_(torch.ones(4), mesh.tp_group).wait()
    except CollectiveError as e:
        raise CollectiveError(f"{e} [after {time.monotonic() - began:.2f} s]") from None


def test_a_peer_that_exits_while_a_channel_opens_ends_the_job_and_leaves_no_segment(no_leftover_segments):
    began = time.monotonic()
    with pytest.raises(tensorpar.RankError) as info:
        tensorpar.spawn(exit_while_the_channel_opens, 2, collective_timeout=timedelta(seconds=5), timeout=60)
    took = time.monotonic() - began
    assert info.value.rank == 1 and "exited with code 3" in str(info.value)
    assert "rank 0 failed: CollectiveError: rank 0: all_reduce" in str(info.value)  # rank 0 reported it too
    seen = str(info.value).split(" [after ", 1)[1].split("]")[0]
    print(f"peer exited while a channel opened: rank 0's error after {seen}, job ended after {took:.2f} s "
          "(including start-up)")


def gather_against_scatter():
    """Rank 0 all-gathers while rank 1 reduce-scatters the same number of elements through shared memory."""
    mesh = _fresh_channels(tensorpar.current_mesh())
    with tensorpar.use_mesh(mesh), pytest.raises(CollectiveError) as error:
        start_all_reduce_(torch.ones(2), mesh.tp_group).wait()  # the channel is open and working
        (all_gather_along, reduce_scatter_along)[mesh.tp_rank](torch.ones(2, 4), 0, [(2, 2), (1, 1)][mesh.tp_rank],
                                                               mesh.tp_group)
    return str(error.value)


def test_ranks_that_disagree_on_a_shared_memory_gather_or_scatter_all_raise(worlds):
    for rank, error in enumerate(worlds[2].run(gather_against_scatter)):
        assert error.startswith(f"rank {rank}: ") and "the ranks disagree on" in error, error
        assert "8 float32 elements (all-gather)" in error and "8 float32 elements (reduce-scatter)" in error, error
