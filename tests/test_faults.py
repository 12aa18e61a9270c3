"""Faults end every rank with a clear error within the timeout and leave nothing behind.

Each fault is real: a launcher killed by a signal, a rank stopped with SIGSTOP,
a rank that exits before a collective, ranks that pass different tensors to one
collective (with and without ``TORCH_DISTRIBUTED_DEBUG=DETAIL``). Each test bounds its own waiting with
short timeouts, measures the time to the error, and checks that no process
and no ``/dev/shm`` entry is left.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tensorpar
import tensorpar.checkpoint
from tensorpar.comm.collectives import start_all_reduce_

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

def all_reduce_of_another_size():
    """Rank 0 all-reduces 4 floats, rank 1 8: gloo finds the sizes differ and aborts."""
    mesh = tensorpar.init(tp=2)
    start_all_reduce_(torch.ones(4), mesh.tp_group).wait()  # the group is connected
    start_all_reduce_(torch.ones((4, 8)[mesh.rank]), mesh.tp_group).wait()
    return "returned"


def test_ranks_that_disagree_on_a_collective_size_all_end(no_leftover_segments):
    began = time.monotonic()
    with pytest.raises(tensorpar.RankError) as info:
        tensorpar.spawn(all_reduce_of_another_size, 2, collective_timeout=timedelta(seconds=20), timeout=60)
    took = time.monotonic() - began
    assert "returned" not in str(info.value)
    assert took < 20, f"the job took {took:.2f} s to end: a rank waited for the collective timeout"
    print(f"all-reduce sizes differ: the job ended after {took:.2f} s (including start-up): {info.value}")


def disagreeing_calls_under_detail():
    """Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (read when a group is made: here a group made after
    setting it), each disagreement is an error on every rank, and the group still works after it."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    rank, group = dist.get_rank(), dist.new_group([0, 1])
    calls = {
        "dtype": lambda: start_all_reduce_(torch.ones(4, dtype=(torch.float32, torch.int32)[rank]), group).wait(),
        "count": lambda: start_all_reduce_(torch.ones((4, 8)[rank]), group).wait(),
    }
    errors = {}
    for case, call in calls.items():
        try:
            call()
        except RuntimeError as e:
            errors[case] = str(e)
    after = start_all_reduce_(torch.full((3,), float(rank + 1)), group).wait()  # agreeing calls still work
    return errors, after.tolist()


def test_under_torch_distributed_debug_detail_every_disagreement_raises_on_every_rank():
    for errors, after in tensorpar.spawn(disagreeing_calls_under_detail, 2, timeout=120):
        assert sorted(errors) == ["count", "dtype"], errors
        assert all("Detected mismatch between collectives on ranks" in e for e in errors.values()), errors
        assert "Float" in errors["dtype"] and "Int" in errors["dtype"], errors["dtype"]
        assert after == [3.0, 3.0, 3.0]


def world_all_reduce_of_another_dtype():
    """A float32 all-reduce on rank 0 against an int32 one of the same bytes on rank 1, in the group spawn made:
    what each rank's call raised, or ``None``."""
    x = torch.ones(4, dtype=(torch.float32, torch.int32)[dist.get_rank()])
    try:
        dist.all_reduce(x)
    except RuntimeError as e:
        return str(e)
    return None


def test_spawn_ranks_read_torch_distributed_debug_from_the_launchers_environment_of_now(monkeypatch):
    """The fork server imported torch (and c10d read TORCH_DISTRIBUTED_DEBUG) before the variable was set
    here: the ranks spawned afterwards still compare their collectives."""
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    assert tensorpar.spawn(os.getpid, 2, timeout=60)  # the fork server runs, without the variable
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    errors = tensorpar.spawn(world_all_reduce_of_another_dtype, 2, timeout=120)
    assert all(e is not None and "Detected mismatch between collectives on ranks" in e for e in errors), errors


# ---------------------------------------------------------------- a peer stops or dies

def stop_one_rank():
    mesh = tensorpar.init(tp=2)
    pids = torch.zeros(2, dtype=torch.int64)
    pids[mesh.rank] = os.getpid()
    dist.all_reduce(pids)
    start_all_reduce_(torch.ones(4), mesh.tp_group).wait()  # the group is connected
    if mesh.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return "resumed"
    time.sleep(0.2)  # rank 1 is stopped now
    began, cpu = time.monotonic(), time.process_time()
    try:
        start_all_reduce_(torch.ones(4), mesh.tp_group).wait()
    except RuntimeError as e:
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
    assert error is not None and "Timed out" in error, error
    assert 2.0 <= waited < 4.0, f"the stopped peer was reported after {waited:.2f} s (timeout 2 s)"
    assert busy < 0.3 * waited, f"the waiting rank used {busy:.2f} s of CPU in {waited:.2f} s"
    print(f"stopped peer: reported after {waited:.2f} s, waiting rank used {busy / waited:.0%} of a core")


def exit_before_a_collective():
    mesh = tensorpar.init(tp=2)
    start_all_reduce_(torch.ones(4), mesh.tp_group).wait()  # the group is connected
    if mesh.rank == 1:  # rank 1 exits, rank 0 goes on into the next collective
        os._exit(3)
    began = time.monotonic()
    try:
        start_all_reduce_(torch.ones(4), mesh.tp_group).wait()
    except RuntimeError as e:
        raise RuntimeError(f"{e} [after {time.monotonic() - began:.2f} s]") from None


def test_a_peer_that_exits_before_a_collective_ends_the_job(no_leftover_segments):
    began = time.monotonic()
    with pytest.raises(tensorpar.RankError) as info:
        tensorpar.spawn(exit_before_a_collective, 2, collective_timeout=timedelta(seconds=20), timeout=60)
    took = time.monotonic() - began
    assert info.value.rank == 1 and "exited with code 3" in str(info.value)
    assert "rank 0 failed: RuntimeError: " in str(info.value)  # rank 0 reported it too
    seen = str(info.value).split(" [after ", 1)[1].split("]")[0]
    assert took < 20, f"the job took {took:.2f} s to end"
    print(f"peer exited before a collective: rank 0's error after {seen}, job ended after {took:.2f} s "
          "(including start-up)")
