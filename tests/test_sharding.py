"""Balanced partitions: pure functions, checked in the test process."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tensorpar import Shard, partition_bounds, partition_offsets, partition_sizes, sequence_sizes, shard
from tensorpar.sharding import join_shards


@given(parts=st.integers(1, 16), units=st.integers(0, 200), unit=st.integers(1, 8))
def test_partition_is_balanced_and_covers_everything(parts, units, unit):
    units += parts  # at least one unit per part
    sizes = partition_sizes(units * unit, parts, unit=unit)
    assert len(sizes) == parts
    assert sum(sizes) == units * unit
    assert all(s % unit == 0 and s > 0 for s in sizes)
    assert max(sizes) - min(sizes) <= unit
    assert sizes == sorted(sizes, reverse=True)  # the larger shards come first
    offsets = partition_offsets(units * unit, parts, unit=unit)
    assert offsets == [sum(sizes[:r]) for r in range(parts)]


def test_partition_examples():
    assert partition_sizes(10, 4) == [3, 3, 2, 2]
    assert partition_sizes(12 * 64, 5, unit=64) == [192, 192, 128, 128, 128]
    assert partition_sizes(50257, 4) == [12565, 12564, 12564, 12564]
    # the tokens of sequence parallelism: the same split, and ranks past the last token hold none
    assert partition_sizes(2, 4, allow_empty=True) == [1, 1, 0, 0]
    assert sequence_sizes(17, 4) == [5, 4, 4, 4] and sequence_sizes(3, 4) == [1, 1, 1, 0]


@pytest.mark.parametrize("args, message", [
    ((10, 16), r"out_features \(10\) is smaller than tp \(16\)"),
    ((3 * 64, 4, 64), r"n_head \(3\) is smaller than tp \(4\)"),
    ((100, 2, 64), r"not a whole number of units of 64"),
    ((10, 0), r"parts must be a positive integer, got 0"),
])
def test_partition_errors_name_the_numbers(args, message):
    size, parts, *unit = args
    name = "n_head" if unit else "out_features"
    with pytest.raises(ValueError, match=message):
        partition_sizes(size, parts, unit=unit[0] if unit else 1, name=name)


@pytest.mark.parametrize("call, error, message", [
    (lambda: partition_sizes(12, 2, unit=2.5), TypeError, "unit must be a positive integer, got 2.5"),
    (lambda: partition_sizes(12, 2, unit=None), TypeError, "unit must be a positive integer, got None"),
    (lambda: partition_sizes(12, 2, unit=True), TypeError, "unit must be a positive integer, got True"),
    (lambda: partition_offsets(12, 2, unit=0), ValueError, "unit must be a positive integer, got 0"),
    (lambda: partition_bounds(12, 2, 0, unit=-4), ValueError, "unit must be a positive integer, got -4"),
    (lambda: partition_sizes(True, 1), TypeError, "size must be a positive integer, got True"),
    (lambda: partition_sizes(12.0, 2, name="n_embd"), TypeError, "n_embd must be a positive integer, got 12.0"),
    (lambda: partition_sizes(12, True), TypeError, "parts must be a positive integer, got True"),
    (lambda: partition_offsets(12, 2.0), TypeError, "parts must be a positive integer, got 2.0"),
    (lambda: partition_bounds(12, 3, 3), ValueError, "shard index 3 is out of range for 3 parts"),
    (lambda: partition_bounds(12, 3, -1), ValueError, "shard index must be a non-negative integer, got -1"),
    (lambda: Shard(0, 12, unit=1.5).sizes(2), TypeError, "unit must be a positive integer, got 1.5"),
])
def test_partition_arguments_must_be_integers(call, error, message):
    """A bool is an int to Python but never a size, count or unit here; nor is a float, or None."""
    with pytest.raises(error) as raised:
        call()
    assert str(raised.value) == message


@given(rows=st.integers(1, 9), cols=st.integers(1, 9), dim=st.integers(0, 1), data=st.data())
def test_shards_concatenate_to_the_tensor(rows, cols, dim, data):
    full = torch.arange(rows * cols).reshape(rows, cols)
    parts = data.draw(st.integers(1, full.shape[dim]))
    placement = Shard(dim, full.shape[dim])
    pieces = [shard(full, placement, parts, r) for r in range(parts)]
    assert torch.equal(torch.cat(pieces, dim), full)


def test_shard_rejects_a_tensor_of_the_wrong_size():
    with pytest.raises(ValueError, match=r"expected size 5 in dim 1"):
        shard(torch.zeros(3, 4), Shard(1, 5), 2, 0)


@given(blocks=st.integers(2, 4), units=st.integers(1, 9), unit=st.integers(1, 3), cols=st.integers(1, 3),
       dim=st.integers(0, 1), data=st.data())
def test_shards_of_blocks_are_each_blocks_piece_and_join_back(blocks, units, unit, cols, dim, data):
    """A fused ``[Q | K | V]`` dim (``blocks=3``): each rank holds its balanced piece of every block,
    in block order, and the pieces of all ranks join back into the full tensor."""
    parts = data.draw(st.integers(1, units))
    size = blocks * units * unit
    full = torch.arange(size * cols).reshape(size, cols)
    full = full if dim == 0 else full.t()
    placement = Shard(dim, size, (unit,) * blocks)
    pieces = [shard(full, placement, parts, r) for r in range(parts)]
    block = size // blocks
    for r, piece in enumerate(pieces):
        lo, n = partition_bounds(block, parts, r, unit=unit)
        expected = torch.cat([full.narrow(dim, b * block + lo, n) for b in range(blocks)], dim)
        assert torch.equal(piece, expected)
        assert piece.shape[dim] == placement.sizes(parts)[r]
    assert torch.equal(join_shards(pieces, placement), full)


def test_blocks_must_divide_the_size():
    with pytest.raises(ValueError,
                       match=r"size \(10\) is not a whole number of units of 3 \(blocks of units \(1, 1, 1\)\)"):
        Shard(0, 10, (1, 1, 1)).sizes(2)


@given(groups=st.integers(1, 6), g=st.integers(1, 3), d=st.integers(1, 3), kv_replicated=st.booleans(), data=st.data())
def test_unequal_blocks_and_a_replicated_tail_join_back(groups, g, d, kv_replicated, data):
    """Grouped-query ``[Q | K | V]``: split by query group (units of g*d, d and d rows), or by query head with
    K and V held whole after them; each rank's shard is its rows of each block in order."""
    q, kv = groups * g * d, groups * d
    full = torch.arange(q + 2 * kv)
    if kv_replicated:
        placement, units, width = Shard(0, q + 2 * kv, d, replicated=2 * kv), groups * g, (d,)
    else:
        placement, units, width = Shard(0, q + 2 * kv, (g * d, d, d)), groups, (g * d, d, d)
    parts = data.draw(st.integers(1, units))
    shards = [shard(full, placement, parts, r) for r in range(parts)]
    for r, got in enumerate(shards):
        lo, n = partition_bounds(units, parts, r)
        starts = [0, q, q + kv][:len(width)]
        expected = [full[s + lo * w:s + (lo + n) * w] for s, w in zip(starts, width, strict=True)]
        expected += [full[q:]] if kv_replicated else []
        assert torch.equal(got, torch.cat(expected)) and got.shape[0] == placement.sizes(parts)[r]
    assert torch.equal(join_shards(shards, placement), full)
