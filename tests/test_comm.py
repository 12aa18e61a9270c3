"""Every autograd collective against its closed form, forward and backward, on real process groups.

Each rank's input and output gradient are random tensors seeded by (example, rank,
role), so every rank can rebuild every other rank's tensors and compute the
expected result locally with plain torch (cat, sum, narrow).
"""

import hashlib
import os
import signal
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from tensorpar.testing import assert_close, count_collectives
from tensorpar.testing.strategies import tp_sizes

OPS = ["copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp", "reduce_scatter", "all_gather"]
# Which ops take a full tensor (the split happens inside) and which take a shard.
TAKES_SHARD = {"gather_from_tp", "all_gather"}
# (op, forward collectives, backward collectives) at tp > 1; numel is of the full tensor, as it travels:
# an all-gather's and a reduce-scatter's shards padded to the largest.
COLLECTIVES = {
    "copy_to_tp": ([], ["all_reduce"]),
    "reduce_from_tp": (["all_reduce"], []),
    "scatter_to_tp": ([], ["all_gather"]),
    "gather_from_tp": (["all_gather"], []),
    "reduce_scatter": (["reduce_scatter"], ["all_gather"]),
    "all_gather": (["all_gather"], ["reduce_scatter"]),
}


def _rand(shape, seed, rank, role):
    g = torch.Generator().manual_seed(seed * 1_000 + rank * 10 + role)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def check_collective(op, full_shape, dim, seed):
    mesh = tensorpar.current_mesh()
    n, rank = mesh.tp, mesh.tp_rank
    sizes = tensorpar.partition_sizes(full_shape[dim], n)
    offsets = tensorpar.partition_offsets(full_shape[dim], n)

    def local(t, r):  # rank r's slice along dim
        return t.narrow(dim, offsets[r], sizes[r])

    def shard_shape(r):
        return tuple(sizes[r] if d == dim % len(full_shape) else s for d, s in enumerate(full_shape))

    in_shape = shard_shape if op in TAKES_SHARD else (lambda r: full_shape)
    out_shape = {"scatter_to_tp": shard_shape, "reduce_scatter": shard_shape}.get(op, lambda r: full_shape)
    xs = [_rand(in_shape(r), seed, r, 0) for r in range(n)]
    gs = [_rand(out_shape(r), seed, r, 1) for r in range(n)]

    x = xs[rank].clone().requires_grad_()
    with count_collectives() as counts:
        fn = getattr(tensorpar, op)
        if op in ("copy_to_tp", "reduce_from_tp"):
            y = fn(x)
        elif op in TAKES_SHARD:
            y = fn(x, dim, full_shape[dim])
        else:
            y = fn(x, dim)
        y.backward(gs[rank])

    def total(ts):
        return torch.stack(ts).sum(0)
    expected_y, expected_dx = {
        "copy_to_tp": lambda: (xs[rank], total(gs)),
        "reduce_from_tp": lambda: (total(xs), gs[rank]),
        "scatter_to_tp": lambda: (local(xs[rank], rank), torch.cat(gs, dim)),
        "gather_from_tp": lambda: (torch.cat(xs, dim), local(gs[rank], rank)),
        "reduce_scatter": lambda: (local(total(xs), rank), torch.cat(gs, dim)),
        "all_gather": lambda: (torch.cat(xs, dim), local(total(gs), rank)),
    }[op]()
    # float64 sums in a different order: a few ulps.
    assert_close(y, expected_y, rtol=1e-12, name=f"{op} forward")
    assert_close(x.grad, expected_dx, rtol=1e-12, name=f"{op} backward")
    assert x.data_ptr() != y.data_ptr() or n == 1 or op == "copy_to_tp"
    assert torch.equal(x.detach(), xs[rank]), f"{op} modified its input in place"

    numel = torch.Size(full_shape).numel()
    padded = numel // full_shape[dim] * n * max(sizes)
    want_fwd, want_bwd = COLLECTIVES[op] if n > 1 else ([], [])
    got_fwd = [(r.op, r.numel) for r in counts.select(phase="forward")]
    got_bwd = [(r.op, r.numel) for r in counts.select(phase="backward")]
    assert got_fwd == [(o, numel if o == "all_reduce" else padded) for o in want_fwd], got_fwd
    assert got_bwd == [(o, numel if o == "all_reduce" else padded) for o in want_bwd], got_bwd
    assert counts.get_total_counts() == len(want_fwd) + len(want_bwd)  # CommDebugMode's own count
    return True


@settings(max_examples=60)
@given(op=st.sampled_from(OPS), tp=tp_sizes(), data=st.data())
def test_collective_matches_closed_form(worlds, op, tp, data):
    ndim = data.draw(st.integers(1, 3), label="ndim")
    dim = data.draw(st.integers(-ndim, ndim - 1), label="dim")
    shape = data.draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim), label="shape")
    shape[dim] = data.draw(st.integers(tp, 13), label="split size")  # divisible by tp or not
    seed = data.draw(st.integers(0, 2**20), label="seed")
    assert all(worlds[tp].run(check_collective, op, tuple(shape), dim, seed))


def check_gather_size_mismatch(size):
    x = torch.zeros(3)  # 3 elements on every rank
    try:
        tensorpar.gather_from_tp(x, 0, size)
    except ValueError as e:
        return str(e)
    return None


def test_gather_with_a_wrong_full_size_is_a_clear_error(worlds):
    # 4 elements over 2 ranks are 2 + 2, but each rank holds 3: every rank refuses before communicating.
    messages = worlds[2].run(check_gather_size_mismatch, 4)
    assert all(m and "holds 3 elements" in m and "split is [2, 2]" in m for m in messages), messages


def check_all_reduce(numel, op_name, seed):
    """An all-reduce gives the reduction, with the same bits on every rank, eagerly in its input's place."""
    from tensorpar.comm.collectives import start_all_reduce_

    mesh = tensorpar.current_mesh()
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(numel, generator=g, dtype=torch.float64) for _ in range(mesh.tp)]
    mine = parts[mesh.tp_rank].clone()
    got = start_all_reduce_(mine, mesh.tp_group, op=op_name).wait()
    assert got.data_ptr() == mine.data_ptr()
    expected = torch.stack(parts).sum(0) if op_name == "sum" else torch.stack(parts).amax(0)
    return assert_close(got, expected), hashlib.sha256(got.numpy().tobytes()).hexdigest()


@settings(max_examples=12)
@given(tp=st.integers(2, 4), data=st.data())
def test_an_all_reduce_gives_the_same_reduction_on_every_rank(worlds, tp, data):
    numel = data.draw(st.sampled_from([1, 7, 4096, 40_000, 300_000]))
    results = worlds[tp].run(check_all_reduce, numel, data.draw(st.sampled_from(["sum", "max"])),
                             data.draw(st.integers(0, 2**31)))
    assert all(err <= 1e-12 for err, _ in results) and len({digest for _, digest in results}) == 1


def test_an_all_reduce_refuses_an_op_it_does_not_do():
    from tensorpar.comm.collectives import start_all_reduce_

    with pytest.raises(ValueError, match="all-reduce: op 'min' is neither 'sum' nor 'max'"):
        start_all_reduce_(torch.ones(2), None, op="min")  # refused before the group is looked at


def die_inside_an_all_reduce():
    from tensorpar.comm.collectives import start_all_reduce_

    mesh = tensorpar.init()
    start_all_reduce_(torch.ones(8), mesh.tp_group).wait()  # the group is connected
    if mesh.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start_all_reduce_(torch.ones(8), mesh.tp_group).wait()


def test_a_dead_peer_ends_an_all_reduce_at_once():
    start = time.monotonic()
    with pytest.raises(tensorpar.RankError, match=r"rank 1: process was killed by signal 9 before returning; then "
                                                   r"rank 0 failed: RuntimeError: .*Connection (reset|closed) by peer"):
        tensorpar.spawn(die_inside_an_all_reduce, 2)
    assert time.monotonic() - start < 30
