"""parallelize(model, plan): swap dense layers for their sharded twins in place, by name or glob."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import DenseMLP
from torch import nn

import tensorpar
import tensorpar.testing
from layers import ColumnParallelLinear, RowParallelLinear, parallelize
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


def check_plan_errors():
    model = Toy(5, 4, 8, 1)
    messages = []
    for plan in ({"blocks.*.nope": "column"}, {"head": "diagonal"}, {"blocks.0": "column"},
                 {"blocks.*.fc1": "column", "blocks.0.*": "row"}, {"head": 42}):
        try:
            parallelize(model, plan)
        except (ValueError, TypeError) as e:
            messages.append(f"{type(e).__name__}: {e}")
    return messages


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
