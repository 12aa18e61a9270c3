"""Initialisation: bitwise the same full weights at every tp, with nn.Linear's distribution."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from layers import ColumnParallelLinear, RowParallelLinear


def build_full_layer(kind, in_f, out_f, bias, seed):
    torch.manual_seed(seed)
    if kind == "qkv":  # a fused [Q | K | V] split block by block
        layer = ColumnParallelLinear(in_f, 3 * out_f, bias=bias, unit=(1, 1, 1))
    else:
        layer = (ColumnParallelLinear if kind == "column" else RowParallelLinear)(in_f, out_f, bias=bias)
    next_draw = torch.randint(0, 2**62, ()).item()  # the global RNG must be in the same place at every tp
    return layer.to_linear().state_dict(), next_draw


@settings(max_examples=8)
@given(kind=st.sampled_from(["column", "row", "qkv"]), in_f=st.integers(4, 600), out_f=st.integers(4, 600),
       bias=st.booleans(), seed=st.integers(0, 2**31))
def test_full_weights_are_bitwise_identical_at_every_tp(worlds, kind, in_f, out_f, bias, seed):
    # Sizes up to 600 cross the 256-element tile boundaries at uneven shard offsets.
    reference = None
    for tp in (1, 2, 3, 4):
        for state, next_draw in worlds[tp].run(build_full_layer, kind, in_f, out_f, bias, seed):
            if reference is None:
                reference = (state, next_draw)
            assert next_draw == reference[1], f"tp={tp} consumed the global RNG differently"
            assert state.keys() == reference[0].keys()
            for k in state:
                assert torch.equal(state[k], reference[0][k]), f"{k} differs at tp={tp}"


def test_weights_follow_nn_linear_default_distribution(worlds):
    in_f, out_f = 300, 700  # uneven over 3 ranks, several tiles each way
    (state, _), *_ = worlds[3].run(build_full_layer, "column", in_f, out_f, True, 1234)
    w = state["weight"].flatten().double()
    bound = 1 / math.sqrt(in_f)  # kaiming_uniform_(a=√5) as nn.Linear: U(-1/√in, 1/√in)
    assert w.abs().max() <= bound
    u = (w + bound) / (2 * bound)  # U(0, 1) if the distribution is right
    n = u.numel()
    # Kolmogorov-Smirnov distance to U(0, 1); 1.95/√n is the 0.1% critical value.
    ecdf = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = (ecdf - u.sort().values).abs().max().item()
    assert ks < 1.95 / math.sqrt(n), ks
    assert abs(u.mean().item() - 0.5) < 4 * math.sqrt(1 / 12 / n)
    # tiles are drawn from different streams: no two tiles repeat
    tiles = state["weight"].unfold(0, 256, 256)[:2, :256]
    assert not torch.equal(tiles[0], tiles[1])
    b = state["bias"]
    assert b.abs().max() <= bound and b.unique().numel() == out_f


def check_shard_is_its_slice(in_f, out_f, seed):
    torch.manual_seed(seed)
    column = ColumnParallelLinear(in_f, out_f)
    torch.manual_seed(seed)
    full = torch.empty(out_f, in_f)
    tensorpar.tiled_init.uniform_(full, -1 / math.sqrt(in_f), 1 / math.sqrt(in_f))
    mesh = tensorpar.current_mesh()
    expected = tensorpar.shard(full, tensorpar.Shard(0, out_f), mesh.tp, mesh.tp_rank)
    return torch.equal(column.weight.detach(), expected)


def test_each_rank_holds_exactly_its_slice_of_the_unsharded_draw(worlds):
    assert all(worlds[4].run(check_shard_is_its_slice, 33, 523, 7))


def test_tiled_fill_checks_the_block_fits():
    with pytest.raises(ValueError, match=r"does not fit"):
        tensorpar.tiled_init.uniform_(torch.empty(3, 4), 0, 1, full_shape=(3, 5), offset=(0, 2))
