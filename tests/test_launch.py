"""tensorpar.spawn: per-rank results, errors tagged with the rank, and no hang when a rank fails."""

import contextlib
import dataclasses
import os
import signal
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import tensorpar


def report(offset):
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x)
    return dist.get_rank(), dist.get_world_size(), os.environ["LOCAL_RANK"], x.item() + offset


def test_spawn_returns_each_rank_result_in_rank_order():
    assert tensorpar.spawn(report, 3, 10) == [(r, 3, str(r), 13.0) for r in range(3)]


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


def test_spawn_rejects_a_bad_process_count():
    with pytest.raises(ValueError, match=r"nprocs must be a positive integer, got 0"):
        tensorpar.spawn(report, 0, 0)


def _listening(inodes=None):
    """(file, local address, port) of the listening TCP sockets (those with ``inodes``, or all)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).readlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and (inodes is None or fields[9] in inodes):  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.append((table, address, int(port, 16)))
    return found


def listening_sockets():
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                mine.add(target[8:-1])
    store = int(os.environ["MASTER_PORT"])
    return [s for s in _listening() if s[2] == store], _listening(mine)


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, as IPv4 and as IPv4-mapped IPv6


def test_the_rendezvous_store_and_the_ranks_listen_on_loopback_only():
    for store, ranks in tensorpar.spawn(listening_sockets, 2):
        assert store and all(address in LOOPBACK for _, address, _ in store), store
        assert all(address in LOOPBACK for _, address, _ in ranks), ranks


def open_channels_and_check_without_unpickling():
    from tensorpar.comm import checks  # noqa: F401 - used through the collectives below
    from tensorpar.comm.collectives import start_all_reduce_

    def refuse(*args, **kwargs):
        raise AssertionError("data from a peer was unpickled")

    c10d = dist.distributed_c10d
    saved = c10d._tensor_to_object
    c10d._tensor_to_object = refuse
    mesh = dataclasses.replace(tensorpar.current_mesh(), channels=weakref.WeakKeyDictionary())
    os.environ["TENSORPAR_CHECK_COLLECTIVES"] = "1"
    try:
        with tensorpar.use_mesh(mesh):
            out = start_all_reduce_(torch.ones(5), mesh.tp_group).wait()
            out = start_all_reduce_(torch.ones(300_000), mesh.tp_group).wait()[:5] + out  # grows the channel
    finally:
        c10d._tensor_to_object = saved
        del os.environ["TENSORPAR_CHECK_COLLECTIVES"]
    return out.tolist(), mesh.channels[mesh.tp_group] is not None


def test_setting_up_shared_memory_and_checking_calls_unpickle_nothing(worlds):
    for out, shared in worlds[2].run(open_channels_and_check_without_unpickling):
        assert out == [4.0] * 5 and shared
