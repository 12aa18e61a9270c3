"""The head layout of grouped-query attention: pure arithmetic, pinned by exact examples and checked
against its definition (query head ``q`` reads KV head ``q // g``) for every small layout."""

import pytest

from layers.heads import head_layout

# (n_head, n_kv_head, tp): per rank (query heads, KV heads held, KV head read by each query head, group size)
LAYOUTS = {
    # multi-head attention, uneven: 6 heads over 4 ranks are 2, 2, 1, 1
    (6, 6, 4): [((0, 1), (0, 1), (0, 1), 1), ((2, 3), (2, 3), (2, 3), 1), ((4,), (4,), (4,), 1),
                ((5,), (5,), (5,), 1)],
    # whole query groups (n_kv_head >= tp): 4 groups of 2 over 3 ranks, 2 + 1 + 1
    (8, 4, 3): [((0, 1, 2, 3), (0, 1), (0, 0, 1, 1), 2), ((4, 5), (2,), (2, 2), 2), ((6, 7), (3,), (3, 3), 2)],
    (6, 3, 2): [((0, 1, 2, 3), (0, 1), (0, 0, 1, 1), 2), ((4, 5), (2,), (2, 2), 2)],
    # fewer KV heads than ranks: query heads split alone, K and V held whole; the first query head of
    # rank 1 falls in the middle of a group, so its two query heads read two different KV heads
    (6, 2, 3): [((0, 1), (0, 1), (0, 0), 2), ((2, 3), (0, 1), (0, 1), 1), ((4, 5), (0, 1), (1, 1), 2)],
    (6, 2, 4): [((0, 1), (0, 1), (0, 0), 2), ((2, 3), (0, 1), (0, 1), 1), ((4,), (0, 1), (1,), 1),
                ((5,), (0, 1), (1,), 1)],
    (6, 3, 4): [((0, 1), (0, 1, 2), (0, 0), 2), ((2, 3), (0, 1, 2), (1, 1), 2), ((4,), (0, 1, 2), (2,), 1),
                ((5,), (0, 1, 2), (2,), 1)],
    # uneven readers: query heads 3-5 of groups of 4 read KV heads 0, 1, 1
    (8, 2, 3): [((0, 1, 2), (0, 1), (0, 0, 0), 3), ((3, 4, 5), (0, 1), (0, 1, 1), None),
                ((6, 7), (0, 1), (1, 1), 2)],
    # multi-query attention: one KV head read by every query head
    (8, 1, 4): [((2 * r, 2 * r + 1), (0,), (0, 0), 2) for r in range(4)],
    (5, 1, 2): [((0, 1, 2), (0,), (0, 0, 0), 3), ((3, 4), (0,), (0, 0), 2)],
}


@pytest.mark.parametrize("n_head, n_kv_head, tp", list(LAYOUTS))
def test_head_layout_examples(n_head, n_kv_head, tp):
    got = []
    for rank in range(tp):
        heads = head_layout(n_head, n_kv_head, tp, rank)
        got.append((tuple(heads.query), tuple(heads.kv_held), heads.kv_read, heads.group_size))
        assert heads.kv_replicated == (n_kv_head < tp)
    assert got == LAYOUTS[n_head, n_kv_head, tp]


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 5])
def test_every_query_head_reads_its_own_kv_head_once(tp):
    """Every layout up to 12 heads: each query head on exactly one rank, reading KV head ``q // g``,
    which that rank holds; shares differ by at most one unit (a head, or a query group)."""
    for n_head in range(tp, 13):
        for n_kv_head in (k for k in range(1, n_head + 1) if n_head % k == 0):
            g = n_head // n_kv_head
            layouts = [head_layout(n_head, n_kv_head, tp, r) for r in range(tp)]
            assert [q for h in layouts for q in h.query] == list(range(n_head))
            for h in layouts:
                assert h.kv_read == tuple(q // g for q in h.query)
                assert set(h.kv_read) <= set(h.kv_held)
            unit = 1 if n_kv_head < tp else g
            sizes = [len(h.query) // unit for h in layouts]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("args, error, message", [
    ((3, 3, 4, 0), ValueError, r"n_head \(3\) is smaller than tp \(4\)"),
    ((6, 4, 2, 0), ValueError, r"n_head \(6\) is not divisible by n_kv_head \(4\)"),
    ((6, 0, 2, 0), ValueError, "n_kv_head must be a positive integer, got 0"),
    ((6, 2, 2, 2), ValueError, "shard index 2 is out of range for 2 parts"),
])
def test_head_layout_errors_name_the_numbers(args, error, message):
    with pytest.raises(error, match=message):
        head_layout(*args)
