"""Sequence parallelism against the unsharded reference GPT, and its parts against plain torch.

The GPT with ``sequence_parallel=True`` must equal the plain ``RefGPT`` of
``tests/reference_gpt.py`` (logits, loss, every gradient, LayerNorm weights
and biases included, and parameters after AdamW steps) at tp 1–4, with drawn
sequence lengths that mostly do not divide by tp (and some shorter than tp,
which leave ranks without tokens). A model whose LayerNorms do not sum their
gradients over the group must fail that comparison.
"""

import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tensorpar
from gpt_cases import batch, gpt_configs, note_errors, twins
from layers import ColumnParallelLinear, ParallelMLP, RowParallelLinear
from layers.sequence import SequenceParallelLayerNorm
from tensorpar.testing import TOLERANCES, assert_all_close, count_collectives
from tensorpar.testing.strategies import tp_sizes
from test_gpt import train_twins


@st.composite
def sequence_cases(draw):
    tp = draw(tp_sizes())
    cfg = draw(gpt_configs(tp))
    lengths = [t for t in range(1, cfg["block_size"] + 1) if t % tp] or [cfg["block_size"]]
    t = draw(st.sampled_from(lengths))  # uneven shards wherever tp > 1
    return tp, cfg, draw(st.integers(1, 3)), t, draw(st.sampled_from([torch.float64, torch.float32])), \
        draw(st.integers(0, 2**31))


@settings(max_examples=14)
@given(case=sequence_cases())
def test_sequence_parallel_gpt_matches_reference(worlds, case):
    tp, cfg, b, t, dtype, seed = case
    results = worlds[tp].run(train_twins, cfg, b, t, dtype, seed, 3, True)
    assert len({digest for _, digest in results}) == 1, "logits or loss differ between tp ranks"
    worst = max(max(errors.values()) for errors, _ in results)
    note_errors(dtype, [worst])
    assert worst <= TOLERANCES[dtype]


def layer_norm_grads(cfg, t, sum_grads):
    """Errors of the LayerNorm gradients of a sequence-parallel GPT whose LayerNorms do (or do not)
    sum their gradients over the tp group."""
    ref, model = twins(cfg, torch.float64, 0, sequence_parallel=True)
    if not sum_grads:
        for m in model.modules():
            if isinstance(m, SequenceParallelLayerNorm):
                m.forward = lambda x, seq_len=None, m=m: torch.nn.LayerNorm.forward(m, x)  # the common bug: plain
    idx, targets = batch(cfg, 2, t, 0)
    model(idx, targets).backward()
    ref(idx, targets).backward()
    grads = tensorpar.full_grads(model)
    return {k: ((grads[k] - p.grad).norm() / p.grad.norm()).item() for k, p in ref.named_parameters() if "ln" in k}


def test_a_layer_norm_without_its_gradient_sum_is_caught(worlds):
    cfg = dict(n_layer=2, n_head=3, n_kv_head=3, n_embd=12, vocab_size=29, block_size=16, bias=True, mlp="gelu")
    right = worlds[3].run(layer_norm_grads, cfg, 11, True)[0]
    wrong = worlds[3].run(layer_norm_grads, cfg, 11, False)[0]
    assert max(right.values()) <= 1e-10, right
    assert set(right) == set(wrong) and len(wrong) == 2 * 2 * cfg["n_layer"] + 2  # ln_1, ln_2 per block; ln_f
    assert min(wrong.values()) > 0.05, f"a missing LayerNorm gradient sum went unnoticed: {wrong}"


def sequence_mlp(h, t, b, seq_len_given, seed):
    """A column -> GELU -> row MLP with sequence-parallel layers against nn.Linear, on this rank's tokens."""
    torch.manual_seed(seed)
    dense = torch.nn.Sequential(torch.nn.Linear(h, 2 * h + 1), torch.nn.GELU(), torch.nn.Linear(2 * h + 1, h)).double()
    fc1 = ColumnParallelLinear.from_linear(dense[0], sequence_parallel=True)
    fc2 = RowParallelLinear.from_linear(dense[2], sequence_parallel=True)
    x = torch.randn(b, t, h, dtype=torch.float64, requires_grad=True)
    shard = tensorpar.scatter_sequence(x.detach()).requires_grad_()
    y = fc2(F.gelu(fc1(shard, t if seq_len_given else None)))  # (b, t_r, h)
    ref = dense(x)
    dy = torch.randn_like(ref)
    y.backward(tensorpar.scatter_sequence(dy))
    ref.backward(dy)
    full_y = tensorpar.gather_sequence(y.detach(), t)
    full_dx = tensorpar.gather_sequence(shard.grad, t)
    grads1, grads2 = tensorpar.full_grads(fc1), tensorpar.full_grads(fc2)
    pairs = {"output": (full_y, ref), "input grad": (full_dx, x.grad),
             "fc1 weight grad": (grads1["weight"], dense[0].weight.grad),
             "fc1 bias grad": (grads1["bias"], dense[0].bias.grad),
             "fc2 weight grad": (grads2["weight"], dense[2].weight.grad),
             "fc2 bias grad": (fc2.bias.grad, dense[2].bias.grad)}
    return max(assert_all_close(pairs, what="sequence-parallel MLP").values())


@settings(max_examples=10)
@given(tp=tp_sizes(), h=st.integers(2, 9), t=st.integers(1, 11), b=st.integers(1, 2), given_len=st.booleans(),
       seed=st.integers(0, 2**31))
@example(tp=4, h=3, t=7, b=1, given_len=False, seed=0)  # 7 tokens over 4 ranks: 2, 2, 2, 1
@example(tp=3, h=4, t=2, b=2, given_len=True, seed=1)  # fewer tokens than ranks: 1, 1, 0
@example(tp=4, h=2, t=1, b=1, given_len=False, seed=2)  # one token: 1, 0, 0, 0
@example(tp=2, h=5, t=5, b=1, given_len=True, seed=3)  # 3, 2
def test_sequence_parallel_linear_layers_match_nn_linear(worlds, tp, h, t, b, given_len, seed):
    assert max(worlds[tp].run(sequence_mlp, h, t, b, given_len, seed)) <= 1e-10


def checkpointed_against_plain(cfg, t, seed):
    """A sequence-parallel GPT with dropout, with and without activation checkpointing: the same
    loss and gradients (the recomputation draws each rank's masks again from its tp stream)."""
    results = []
    for checkpointing in (False, True):
        _, model = twins(cfg, torch.float64, seed, sequence_parallel=True, dropout=0.2)
        model.config.activation_checkpointing = checkpointing
        idx, targets = batch(cfg, 2, t, seed)
        tensorpar.manual_seed(seed)
        loss = model(idx, targets)
        loss.backward()
        results.append((loss.detach(), tensorpar.full_grads(model)))
    (loss, grads), (loss_ac, grads_ac) = results
    pairs = {"loss": (loss_ac, loss)} | {f"grad {k}": (grads_ac[k], g) for k, g in grads.items() if g.norm() > 0}
    return max(assert_all_close(pairs, what="checkpointed sequence-parallel GPT").values())


@settings(max_examples=3)
@given(tp=st.integers(2, 4), data=st.data())
def test_sequence_parallel_with_activation_checkpointing_changes_nothing(worlds, tp, data):
    cfg = data.draw(gpt_configs(tp, max_layer=2))
    t = data.draw(st.integers(1, cfg["block_size"]))
    assert max(worlds[tp].run(checkpointed_against_plain, cfg, t, data.draw(st.integers(0, 2**31)))) <= 1e-12


def shard_saving_cases():
    """What a sequence-parallel SwiGLU MLP keeps for backward: under bf16 autocast, over two backward
    passes of one graph, and after an in-place change of an input that needs no gradient."""
    mesh = tensorpar.current_mesh()
    torch.manual_seed(0)
    mlp = ParallelMLP(8, 30, activation="swiglu", sequence_parallel=True)  # 15 hidden features per rank
    t, local = 7, tensorpar.sequence_sizes(7, mesh.tp)[mesh.tp_rank]
    found, shapes = {}, []

    def pack(x):
        shapes.append(tuple(x.shape))
        return x

    h = torch.randn(2, local, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        y = mlp(h, t)
    y.float().sum().backward()
    # the tokens of every activation 8 wide (the input's width) kept: this rank's, never the whole sequence
    found["tokens kept"] = max(math.prod(s[:-1]) for s in shapes if s[-1] == 8 and s != (15, 8))  # not weights

    with count_collectives() as counts:
        y = mlp(h, t)
        y.sum().backward(retain_graph=True)
        y.sum().backward()
    found["gathers per backward"] = counts.count("all_gather", "backward") / 2  # the row layer's, and one again

    frozen = torch.randn(2, local, 8)  # needs no gradient; the weights still do
    z = mlp(frozen, t)
    frozen.mul_(2)
    try:
        z.sum().backward()
        found["in-place"] = "no error"
    except RuntimeError as e:
        found["in-place"] = str(e)

    gathered = tensorpar.all_gather_sequence(h, t)  # (2, 7, 8)
    kept = weakref.ref(gathered)
    with tensorpar.save_sequence_shard(gathered, h):
        y = torch.nn.functional.linear(gathered, mlp.c_fc.weight[:, :8])
    del gathered
    found["gathered kept until backward"] = kept() is not None  # the hook holds this rank's tokens only
    y.sum().backward()
    return found


def test_the_kept_shard_under_autocast_two_backward_passes_and_in_place_changes(worlds):
    for rank, found in enumerate(worlds[2].run(shard_saving_cases)):
        assert found["tokens kept"] == 2 * (4, 3)[rank], found  # 7 tokens: 4 + 3
        assert found["gathers per backward"] == 2, found
        assert "modified in place" in found["in-place"], found
        assert not found["gathered kept until backward"], found


def unbalanced_shards():
    mesh = tensorpar.current_mesh()
    x = torch.randn(2, (3, 3, 1)[mesh.tp_rank], 8, requires_grad=True)  # 7 tokens, split 3/3/1, not 3/2/2
    try:
        ParallelMLP(8, 12, sequence_parallel=True)(x)
    except ValueError as e:
        return str(e)
    return None


def test_unbalanced_shards_and_contradictory_options_are_refused_clearly(worlds):
    for error in worlds[3].run(unbalanced_shards):
        assert error == ("the ranks hold [3, 3, 1] tokens, which is not the balanced split of 7 tokens over 3 "
                         "ranks ([3, 2, 2])"), error
    with pytest.raises(ValueError, match="sequence_parallel=True gathers the tokens itself"):
        ColumnParallelLinear(4, 4, copy_input=False, sequence_parallel=True)  # raised before any group is needed
