"""tensorpar.spawn: per-rank results, errors tagged with the rank, and no hang when a rank fails."""

import os
import signal
import time

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
