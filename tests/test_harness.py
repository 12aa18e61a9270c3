"""The test harness itself: failures are caught, named and never hang; mistakes in f/g are caught."""

import copy
import os
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from layers import ColumnParallelLinear, RowParallelLinear
from reference import DenseMLP
from tensorpar.testing import World, assert_sharded_equivalent, count_collectives
from tensorpar.testing.strategies import tp_sizes


@pytest.fixture(scope="module")
def pair():
    """A world of its own, so restarts here do not slow the shared pools."""
    world = World(2, timeout=8.0, grace=1.0)
    yield world
    world.close()


def rank_one_raises():
    if dist.get_rank() == 1:
        raise KeyError("boom")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that never comes


def ranks():
    return dist.get_rank()


def test_a_rank_that_raises_fails_fast_and_the_pool_recovers(pair):
    pair.run(ranks)  # started
    start = time.monotonic()
    with pytest.raises(tensorpar.RankError, match=r"rank 1: KeyError: 'boom'") as info:
        pair.run(rank_one_raises)
    assert time.monotonic() - start < 5  # the 1 s grace, not the 8 s timeout
    assert "rank_one_raises" in info.value.remote_traceback
    assert pair.run(ranks) == [0, 1]


def all_hang():
    if dist.get_rank() == 0:  # in an all-reduce that its peer never joins
        tensorpar.reduce_from_tp(torch.ones(1000))
    time.sleep(30)


def test_a_hung_example_is_killed_and_the_pool_restarted(pair):
    segments = set(os.listdir("/dev/shm"))
    pair.run(tensorpar.reduce_from_tp, torch.ones(3))  # the group is connected
    start = time.monotonic()  # a timeout of this call's own, shorter than the pool's: all_hang never finishes
    with pytest.raises(TimeoutError, match=r"all_hang did not finish within 1.0 s on ranks \[0, 1\]"):
        pair.run(all_hang, timeout=1.0)
    assert time.monotonic() - start < 8  # killed at this call's 1 s, not the pool's 8 s
    assert pair.run(ranks) == [0, 1]
    assert set(os.listdir("/dev/shm")) == segments  # the killed example left no shared memory behind


def rank_zero_exits():
    if dist.get_rank() == 0:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def test_a_worker_that_dies_is_reported_and_replaced(pair):
    with pytest.raises(tensorpar.RankError, match=r"rank 0: pool worker running rank_zero_exits exited with code 3"):
        pair.run(rank_zero_exits)
    assert pair.run(ranks) == [0, 1]


# ------------------------------------------------ a broken f or g is caught

def _plain(fn):  # the linear map without its collective
    return lambda x, w, b=None, group=None: torch.nn.functional.linear(x, w, b)


def _f_twice(fn):  # one more f in front of the (fused) column-parallel linear
    return lambda x, w, b=None, group=None: fn(tensorpar.copy_to_tp(x, group), w, b, group)


def _g_twice(fn):  # one more g behind the (fused) row-parallel partial sums
    def twice(x, w, b=None, group=None):
        y = tensorpar.reduce_from_tp(fn(x, w, None, group), group)
        return y if b is None else y + b
    return twice


MUTATIONS = {
    "missing f": ("column_parallel_linear", _plain),
    "doubled f": ("column_parallel_linear", _f_twice),
    "missing g": ("row_parallel_linear", _plain),
    "doubled g": ("row_parallel_linear", _g_twice),
}


def check_mutation_is_caught(mutation, seed):
    name, mutate = MUTATIONS[mutation]
    original = getattr(tensorpar, name)
    torch.manual_seed(seed)
    dense = DenseMLP(6, 10, dtype=torch.float64)
    sharded = copy.deepcopy(dense)
    sharded.fc1, sharded.fc2 = ColumnParallelLinear.from_linear(dense.fc1), RowParallelLinear.from_linear(dense.fc2)
    x = torch.randn(5, 6, dtype=torch.float64)
    setattr(tensorpar, name, mutate(original))
    try:
        assert_sharded_equivalent(sharded, dense, x, seed=seed)
        caught = None
    except AssertionError as e:
        caught = str(e)
    finally:
        setattr(tensorpar, name, original)
    # the size of the mistake: input-gradient and output norms against the dense model
    xs, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    setattr(tensorpar, name, mutate(original))
    try:
        ys = sharded(xs)
        ys.sum().backward()
    finally:
        setattr(tensorpar, name, original)
    yd = dense(xd)
    yd.sum().backward()
    return caught, (xs.grad.norm() / xd.grad.norm()).item(), ((ys - dense.fc2.bias).norm()
                                                              / (yd - dense.fc2.bias).norm()).item()


@settings(max_examples=8)
@given(mutation=st.sampled_from(sorted(MUTATIONS)), tp=st.integers(2, 4), seed=st.integers(0, 2**31))
def test_a_missing_or_doubled_f_or_g_fails_the_equivalence_check(worlds, mutation, tp, seed):
    caught, grad_ratio, out_ratio = worlds[tp].run(check_mutation_is_caught, mutation, seed)[0]
    assert caught is not None, f"{mutation} at tp={tp} went unnoticed"
    if mutation == "doubled f":  # the all-reduce of the input gradient runs twice: tp times too large
        assert grad_ratio == pytest.approx(tp, rel=1e-9)
    if mutation == "doubled g":  # the partial sums are summed twice: tp times too large
        assert out_ratio == pytest.approx(tp, rel=1e-9)
    if mutation == "missing g":
        assert "output" in caught


# ------------------------------------------------ collective accounting

def count_mlp_collectives(d, hidden, tokens):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(ColumnParallelLinear(d, hidden), torch.nn.GELU(), RowParallelLinear(hidden, d))
    x = torch.randn(tokens, d, requires_grad=True)
    with count_collectives() as counts:
        mlp(x).sum().backward()
    return sorted(counts.summary().items(), key=str)


@settings(max_examples=8)
@given(tp=tp_sizes(), d=st.integers(1, 16), extra=st.integers(0, 16), tokens=st.integers(1, 9))
def test_an_mlp_issues_exactly_one_all_reduce_each_way(worlds, tp, d, extra, tokens):
    for summary in worlds[tp].run(count_mlp_collectives, d, tp + extra, tokens):
        if tp == 1:
            assert summary == []
        else:  # g in forward, f in backward, each over the (tokens, d) activation
            assert summary == [(("backward", "all_reduce", torch.float32, tokens * d), 1),
                               (("forward", "all_reduce", torch.float32, tokens * d), 1)]
