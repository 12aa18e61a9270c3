"""tensorpar.spawn: per-rank results, errors tagged with the rank, no hang when a rank fails, and a
function that new processes cannot find refused by name before any rank starts."""

import contextlib
import gc
import json
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tensorpar
from tensorpar.testing.ranks import LocalRanks
from tensorpar.testing.sendable import call


def report(offset):
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x)
    return dist.get_rank(), dist.get_world_size(), os.environ["LOCAL_RANK"], x.item() + offset


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("out_features (1) is smaller than tp (2)")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here: rank 1 never joins
    return "unreachable"


def test_a_raising_rank_is_reraised_with_its_rank_and_traceback_without_hanging():
    start = time.monotonic()
    with pytest.raises(tensorpar.RankError) as info:
        tensorpar.spawn(fail_on_rank_one, 2)
    assert time.monotonic() - start < 30
    err = info.value
    assert err.rank == 1 and str(err).startswith("rank 1: ValueError: out_features (1) is smaller than tp (2)")
    assert "fail_on_rank_one" in err.remote_traceback
    assert isinstance(err.__cause__, ValueError)


def die_on_rank_zero():
    if dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def test_a_killed_rank_ends_the_run_and_its_peer_reports_the_broken_collective():
    start = time.monotonic()
    with pytest.raises(tensorpar.RankError, match=r"rank 0: process was killed by signal 9 before returning; "
                                                   r"then rank 1 failed: RuntimeError: .*Connection"):
        tensorpar.spawn(die_on_rank_zero, 2)
    assert time.monotonic() - start < 30


def test_a_run_past_its_timeout_is_stopped():
    with pytest.raises(tensorpar.RankError, match=r"timed out after 1.5 s"):
        tensorpar.spawn(time.sleep, 2, 60, timeout=1.5)


def fault_on_rank_one(directory, fault):
    """Rank 1 raises, is killed or stops itself (SIGSTOP); rank 0 waits for it in an all-reduce."""
    Path(directory, f"pid-{dist.get_rank()}").write_text(str(os.getpid()))
    if dist.get_rank() == 1:
        if fault == "raise":
            raise ValueError("rank 1 gives up")
        os.kill(os.getpid(), {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[fault])
    dist.all_reduce(torch.ones(1))


def still_running(pids):
    """Those of ``pids`` that are processes still (a zombie has ended: it only awaits its reaper)."""
    alive = []
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX":
                alive.append(pid)
    return alive


@pytest.mark.parametrize("fault", ["raise", "kill", "stop"])
def test_a_rank_that_raises_dies_or_stops_ends_every_rank_while_the_launcher_waits_in_the_kernel(tmp_path, fault):
    """The call ends within its timeout (a stopped rank never answers: the timeout ends it), no rank is
    left, and the launcher slept while it waited (it used a small part of a core)."""
    began, cpu = time.monotonic(), time.process_time()
    with pytest.raises(tensorpar.RankError) as info:
        tensorpar.spawn(fault_on_rank_one, 2, str(tmp_path), fault, timeout=6, backend="gloo",
                        collective_timeout=timedelta(seconds=120))
    waited, busy = time.monotonic() - began, time.process_time() - cpu
    said = {"raise": "rank 1: ValueError: rank 1 gives up",
            "kill": "rank 1: process was killed by signal 9 before returning; then rank 0 failed: ",
            "stop": "rank 0: timed out after 6 s; ranks [0, 1] had not finished"}[fault]
    assert str(info.value).startswith(said), str(info.value)
    pids = [int((tmp_path / f"pid-{r}").read_text()) for r in range(2)]
    assert still_running(pids) == []
    assert waited < 6 + 10  # the timeout, and start-up on a busy host
    assert busy < 0.2 * waited, f"the launcher used {busy:.2f} s of CPU in {waited:.2f} s"
    print(f"rank 1 {fault}: every rank gone after {waited:.2f} s; the launcher used {busy / waited:.0%} of a core")


def test_spawn_rejects_a_bad_process_count():
    with pytest.raises(ValueError, match=r"nprocs must be a positive integer, got 0"):
        tensorpar.spawn(report, 0, 0)


def _listening(inodes=None):
    """(file, local address, port) of the listening TCP sockets (those with ``inodes``, or all)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and (inodes is None or fields[9] in inodes):  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.append((table, address, int(port, 16)))
    return found


def _socket_fds():
    """{descriptor: socket inode} of this process."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                found[int(fd)] = target[8:-1]
    return found


def listening_sockets():
    store = int(os.environ["MASTER_PORT"])
    return [s for s in _listening() if s[2] == store], _listening(set(_socket_fds().values()))


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, as IPv4 and as IPv4-mapped IPv6


def report_and_listening_sockets(offset):
    return report(offset), listening_sockets()


def test_spawn_returns_each_rank_result_in_rank_order_and_listens_on_loopback_only():
    results = tensorpar.spawn(report_and_listening_sockets, 3, 10)  # one start serves both checks
    assert [reported for reported, _ in results] == [(r, 3, str(r), 13.0) for r in range(3)]
    for _, (store, ranks) in results:  # the rendezvous store and the ranks' own sockets
        assert store and all(address in LOOPBACK for _, address, _ in store), store
        assert all(address in LOOPBACK for _, address, _ in ranks), ranks


def test_the_rendezvous_store_alone_owns_its_listening_socket():
    """The store closes its listening socket when it ends. A Python socket holding the same descriptor would
    close that number again later, when it may belong to another socket (a later launch's store connection)."""
    ranks = LocalRanks(call, 1)
    try:
        ranks.collect("process", 60)  # the rank has joined through the store
        fds = [fd for fd, inode in _socket_fds().items() if any(port == ranks._store.port for *_, port in
                                                                  _listening({inode}))]
        holders = [s for s in gc.get_objects() if isinstance(s, socket.socket) and s.fileno() in fds]
        assert fds and not holders, (fds, holders)
    finally:
        ranks.send(None)
        ranks.kill(60)


def what_a_rank_was_given(marker):
    """This rank's view of what its launcher had: an environment variable, the working directory, the
    modules it has loaded, and where ``atexit`` handlers run."""
    import atexit

    atexit.register(Path(marker).write_text, f"exit handlers ran on rank {os.environ['RANK']}")
    return os.environ.get("TENSORPAR_TEST_VARIABLE"), os.getcwd(), "layers" in sys.modules, os.getppid()


def test_ranks_are_forked_with_the_launchers_environment_and_run_its_exit_handlers(tmp_path, monkeypatch):
    """A rank is a fork of a fork server started earlier, but sees what its launcher has now (an
    environment variable and the working directory set after the server started), none of the
    launcher's other state (a module it imported), and runs the exit handlers it registers."""
    tensorpar.spawn(report, 1, 0, backend="gloo")  # the fork server now runs, with this environment of now
    # (gloo: `report` all-reduces a CPU tensor, which NCCL, the default on a host with a GPU, cannot)
    monkeypatch.setenv("TENSORPAR_TEST_VARIABLE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    import layers  # noqa: F401 - loaded here only
    (variable, cwd, loaded, parent), = tensorpar.spawn(what_a_rank_was_given, 1, str(tmp_path / "exit"))
    assert variable == "set after the server started" and cwd == str(tmp_path) and not loaded
    assert parent != os.getpid()  # the fork server's child, not this process's
    assert (tmp_path / "exit").read_text() == "exit handlers ran on rank 0"


# ---------------------------------------------------------------- functions a new process cannot find

FIX = "define it at the top level of a .py file and import it, e.g. `from mywork import train`"
FROM_MAIN = '''
import multiprocessing.context, os, sys, time
import tensorpar
from tensorpar.testing import World

started = []
start = multiprocessing.context.SpawnProcess.start
multiprocessing.context.SpawnProcess.start = lambda self: started.append(self) or start(self)

def train(steps):
    return steps

for call in (lambda: tensorpar.spawn(train, 2, 3), lambda: World(2).run(train, 3)):
    began = time.monotonic()
    try:
        call()
    except ValueError as e:
        print(f"{time.monotonic() - began:.3f}", len(started), e)
if sys.argv[-1] == "then-an-imported-function":  # <stdin> names no file: the ranks must not try to run it
    print(len(set(tensorpar.spawn(os.getpid, 2))))
'''


def run_python(*args, stdin=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def assert_refused_up_front(lines, callers):
    for line, caller in zip(lines, callers, strict=True):
        seconds, started, message = line.split(" ", 2)
        assert float(seconds) < 5 and started == "0", line  # refused in the parent: no rank started
        assert message.startswith(f"{caller} cannot run `train`: it is defined in the `__main__` of an "
                                  "interactive session, stdin, `python -c` or a notebook cell"), message
        assert FIX in message


def test_a_function_defined_on_stdin_is_refused_before_any_rank_starts_and_an_imported_one_runs():
    *refused, pids = run_python("-", "then-an-imported-function", stdin=FROM_MAIN)
    assert_refused_up_front(refused, ["tensorpar.spawn", "World.run"])
    assert pids == "2"


IN_A_NOTEBOOK_CELL = "from IPython.core.interactiveshell import InteractiveShell\n" \
                     "InteractiveShell.instance().run_cell(sys.argv[1])\n"


def test_a_function_defined_with_python_c_or_in_a_notebook_cell_is_refused_before_any_rank_starts():
    lines = run_python("-c", FROM_MAIN + IN_A_NOTEBOOK_CELL, FROM_MAIN)  # IPython runs cells in its own __main__
    assert_refused_up_front(lines, ["tensorpar.spawn", "World.run"] * 2)


def test_a_lambda_or_a_local_function_is_refused_before_any_rank_starts(worlds):
    def local_train():
        return 1

    for run in (lambda fn: tensorpar.spawn(fn, 2), worlds[2].run):
        with pytest.raises(TypeError, match=r"cannot run the lambda `test_launch\..*<lambda>`: .* has no name; "
                                            + re.escape(FIX)):
            run(lambda: 1)
        with pytest.raises(TypeError, match=r"cannot run `test_launch\.test_a_lambda_or_a_local_function_is_"
                                            r"refused_before_any_rank_starts\.<locals>\.local_train`: it is "
                                            r"defined inside the function `test_a_lambda.*`.*" + re.escape(FIX)):
            run(local_train)


def fake_module_function():  # its module is made one that the ranks cannot import
    return 1


@pytest.fixture
def unimportable():
    module = types.ModuleType("tensorpar_no_such_module")
    module.fake_module_function = fake_module_function
    sys.modules[module.__name__] = module
    fake_module_function.__module__ = module.__name__
    yield fake_module_function
    fake_module_function.__module__ = __name__
    del sys.modules[module.__name__]


def test_a_rank_that_cannot_load_the_function_says_why(worlds, unimportable):
    said = (r"RuntimeError: this new process cannot load `tensorpar_no_such_module\.fake_module_function` "
            r"to run it \(ModuleNotFoundError: No module named 'tensorpar_no_such_module'\): .*" + re.escape(FIX))
    with pytest.raises(tensorpar.RankError, match=r"rank \d: " + said):
        tensorpar.spawn(unimportable, 2)
    with pytest.raises(tensorpar.RankError, match=r"rank \d: " + said):
        worlds[2].run(unimportable)
    assert worlds[2].run(report, 0)[1][:2] == (1, 2)  # the pool serves on


def spawn_inside_a_rank():
    """What ``tensorpar.spawn`` raises in a rank of a running job, and how many processes it started."""
    started = []
    start = multiprocessing.context.SpawnProcess.start
    multiprocessing.context.SpawnProcess.start = lambda self: started.append(self) or start(self)
    try:
        tensorpar.spawn(os.getpid, 2)
        error = None
    except RuntimeError as e:
        error = str(e)
    finally:
        multiprocessing.context.SpawnProcess.start = start
    return error, len(started)


UNDER_TORCHRUN = """
import json, test_launch
print(json.dumps(test_launch.spawn_inside_a_rank()))
"""


def test_spawn_inside_a_rank_of_a_running_job_is_refused_before_anything_starts(worlds):
    """A job's ranks (here the pool's, in one process group; then a process with torchrun's environment)
    that call spawn would each start a job of their own: refused, naming what this process is."""
    for rank, (error, started) in enumerate(worlds[2].run(spawn_inside_a_rank)):
        assert error == (f"tensorpar.spawn cannot start 2 ranks here: this process is rank {rank} of a process "
                         "group of 2, so every rank of that job would start a job of its own. Call the function "
                         "directly on the existing ranks (tensorpar.init reads torchrun's environment), or spawn "
                         "from a plain process") and started == 0
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"TORCHELASTIC_RUN_ID": "job-7", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
            "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", UNDER_TORCHRUN], capture_output=True, text=True, env=env,
                          timeout=120, check=True)
    error, started = json.loads(done.stdout)
    assert error.startswith("tensorpar.spawn cannot start 2 ranks here: this process is a rank started by torchrun "
                            "(TORCHELASTIC_RUN_ID='job-7'), so every rank") and started == 0
