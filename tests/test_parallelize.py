"""parallelize(model, plan): swap dense layers for their sharded twins in place, by name or glob."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tensorpar
import tensorpar.testing
from layers import ColumnParallelLinear, HeadRow, QKVColumn, RowParallelLinear, parallelize
from reference import DenseMLP
from tensorpar.testing import assert_sharded_equivalent
from tensorpar.testing.strategies import tp_sizes


class Toy(nn.Module):
    """Embedding -> residual MLP blocks -> head: a dense model to convert."""

    def __init__(self, vocab, d, hidden, n_blocks):
        super().__init__()
        self.embed = nn.Linear(vocab, d)
        self.blocks = nn.ModuleList(DenseMLP(d, hidden, dtype=torch.float64) for _ in range(n_blocks))
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def check_parallelized_toy(d, hidden, n_blocks, seed):
    torch.manual_seed(seed)
    dense = Toy(5, d, hidden, n_blocks).double()
    model = parallelize(copy.deepcopy(dense), {"blocks.*.fc1": "column", "blocks.*.fc2": RowParallelLinear})
    kinds = [type(m).__name__ for m in model.modules()]
    errors = assert_sharded_equivalent(model, dense, torch.randn(3, 4, 5, dtype=torch.float64), seed=seed)
    return kinds.count("ColumnParallelLinear"), kinds.count("RowParallelLinear"), kinds.count("Linear"), errors


@settings(max_examples=10)
@given(tp=tp_sizes(), d=st.integers(1, 12), extra=st.integers(0, 20), n_blocks=st.integers(1, 3),
       seed=st.integers(0, 2**31))
def test_parallelize_by_glob_matches_the_dense_model(worlds, tp, d, extra, n_blocks, seed):
    for columns, rows, linears, errors in worlds[tp].run(check_parallelized_toy, d, tp + extra, n_blocks, seed):
        assert (columns, rows, linears) == (n_blocks, n_blocks, 2)  # embed and head stay dense
        assert max(errors.values()) <= 1e-10


def plan_errors(cases):
    """The error each ``(model, plan)`` of ``cases`` gets from parallelize, as ``"Kind: message"``."""
    messages = []
    for model, plan in cases:
        try:
            parallelize(model, plan)
        except (ValueError, TypeError) as e:
            messages.append(f"{type(e).__name__}: {e}")
    return messages


def check_plan_errors():
    model = Toy(5, 4, 8, 1)
    plans = ({"blocks.*.nope": "column"}, {"head": "diagonal"}, {"blocks.0": "column"},
             {"blocks.*.fc1": "column", "blocks.0.*": "row"}, {"head": 42})
    return plan_errors((model, plan) for plan in plans)


def test_bad_plans_get_clear_errors(worlds):
    messages = worlds[2].run(check_plan_errors)[0]
    assert len(messages) == 5, messages
    assert "'blocks.*.nope' matches no submodule of Toy" in messages[0]
    assert "unknown parallel style 'diagonal'" in messages[1] and "column, embedding, row" in messages[1]
    assert messages[2].startswith("TypeError: cannot parallelize 'blocks.0'") and "DenseMLP" in messages[2]
    assert "matched by both" in messages[3]
    assert messages[4].startswith("TypeError: a plan value must be")


def check_custom_converter():
    model = DenseMLP(4, 6)
    parallelize(model, {"fc1": lambda m: ColumnParallelLinear.from_linear(m, gather_output=True)})
    return model.fc1.gather_output, tuple(model.fc1(torch.randn(2, 4)).shape)


def test_a_callable_style_builds_the_replacement(worlds):
    assert worlds[2].run(check_custom_converter) == [(True, (2, 6))] * 2


def test_from_linear_rejects_other_modules(worlds):
    with pytest.raises(tensorpar.RankError, match=r"expects an nn.Linear, got Conv1d"):
        worlds[1].run(ColumnParallelLinear.from_linear, nn.Conv1d(2, 2, 1))


def check_parallelized_embedding(vocab, d, seed):
    torch.manual_seed(seed)
    dense = nn.Sequential(nn.Embedding(vocab, d, dtype=torch.float64), DenseMLP(d, 2 * d, dtype=torch.float64))
    model = parallelize(copy.deepcopy(dense), {"0": "embedding", "1.fc1": "column", "1.fc2": "row"})
    ids = torch.randint(0, vocab, (3, 4))
    y, y_dense = model(ids), dense(ids)
    y.sum().backward()
    y_dense.sum().backward()
    grads = tensorpar.full_grads(model)
    return type(model[0]).__name__, max(tensorpar.testing.rel_error(grads[k], p.grad, 1.0)
                                        for k, p in dense.named_parameters()), tensorpar.testing.rel_error(y, y_dense)


@settings(max_examples=6)
@given(tp=tp_sizes(), vocab=st.integers(4, 40), d=st.integers(2, 10), seed=st.integers(0, 2**31))
def test_parallelize_swaps_embeddings_by_the_embedding_style(worlds, tp, vocab, d, seed):
    for kind, grad_err, out_err in worlds[tp].run(check_parallelized_embedding, vocab, d, seed):
        assert kind == "VocabParallelEmbedding" and grad_err <= 1e-10 and out_err <= 1e-10


class NanoAttention(nn.Module):
    """nanoGPT's CausalSelfAttention (the SDPA path), written plainly. Its head width and output width
    come from ``self.n_head`` and ``self.n_embd`` (nanoGPT takes them from the input's C)."""

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, dtype=torch.float64)
        self.c_proj = nn.Linear(n_embd, n_embd, dtype=torch.float64)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, _C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        hs = self.n_embd // self.n_head
        q, k, v = (z.view(B, T, self.n_head, hs).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_embd)
        return self.c_proj(y)


class NanoBlock(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, dtype=torch.float64)
        self.attn = NanoAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd, dtype=torch.float64)
        self.mlp = DenseMLP(n_embd, 4 * n_embd, dtype=torch.float64)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def check_nano_block(n_head, head_dim, t, seed):
    torch.manual_seed(seed)
    dense = NanoBlock(n_head * head_dim, n_head)
    with torch.no_grad():  # nonzero LayerNorm parameters, so their gradients are checked through every path
        for p in dense.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model = parallelize(copy.deepcopy(dense), {"attn.c_attn": QKVColumn(n_head), "attn.c_proj": HeadRow(n_head),
                                               "mlp.fc1": "column", "mlp.fc2": "row"})
    errors = assert_sharded_equivalent(model, dense, torch.randn(2, t, n_head * head_dim, dtype=torch.float64),
                                       seed=seed)
    full = tensorpar.full_state_dict(model)
    same = {k: full[k].shape == v.shape and torch.equal(full[k], v) for k, v in dense.state_dict().items()}
    attn = model.attn
    return errors, sorted(full) == sorted(dense.state_dict()) and all(same.values()), \
        (attn.n_head, attn.n_embd, tuple(attn.c_attn.weight.shape), tuple(attn.c_proj.weight.shape))


@settings(max_examples=8)
@given(tp=tp_sizes(), extra=st.integers(0, 3), head_dim=st.integers(1, 4), t=st.integers(1, 6),
       seed=st.integers(0, 2**31))
def test_qkv_column_splits_nanogpt_attention_by_whole_heads(worlds, tp, extra, head_dim, t, seed):
    n_head = tp + extra  # at least one head per rank, often uneven
    results = worlds[tp].run(check_nano_block, n_head, head_dim, t, seed)
    heads = [n_head // tp + (r < n_head % tp) for r in range(tp)]  # balanced: 4 heads at tp=3 are 2, 1, 1
    c = n_head * head_dim
    for rank, (errors, state_matches, local) in enumerate(results):
        assert max(errors.values()) <= 1e-10, errors  # float64
        assert state_matches  # nanoGPT's keys and shapes, with the dense values
        width = heads[rank] * head_dim
        assert local == (heads[rank], width, (3 * width, c), (c, width))


def check_qkv_column_errors():
    return plan_errors([(NanoBlock(8, 4), {"attn.c_attn": QKVColumn(3)}),  # 8 features are not 3 heads
                        (NanoBlock(8, 4), {"attn.c_proj": HeadRow(3)}),
                        (NanoBlock(8, 4), {"attn.c_attn": QKVColumn(4, heads_attr="heads")}),
                        (NanoBlock(8, 4), {"attn": QKVColumn(4)}),
                        (NanoBlock(2, 1), {"attn.c_attn": QKVColumn(1)})])  # 1 head at tp=2


def test_qkv_column_errors_name_the_numbers(worlds):
    messages = worlds[2].run(check_qkv_column_errors)[0]
    assert len(messages) == 5, messages
    assert messages[0] == ("ValueError: cannot parallelize 'attn.c_attn': QKVColumn: 8 features are not a whole "
                           "number of 3 heads")
    assert messages[1] == ("ValueError: cannot parallelize 'attn.c_proj': HeadRow: 8 features are not a whole "
                           "number of 3 heads")
    assert "NanoAttention has no attribute 'heads' to set to this rank's 2" in messages[2]
    assert messages[3] == "TypeError: cannot parallelize 'attn': QKVColumn expects an nn.Linear, got NanoAttention"
    assert messages[4].startswith("ValueError: cannot parallelize 'attn.c_attn'") and "smaller than tp (2)" in \
        messages[4]
