"""Column- and row-parallel linear layers against torch.nn.Linear, on real process groups."""

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tensorpar
from layers import ColumnParallelLinear, RowParallelLinear, parallelize
from reference import DenseMLP
from tensorpar import Shard
from tensorpar.testing import TOLERANCES, assert_close, assert_sharded_equivalent
from tensorpar.testing.strategies import batch_shapes, dtypes, features, tp_sizes


def check_linear(kind, in_f, out_f, batch, dtype, bias, option, seed, device="cpu"):
    torch.manual_seed(seed)
    dense = nn.Linear(in_f, out_f, bias=bias, dtype=dtype, device=device)
    x = torch.randn(*batch, in_f, dtype=dtype, device=device)
    if kind == "column":  # option: gather_output
        sharded = ColumnParallelLinear.from_linear(dense, gather_output=option)
        return assert_sharded_equivalent(sharded, dense, x, output_shard=None if option else Shard(-1, out_f),
                                         seed=seed)
    sharded = RowParallelLinear.from_linear(dense, input_is_parallel=option)  # option: input_is_parallel
    return assert_sharded_equivalent(sharded, dense, x, input_shard=Shard(-1, in_f) if option else None, seed=seed)


def check_mlp(d, hidden, batch, dtype, bias, seed, device="cpu"):
    torch.manual_seed(seed)
    dense = DenseMLP(d, hidden, bias=bias, dtype=dtype).to(device)
    sharded = copy.deepcopy(dense)
    sharded.fc1 = ColumnParallelLinear.from_linear(dense.fc1)
    sharded.fc2 = RowParallelLinear.from_linear(dense.fc2)
    return assert_sharded_equivalent(sharded, dense, torch.randn(*batch, d, dtype=dtype, device=device), seed=seed)


def sized_for(draw, dtype):
    """Batch shape and smallest feature count for ``dtype``.

    bfloat16 keeps 8 bits of mantissa, so one output element whose partial sums
    cancel can be off by tens of percent in both the dense and the sharded
    result. The 2e-2 bound is norm-wise, so bf16 examples draw at least 16 rows
    of at least 8 features, enough elements for the norm to mean something.
    """
    if dtype != torch.bfloat16:
        return draw(batch_shapes()), 1
    return (draw(st.integers(16, 24)), *draw(batch_shapes(max_dims=1))), 8


@st.composite
def linear_cases(draw, kind):
    tp, dtype = draw(tp_sizes()), draw(dtypes())
    batch, least = sized_for(draw, dtype)
    split_in = kind == "row"
    in_f = draw(features(max(least, tp) if split_in else least, 48))
    out_f = draw(features(least if split_in else max(least, tp), 48))
    return tp, (kind, in_f, out_f, batch, dtype, draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 2**31)))


def _worst(results):
    return max(max(r.values()) for r in results)


@settings(max_examples=45)
@given(case=linear_cases("column"))
def test_column_parallel_matches_linear(worlds, case):
    tp, args = case
    assert _worst(worlds[tp].run(check_linear, *args)) <= TOLERANCES[args[4]]


@settings(max_examples=45)
@given(case=linear_cases("row"))
def test_row_parallel_matches_linear(worlds, case):
    tp, args = case
    assert _worst(worlds[tp].run(check_linear, *args)) <= TOLERANCES[args[4]]


@settings(max_examples=45)
@given(tp=tp_sizes(), data=st.data())
def test_column_gelu_row_matches_dense_mlp(worlds, tp, data):
    dtype = data.draw(dtypes(), label="dtype")
    batch, least = sized_for(data.draw, dtype)
    d = data.draw(features(least, 40), label="d")
    hidden = data.draw(features(max(least, tp), 96), label="hidden")  # uneven across tp as often as not
    args = (d, hidden, batch, dtype, data.draw(st.booleans()), data.draw(st.integers(0, 2**31)))
    assert _worst(worlds[tp].run(check_mlp, *args)) <= TOLERANCES[dtype]


def check_optimizer_steps(d, hidden, optimizer, seed):
    torch.manual_seed(seed)
    dense = DenseMLP(d, hidden, dtype=torch.float64)
    sharded = copy.deepcopy(dense)
    parallelize(sharded, {"fc1": "column", "fc2": "row"})
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)}[optimizer]
    opt_dense, opt_sharded = make(dense.parameters()), make(sharded.parameters())
    for _step in range(3):
        x = torch.randn(4, 3, d, dtype=torch.float64)
        for model, opt in ((dense, opt_dense), (sharded, opt_sharded)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    full = tensorpar.full_state_dict(sharded)
    return {k: assert_close(full[k], v, name=k) for k, v in dense.state_dict().items()}


@settings(max_examples=12)
@given(tp=tp_sizes(), d=st.integers(1, 24), extra=st.integers(0, 40), optimizer=st.sampled_from(["sgd", "adamw"]),
       seed=st.integers(0, 2**31))
def test_parameters_after_optimizer_steps_match_dense(worlds, tp, d, extra, optimizer, seed):
    assert _worst(worlds[tp].run(check_optimizer_steps, d, tp + extra, optimizer, seed)) <= 1e-10


def check_to_linear_roundtrip(in_f, out_f, seed):
    torch.manual_seed(seed)
    column, row = ColumnParallelLinear(in_f, out_f), RowParallelLinear(out_f, in_f)
    dense_column, dense_row = column.to_linear(), row.to_linear()
    x = torch.randn(5, in_f)
    h = column(x)  # (5, out_f / tp)
    y_sharded, y_dense = row(h), dense_row(dense_column(x))
    # from_linear(to_linear(m)) gives back this rank's exact shard
    again = ColumnParallelLinear.from_linear(dense_column)
    assert torch.equal(again.weight, column.weight) and torch.equal(again.bias, column.bias)
    return assert_close(y_sharded, y_dense), type(dense_column).__name__, tuple(dense_row.weight.shape)


@settings(max_examples=12)
@given(tp=tp_sizes(), in_f=st.integers(1, 30), extra=st.integers(0, 30), seed=st.integers(0, 2**31))
def test_to_linear_gathers_the_full_layer(worlds, tp, in_f, extra, seed):
    for err, name, shape in worlds[tp].run(check_to_linear_roundtrip, in_f, tp + extra, seed):
        assert err <= 1e-5 and name == "Linear" and shape == (in_f, tp + extra)


def check_repr():
    return repr(ColumnParallelLinear(10, 7)), repr(RowParallelLinear(7, 10, bias=False))


def test_extra_repr_shows_global_and_local_sizes_and_rank(worlds):
    (col0, row0), (col1, row1) = worlds[2].run(check_repr)
    assert "in_features=10, out_features=7" in col0 and "local out_features=4 [0:4] on tp rank 0 of 2" in col0
    assert "local out_features=3 [4:7] on tp rank 1 of 2" in col1 and "gather_output=False" in col1
    assert "bias=False" in row0 and "local in_features=3 [4:7] on tp rank 1 of 2" in row1
    assert "input_is_parallel=True" in row1


def check_parameter_names():
    column = ColumnParallelLinear(6, 4)
    row = RowParallelLinear(4, 6, bias=False)
    return [n for n, _ in column.named_parameters()], [n for n, _ in row.named_parameters()]


def test_parameter_names_are_those_of_nn_linear(worlds):
    for column, row in worlds[2].run(check_parameter_names):
        assert column == ["weight", "bias"] and row == ["weight"]


def check_autocast(tp_kind, d, hidden, seed):
    """fp32 parameters under CPU bf16 autocast, against nn.Linear under the same autocast."""
    torch.manual_seed(seed)
    dense = DenseMLP(d, hidden)
    sharded = copy.deepcopy(dense)
    parallelize(sharded, {"fc1": "column", "fc2": "row"})
    x = torch.randn(16, d)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        errors = assert_sharded_equivalent(sharded, dense, x, rtol=TOLERANCES[torch.bfloat16], seed=seed)
        dtype = sharded(x).dtype
    return dtype, max(errors.values())


@settings(max_examples=6)
@given(tp=tp_sizes(), d=st.integers(8, 32), extra=st.integers(8, 64), seed=st.integers(0, 2**31))
def test_layers_follow_autocast_like_nn_linear(worlds, tp, d, extra, seed):
    for dtype, err in worlds[tp].run(check_autocast, None, d, extra, seed):
        assert dtype == torch.bfloat16 and err <= TOLERANCES[torch.bfloat16]


def check_float64_under_autocast_and_double_backward():
    torch.manual_seed(0)
    column = ColumnParallelLinear(6, 8, dtype=torch.float64)
    row = RowParallelLinear(8, 6, dtype=torch.float64)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast leaves float64 alone, at every tp
        dtype = row(column(x)).dtype
    (dx,) = torch.autograd.grad(row(torch.tanh(column(x))).sum(), x, create_graph=True)
    try:
        dx.pow(2).sum().backward()
        second = None
    except RuntimeError as e:
        second = str(e)
    return dtype, second


def test_float64_under_autocast_and_double_backward_is_refused(worlds):
    for tp in (1, 2):
        for dtype, second in worlds[tp].run(check_float64_under_autocast_and_double_backward):
            assert dtype == torch.float64
            if tp > 1:  # the collectives in backward are not differentiable: say so, never answer wrongly
                assert second and "once_differentiable" in second


def check_gathered_units(in_f, unit, units, seed):
    torch.manual_seed(seed)
    dense = nn.Linear(in_f, unit * units, dtype=torch.float64)
    sharded = ColumnParallelLinear.from_linear(dense, gather_output=True, unit=unit)
    x = torch.randn(3, in_f, dtype=torch.float64)
    return assert_sharded_equivalent(sharded, dense, x, seed=seed)


@settings(max_examples=12)
@given(tp=tp_sizes(), in_f=st.integers(1, 8), unit=st.integers(2, 4), extra=st.integers(0, 5),
       seed=st.integers(0, 2**31))
def test_gather_output_gathers_whole_units(worlds, tp, in_f, unit, extra, seed):
    """``gather_output=True`` with ``unit=k``: the output gathered by the split in whole units (8 features
    in units of 2 over 3 ranks are 4, 2, 2, where the plain split is 3, 3, 2), as nn.Linear's."""
    assert _worst(worlds[tp].run(check_gathered_units, in_f, unit, tp + extra, seed)) <= TOLERANCES[torch.float64]
