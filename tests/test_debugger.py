"""The equivalence debugger (tensorpar.testing.find_divergence): silent on correct models, and on
each planted fault it names the module where the fault is and says what kind of fault it is.

The dense twins are plain torch.nn models; the faults are planted in the sharded copy only."""

import copy
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tensorpar
from gpt_cases import batch, twins
from layers import ColumnParallelLinear, RowParallelLinear, parallelize
from tensorpar.testing import find_divergence
from tensorpar.testing.strategies import tp_sizes


def mlp_twins(d, hidden, seed, *, bias=True):
    """A dense LayerNorm -> Linear -> GELU -> Linear and its sharded copy (column, then row)."""
    torch.manual_seed(seed)
    dense = nn.Sequential(OrderedDict(ln=nn.LayerNorm(d), fc1=nn.Linear(d, hidden, bias=bias), act=nn.GELU(),
                                      fc2=nn.Linear(hidden, d, bias=bias))).double()
    with torch.no_grad():  # a LayerNorm that is not the identity's affine part
        dense.ln.weight.add_(0.1 * torch.randn(d, dtype=torch.float64))
        dense.ln.bias.add_(0.1 * torch.randn(d, dtype=torch.float64))
    return dense, parallelize(copy.deepcopy(dense), {"fc1": "column", "fc2": "row"})


def mlp_input(d, seed):
    return torch.randn(3, 4, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))


class DoubledF(ColumnParallelLinear):
    """Fault: f applied to the input a second time (its gradient all-reduced twice)."""

    def forward(self, x):
        return super().forward(tensorpar.copy_to_tp(x, self.tp_group))


class DoubledG(RowParallelLinear):
    """Fault: the partial products are all-reduced, then the sum is all-reduced again."""

    def forward(self, x):
        return tensorpar.reduce_from_tp(super().forward(x), self.tp_group)


class MissingG(RowParallelLinear):
    """Fault: the partial products are never all-reduced (the bias is still added)."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RankDependentFlow(nn.Module):
    """Fault: rank 1 calls its submodule once more than the others (no collective inside)."""

    def __init__(self, d):
        super().__init__()
        self.inner = nn.Linear(d, d, dtype=torch.float64)

    def forward(self, x):
        y = self.inner(x)
        return self.inner(y) if tensorpar.current_mesh().tp_rank == 1 else y


def check_clean_mlp(d, hidden, bias, classes, seed):
    """The MLP, then (``classes``) a column-parallel head whose output stays split, under a
    cross-entropy loss (the debugger gathers the split output for the loss)."""
    dense, sharded = mlp_twins(d, hidden, seed, bias=bias)
    if not classes:
        return find_divergence(sharded, dense, mlp_input(d, seed))
    dense.add_module("head", nn.Linear(d, classes, dtype=torch.float64))
    sharded.add_module("head", ColumnParallelLinear.from_linear(dense.head))
    target = torch.randint(0, classes, (3, 4), generator=torch.Generator().manual_seed(seed))
    return find_divergence(sharded, dense, mlp_input(d, seed), target=target,
                           loss_fn=lambda y, t: F.cross_entropy(y.flatten(0, -2), t.flatten()))


def check_clean_gpt(cfg, seed, with_targets):
    dense, sharded = twins(cfg, torch.float64, seed)
    idx, targets = batch(cfg, 2, cfg["block_size"], seed)
    return find_divergence(sharded, dense, idx, *([targets] if with_targets else []))


def plant(fault, seed):
    """A sharded MLP with ``fault`` planted, checked against its dense twin."""
    tp, rank = tensorpar.current_mesh().tp, tensorpar.current_mesh().tp_rank
    d, hidden = 5, 2 * tp + (tp > 2)  # tp 3: 7 hidden features, shards 3 | 2 | 2
    dense, sharded = mlp_twins(d, hidden, seed, bias=fault != "missing g, no bias")
    if fault == "doubled f":
        sharded.fc1.__class__ = DoubledF
    elif fault == "doubled g":
        sharded.fc2.__class__ = DoubledG
    elif fault.startswith("missing g"):
        sharded.fc2.__class__ = MissingG
    elif fault == "missing f":
        sharded.fc1 = ColumnParallelLinear.from_linear(dense.fc1, copy_input=False)
    elif fault == "wrong offset":  # rank r loads the rows of rank r + 1's shard
        take, length = tensorpar.partition_bounds(hidden, tp, (rank + 1) % tp)[0], sharded.fc1.local_features
        with torch.no_grad():
            sharded.fc1.weight.copy_(dense.fc1.weight[take:take + length])
            sharded.fc1.bias.copy_(dense.fc1.bias[take:take + length])
    elif fault == "replicated differs":
        with torch.no_grad():
            if rank == 1:
                sharded.ln.weight[0] += 0.5
    return find_divergence(sharded, dense, mlp_input(d, seed))


def check_gpt_wrong_heads(seed):
    """A tiny GPT whose block 0 holds the next rank's heads of Q, K and V (weights and bias)."""
    cfg = dict(n_layer=2, n_head=4, n_embd=8, vocab_size=13, block_size=6, bias=True, mlp="gelu")
    dense, sharded = twins(cfg, torch.float64, seed)
    mesh, qkv = tensorpar.current_mesh(), sharded.transformer.h[0].attn.c_attn
    with torch.no_grad():
        for name in ("weight", "bias"):
            full = getattr(dense.transformer.h[0].attn.c_attn, name)
            getattr(qkv, name).copy_(tensorpar.shard(full, qkv.placement, mesh.tp, (mesh.tp_rank + 1) % mesh.tp))
    idx, _ = batch(cfg, 2, cfg["block_size"], seed)
    return find_divergence(sharded, dense, idx)


def check_control_flow():
    torch.manual_seed(0)
    dense = RankDependentFlow(3)
    sharded = copy.deepcopy(dense)
    try:
        find_divergence(sharded, dense, torch.randn(2, 3, dtype=torch.float64), group=tensorpar.tp_group())
    except RuntimeError as e:
        return str(e)
    return None


def reports(worlds, tp, fn, *args):
    """The report of every rank (they must be the same), printed once."""
    found = worlds[tp].run(fn, *args)
    assert all(r == found[0] for r in found), "ranks disagree on the report"
    print(f"\n--- {fn.__name__}{args} at tp={tp}\n{found[0]}")
    return found[0]


@settings(max_examples=8)
@given(tp=tp_sizes(), d=st.integers(3, 7), extra=st.integers(0, 6), bias=st.booleans(),
       classes=st.sampled_from([0, 5, 9]), seed=st.integers(0, 2**31))
def test_a_correct_sharded_mlp_has_no_finding(worlds, tp, d, extra, bias, classes, seed):
    report = worlds[tp].run(check_clean_mlp, d, tp + extra, bias, classes, seed)[0]
    assert report.ok, str(report)
    assert report.compared["forward output"] >= 5 and report.compared["parameter gradient"] >= 4


@pytest.mark.parametrize("tp", [2, 3])
def test_a_correct_gpt_has_no_finding(worlds, tp):
    """Vocab-parallel lookups are partial sums until their g: by design, not a finding."""
    cfg = dict(n_layer=1, n_head=4, n_kv_head=2, n_embd=8, vocab_size=13, block_size=5, bias=True, mlp="swiglu")
    for with_targets in (False, True):
        report = reports(worlds, tp, check_clean_gpt, cfg, 3, with_targets)
        assert report.ok and report.compared["backward gradient"] > 10


@pytest.mark.parametrize("tp", [2, 3])
def test_doubled_f_is_a_tp_times_gradient_at_that_layer(worlds, tp):
    report = reports(worlds, tp, plant, "doubled f", 1)
    assert report.first_forward is None
    first = report.first_backward
    assert (first.module, first.what, first.ranks) == ("fc1", "input gradient", tuple(range(tp)))
    assert "gradient is tp× too large: a doubled f/g" in first.diagnosis
    ln_grads = [f for f in report.findings if f.phase == "parameter gradient" and f.module == "ln"]
    assert len(ln_grads) == 2 and all("tp× too large" in f.diagnosis for f in ln_grads)


@pytest.mark.parametrize("tp", [2, 3])
def test_doubled_g_is_a_tp_times_output_at_that_layer(worlds, tp):
    report = reports(worlds, tp, plant, "doubled g", 7)
    first = report.first_forward
    assert (first.module, first.what, first.ranks) == ("fc2", "output", tuple(range(tp)))
    assert first.diagnosis == "output is tp× too large: a doubled f/g (an all-reduce applied twice)"


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("fault", ["missing g", "missing g, no bias"])
def test_missing_g_is_a_forward_divergence_at_that_layer(worlds, tp, fault):
    report = reports(worlds, tp, plant, fault, 2)
    first = report.first_forward
    assert (first.module, first.phase, first.what) == ("fc2", "forward output", "output")
    assert "a missing f/g: the reduction over the tp group was not applied" in first.diagnosis
    assert ("bias added" in first.diagnosis) == (fault == "missing g")


@pytest.mark.parametrize("tp", [2, 3])
def test_missing_f_is_a_partial_input_gradient_at_that_layer(worlds, tp):
    report = reports(worlds, tp, plant, "missing f", 3)
    assert report.first_forward is None
    first = report.first_backward
    assert (first.module, first.what) == ("fc1", "input gradient")
    assert "only this rank's part" in first.diagnosis and "a missing f/g" in first.diagnosis
    ln_grads = [f for f in report.findings if f.phase == "parameter gradient" and f.module == "ln"]
    assert ln_grads and all("a missing f/g" in f.diagnosis for f in ln_grads)


@pytest.mark.parametrize("tp", [2, 3])
def test_a_shard_at_the_wrong_offset_is_named_with_both_offsets(worlds, tp):
    report = reports(worlds, tp, plant, "wrong offset", 4)
    bounds = [tensorpar.partition_bounds(2 * tp + (tp > 2), tp, r) for r in range(tp)]
    expected = "; ".join(f"rank {r} holds the shard for offset {bounds[(r + 1) % tp][0]}:"
                         f"{bounds[(r + 1) % tp][0] + n} but sits at {o}:{o + n}" for r, (o, n) in enumerate(bounds))
    first = report.first_forward
    assert (first.module, first.what, first.diagnosis) == ("fc1", "output", expected)
    params = {f.what: f.diagnosis for f in report.findings if f.phase == "parameter"}
    assert params == {"weight": expected, "bias": expected}


@pytest.mark.parametrize("tp", [2, 3])
def test_a_replicated_parameter_that_differs_on_rank_1(worlds, tp):
    report = reports(worlds, tp, plant, "replicated differs", 5)
    first = report.first_forward
    assert (first.module, first.ranks) == ("ln", (1,))
    assert first.diagnosis.startswith("replicated tensor differs across ranks: rank 1 vs rank 0, rel err")
    (param,) = [f for f in report.findings if f.phase == "parameter"]
    assert (param.module, param.what, param.ranks) == ("ln", "weight", (1,))
    assert param.diagnosis.startswith("replicated tensor differs across ranks: rank 1 vs rank 0, rel err")


def test_gpt_query_heads_at_the_wrong_offset(worlds):
    report = reports(worlds, 2, check_gpt_wrong_heads, 6)
    first = report.first_forward
    assert (first.module, first.what) == ("transformer.h.0.attn.c_attn", "output")
    expected = ("rank 0 holds the shard for offset 4:8 but sits at 0:4; rank 1 holds the shard for offset 0:4 but sits "
                "at 4:8 (of each of 3 blocks)")
    assert first.diagnosis == expected
    params = {f.what: f.diagnosis for f in report.findings
              if f.phase == "parameter" and f.module == "transformer.h.0.attn.c_attn"}
    assert params == {"weight": expected, "bias": expected}


@pytest.mark.parametrize("tp", [2, 3])
def test_ranks_that_run_different_modules_raise_instead_of_hanging(worlds, tp):
    messages = worlds[tp].run(check_control_flow)
    for rank, message in enumerate(messages):
        assert message.startswith(f"rank {rank}: the ranks ran different forward passes")
        assert "first differ at call 1" in message
    assert "where this rank ran inner#1" in messages[1] and "where this rank ran <model>#0" in messages[0]
