"""Sharded parameters against slices of their dense twins, with the indices computed in this file.

The other equivalence tests put weights in through ``load_full_state_dict`` and read gradients back
through ``full_grads``; one mistake made alike in both would cancel out. Here each rank's local
parameter, and its gradient after one backward, is compared with the rows or columns of the dense
module's that the balanced split written out below says the rank holds: the column split (rows of
the weight), the row split (columns), the vocab split (rows of the table) and attention's head split
(query heads, the KV heads with them, or every KV head when there are fewer than ranks).
"""

import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import reference_gpt as ref
import tensorpar
from layers import ColumnParallelLinear, ParallelSelfAttention, RowParallelLinear, VocabParallelEmbedding
from tensorpar.testing import assert_all_close

F64 = torch.float64


def balanced(units, tp, rank):
    """``[lo, hi)`` of rank ``rank``'s share of ``units`` over ``tp`` ranks: the first ``units % tp`` ranks
    hold one unit more than the others."""
    base, extra = divmod(units, tp)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def compare(held, expected):
    """Parameters bitwise (they are copies); everything else (outputs, gradients) to float64 round-off."""
    for name, (mine, theirs) in held.items():
        assert mine.shape == theirs.shape and torch.equal(mine, theirs), f"{name}: not the slice of the dense one"
    return max(assert_all_close(expected, rtol=1e-10).values())


def check_linears(n_in, hidden, n_out, seed):
    """A dense MLP's two linears, sharded by ``from_linear``: column rows ``[lo, hi)``, row columns ``[lo, hi)``."""
    rank, tp = tensorpar.current_mesh().tp_rank, tensorpar.current_mesh().tp
    torch.manual_seed(seed)
    fc1, fc2 = nn.Linear(n_in, hidden, dtype=F64), nn.Linear(hidden, n_out, dtype=F64)
    column, row = ColumnParallelLinear.from_linear(fc1), RowParallelLinear.from_linear(fc2)
    x, w = torch.randn(3, n_in, dtype=F64), torch.randn(3, n_out, dtype=F64)
    (fc2(F.gelu(fc1(x))) * w).sum().backward()
    y = row(F.gelu(column(x)))  # (3, n_out), summed over the ranks
    (y * w).sum().backward()
    lo, hi = balanced(hidden, tp, rank)
    held = {"column weight": (column.weight, fc1.weight[lo:hi]), "column bias": (column.bias, fc1.bias[lo:hi]),
            "row weight": (row.weight, fc2.weight[:, lo:hi]), "row bias": (row.bias, fc2.bias)}
    return compare(held, {"output": (y, fc2(F.gelu(fc1(x)))),
                          "column weight grad": (column.weight.grad, fc1.weight.grad[lo:hi]),
                          "column bias grad": (column.bias.grad, fc1.bias.grad[lo:hi]),
                          "row weight grad": (row.weight.grad, fc2.weight.grad[:, lo:hi]),
                          "row bias grad": (row.bias.grad, fc2.bias.grad)})


@settings(max_examples=10)
@given(tp=st.integers(1, 4), n_in=st.integers(1, 6), extra=st.integers(0, 9), n_out=st.integers(1, 6),
       seed=st.integers(0, 2**31))
@example(tp=4, n_in=3, extra=2, n_out=2, seed=0)  # 6 hidden features over 4 ranks: 2, 2, 1, 1
@example(tp=3, n_in=2, extra=1, n_out=3, seed=1)  # 4 over 3: 2, 1, 1
@example(tp=4, n_in=2, extra=0, n_out=1, seed=2)  # one feature per rank
def test_column_and_row_shards_are_the_dense_rows_and_columns(worlds, tp, n_in, extra, n_out, seed):
    for err in worlds[tp].run(check_linears, n_in, tp + extra, n_out, seed):
        assert err <= 1e-10


def check_embedding(vocab, dim, seed):
    """A dense ``nn.Embedding`` sharded by ``from_embedding``: rows ``[lo, hi)`` of the table."""
    rank, tp = tensorpar.current_mesh().tp_rank, tensorpar.current_mesh().tp
    torch.manual_seed(seed)
    dense = nn.Embedding(vocab, dim, dtype=F64)
    sharded = VocabParallelEmbedding.from_embedding(dense)
    ids = torch.randint(0, vocab, (2, 7))
    w = torch.randn(2, 7, dim, dtype=F64)
    (dense(ids) * w).sum().backward()
    y = sharded(ids)
    (y * w).sum().backward()
    lo, hi = balanced(vocab, tp, rank)
    return compare({"table": (sharded.weight, dense.weight[lo:hi])},
                   {"output": (y, dense(ids)), "table grad": (sharded.weight.grad, dense.weight.grad[lo:hi])})


@settings(max_examples=8)
@given(tp=st.integers(1, 4), extra=st.integers(0, 13), dim=st.integers(1, 4), seed=st.integers(0, 2**31))
@example(tp=4, extra=1, dim=2, seed=0)  # 5 rows over 4 ranks: 2, 1, 1, 1
@example(tp=3, extra=0, dim=3, seed=1)  # one row per rank
@example(tp=4, extra=6, dim=1, seed=2)  # 10 over 4: 3, 3, 2, 2
def test_vocab_shards_are_the_dense_rows(worlds, tp, extra, dim, seed):
    for err in worlds[tp].run(check_embedding, tp + extra, dim, seed):
        assert err <= 1e-10


def attention_rows(n_head, n_kv_head, d, tp, rank):
    """This rank's rows of the dense ``[Q | K | V]`` projection, and its query heads ``[lo, hi)``."""
    g, c = n_head // n_kv_head, n_head * d
    if n_kv_head >= tp:  # whole query groups: a KV head and its g query heads together
        kv_lo, kv_hi = balanced(n_kv_head, tp, rank)
        lo, hi, kv = kv_lo * g, kv_hi * g, range(kv_lo, kv_hi)
    else:  # query heads alone; every rank holds all of K and V
        (lo, hi), kv = balanced(n_head, tp, rank), range(n_kv_head)
    q_rows = list(range(lo * d, hi * d))
    k_rows = [c + k * d + i for k in kv for i in range(d)]
    v_rows = [c + n_kv_head * d + k * d + i for k in kv for i in range(d)]
    return q_rows + k_rows + v_rows, (lo, hi)


def check_attention(n_head, n_kv_head, d, t, seed):
    """nanoGPT's attention (tests/reference_gpt.py) and ParallelSelfAttention with its weights."""
    rank, tp = tensorpar.current_mesh().tp_rank, tensorpar.current_mesh().tp
    torch.manual_seed(seed)
    dense = ref.CausalSelfAttention(ref.RefConfig(n_embd=n_head * d, n_head=n_head, n_kv_head=n_kv_head)).to(F64)
    sharded = ParallelSelfAttention(n_head * d, n_head, n_kv_head=n_kv_head, dtype=F64)
    tensorpar.load_full_state_dict(sharded, dense.state_dict())
    x = torch.randn(2, t, n_head * d, dtype=F64)
    w = torch.randn(2, t, n_head * d, dtype=F64)
    x_dense, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    (dense(x_dense) * w).sum().backward()
    y = sharded(x_ours)
    (y * w).sum().backward()
    rows, (lo, hi) = attention_rows(n_head, n_kv_head, d, tp, rank)
    heads = slice(lo * d, hi * d)
    qkv, proj = dense.c_attn, dense.c_proj
    held = {"c_attn weight": (sharded.c_attn.weight, qkv.weight[rows]),
            "c_attn bias": (sharded.c_attn.bias, qkv.bias[rows]),
            "c_proj weight": (sharded.c_proj.weight, proj.weight[:, heads]),
            "c_proj bias": (sharded.c_proj.bias, proj.bias)}
    # a K or V row held by every rank gets every rank's use of it: the whole dense gradient
    return compare(held, {"output": (y, dense(x)), "input grad": (x_ours.grad, x_dense.grad),
                          "c_attn weight grad": (sharded.c_attn.weight.grad, qkv.weight.grad[rows]),
                          "c_attn bias grad": (sharded.c_attn.bias.grad, qkv.bias.grad[rows]),
                          "c_proj weight grad": (sharded.c_proj.weight.grad, proj.weight.grad[:, heads]),
                          "c_proj bias grad": (sharded.c_proj.bias.grad, proj.bias.grad)})


@st.composite
def head_counts(draw, tp):
    n_head = draw(st.integers(tp, 8))
    return n_head, draw(st.sampled_from([k for k in range(1, n_head + 1) if n_head % k == 0]))


@settings(max_examples=12)
@given(tp=st.integers(1, 4), data=st.data())
def test_attention_shards_are_the_dense_heads(worlds, tp, data):
    n_head, n_kv_head = data.draw(head_counts(tp))
    d, t = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6))
    for err in worlds[tp].run(check_attention, n_head, n_kv_head, d, t, data.draw(st.integers(0, 2**31))):
        assert err <= 1e-10


#: (tp, n_head, n_kv_head): the layouts where the head arithmetic changes character
HEAD_LAYOUTS = [
    (3, 6, 2), (4, 6, 2),  # fewer KV heads than ranks, a rank's first query head in the middle of a group
    (4, 6, 3),  # fewer KV heads than ranks, groups of 2 split 2, 2, 1, 1
    (3, 8, 2),  # a rank's query heads read their KV heads unevenly (0, 1, 1)
    (4, 8, 1), (2, 3, 1),  # one KV head for all (multi-query), odd query heads per rank
    (3, 8, 4), (2, 6, 3),  # whole query groups, uneven (2, 1, 1) and odd groups
    (4, 6, 6), (3, 4, 4),  # multi-head, uneven heads (2, 2, 1, 1) and (2, 1, 1)
    (4, 4, 2),  # as many query heads as ranks, 2 KV heads
]


def test_attention_shards_in_every_layout_kind(worlds):
    for tp, n_head, n_kv_head in HEAD_LAYOUTS:
        for err in worlds[tp].run(check_attention, n_head, n_kv_head, 2, 5, tp * n_head + n_kv_head):
            assert err <= 1e-10, (tp, n_head, n_kv_head)
