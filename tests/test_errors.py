"""Bad input gets a clear error naming the numbers, on every rank alike (so no rank hangs)."""

import pytest
import torch
from torch import nn

import tensorpar
from layers import (
    GPT,
    Block,
    ColumnParallelLinear,
    GPTConfig,
    ParallelMLP,
    ParallelSelfAttention,
    ReplicatedLinear,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)


def _message(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def check_bad_inputs():
    column = ColumnParallelLinear(8, 6)
    row = RowParallelLinear(6, 8)
    row_full = RowParallelLinear(6, 8, input_is_parallel=False)
    cases = {
        "out smaller than tp": lambda: ColumnParallelLinear(8, 1),
        "in smaller than tp": lambda: RowParallelLinear(1, 8),
        "zero features": lambda: ColumnParallelLinear(0, 8),
        "wrong width": lambda: column(torch.randn(3, 5)),
        "scalar input": lambda: column(torch.tensor(1.0)),
        "full input to a parallel row": lambda: row(torch.randn(2, 6)),
        "shard to a full-input row": lambda: row_full(torch.randn(2, 3)),
        "dtype mix": lambda: column(torch.randn(2, 8, dtype=torch.float64)),
        "device mix": lambda: column(torch.randn(2, 8, device="meta")),
        "not a tensor": lambda: column([1.0] * 8),
        "bool as a size": lambda: ColumnParallelLinear(True, 8),
        "bool embedding size": lambda: VocabParallelEmbedding(8, True),
        "bool head count": lambda: ParallelSelfAttention(16, True),
        "bool mlp width": lambda: ParallelMLP(True, 8),
        "bool replicated size": lambda: ReplicatedLinear(8, True),
        "float unit": lambda: RowParallelLinear(8, 6, unit=2.5),
        "integer input to attention": lambda: ParallelSelfAttention(16, 4)(torch.ones(2, 3, 16, dtype=torch.long)),
        "integer input to an mlp": lambda: ParallelMLP(16, 32)(torch.ones(2, 3, 16, dtype=torch.int32)),
        "bool input to a block": lambda: Block(GPTConfig(n_embd=16, n_head=4))(torch.ones(2, 3, 16, dtype=torch.bool)),
        "integer input to a column": lambda: column(torch.ones(2, 8, dtype=torch.int64)),
        "integer input to a row": lambda: row(torch.ones(2, 3, dtype=torch.int16)),
        "integer input to a replicated linear": lambda: ReplicatedLinear(8, 4)(torch.ones(2, 8, dtype=torch.uint8)),
    }
    return {name: _message(fn) for name, fn in cases.items()}


def test_bad_input_gets_a_clear_error(worlds):
    messages = worlds[2].run(check_bad_inputs)
    assert messages[0] == messages[1]
    m = messages[0]
    assert m["out smaller than tp"] == "ValueError: out_features (1) is smaller than tp (2)"
    assert m["in smaller than tp"] == "ValueError: in_features (1) is smaller than tp (2)"
    assert m["zero features"] == "ValueError: ColumnParallelLinear: in_features must be a positive integer, got 0"
    assert m["wrong width"] == ("ValueError: ColumnParallelLinear expects an input with 8 features in its last dim, "
                                "got shape (3, 5)")
    assert m["scalar input"].startswith("ValueError: ColumnParallelLinear expects an input with 8 features")
    assert m["full input to a parallel row"] == (
        "ValueError: RowParallelLinear expects this rank's input slice (6 in_features over tp 2; "
        "input_is_parallel=True) with 3 features in its last dim, got shape (2, 6)")
    assert m["shard to a full-input row"].startswith("ValueError: RowParallelLinear expects an input with 6 features")
    assert m["dtype mix"] == ("TypeError: ColumnParallelLinear: input dtype torch.float64 does not match "
                              "the weight dtype torch.float32")
    assert m["device mix"] == "TypeError: ColumnParallelLinear: input is on meta but the weight is on cpu"
    assert m["not a tensor"] == "TypeError: ColumnParallelLinear expects a tensor, got list"
    for case, what in (("bool as a size", "ColumnParallelLinear: in_features"),
                       ("bool embedding size", "VocabParallelEmbedding: embedding_dim"),
                       ("bool head count", "ParallelSelfAttention: n_head"), ("bool mlp width", "ParallelMLP: n_embd"),
                       ("bool replicated size", "ReplicatedLinear: out_features")):
        assert m[case] == f"TypeError: {what} must be a positive integer, got True"
    assert m["float unit"] == "TypeError: RowParallelLinear: unit must be a positive integer, got 2.5"
    for case, layer, dtype in (("integer input to attention", "ParallelSelfAttention", "int64"),
                               ("integer input to an mlp", "ParallelMLP", "int32"),
                               ("bool input to a block", "Block", "bool"),
                               ("integer input to a column", "ColumnParallelLinear", "int64"),
                               ("integer input to a row", "RowParallelLinear", "int16"),
                               ("integer input to a replicated linear", "ReplicatedLinear", "uint8")):
        assert m[case] == f"TypeError: {layer}: input dtype torch.{dtype} is not a floating-point dtype"


def check_too_small_for_tp4():
    return _message(lambda: ColumnParallelLinear(16, 3))


def test_size_smaller_than_tp_at_tp4(worlds):
    assert worlds[4].run(check_too_small_for_tp4) == ["ValueError: out_features (3) is smaller than tp (4)"] * 4


def check_gpt_bad_inputs():
    small = dict(vocab_size=37, n_layer=1, n_head=4, n_embd=16, block_size=8)
    model = GPT(GPTConfig(**small))
    ids = torch.zeros(2, 8, dtype=torch.long)
    cases = {
        "n_embd not divisible": lambda: GPTConfig(n_embd=10, n_head=4),
        "n_head not divisible by kv": lambda: GPTConfig(n_embd=12, n_head=6, n_kv_head=4),
        "n_head smaller than tp": lambda: GPT(GPTConfig(**(small | dict(n_head=2, n_embd=16)))),
        "vocab smaller than tp": lambda: GPT(GPTConfig(**(small | dict(vocab_size=3)))),
        "sequence too long": lambda: model(torch.zeros(2, 9, dtype=torch.long)),
        "token id too large": lambda: model(ids.index_fill(1, torch.tensor([3]), 37)),
        "negative token id": lambda: model(ids.index_fill(1, torch.tensor([3]), -1)),
        "target too large": lambda: model(ids, ids.index_fill(1, torch.tensor([5]), 40)),
        "float ids": lambda: model.transformer.wte(torch.zeros(3)),
        "1-D ids": lambda: model(torch.zeros(8, dtype=torch.long)),
        "bad mlp": lambda: GPTConfig(mlp="relu"),
        "zero kv heads": lambda: GPTConfig(n_kv_head=0),
        "attention width": lambda: ParallelSelfAttention(16, 4)(torch.randn(2, 3, 12)),
        "padded embedding": lambda: VocabParallelEmbedding.from_embedding(nn.Embedding(9, 4, padding_idx=0)),
        "loss vocab mismatch": lambda: tensorpar.vocab_parallel_cross_entropy(torch.randn(3, 5), ids[0, :3], 37),
        "bool n_head": lambda: GPTConfig(n_head=True, n_embd=4),
        "top_k 0": lambda: model.generate(ids[:, :2], 3, top_k=0),
        "negative top_k": lambda: model.generate(ids[:, :2], 3, top_k=-2),
        "float top_k": lambda: model.generate(ids[:, :2], 3, top_k=2.5),
        "negative max_new_tokens": lambda: model.generate(ids[:, :2], -1),
        "float idx": lambda: model.generate(ids[:, :2].float(), 3),
        "list idx": lambda: model.generate([[1, 2]], 3),
        "float targets": lambda: model(ids, ids.float()),
    }
    return {name: _message(fn) for name, fn in cases.items()}


def test_gpt_bad_input_gets_a_clear_error(worlds):
    messages = worlds[4].run(check_gpt_bad_inputs)
    for m in messages[1:]:  # the same on every rank, but for the rows each rank holds
        assert {k: v for k, v in m.items() if k != "loss vocab mismatch"} == \
            {k: v for k, v in messages[0].items() if k != "loss vocab mismatch"}
    m = messages[0]
    assert m["n_embd not divisible"] == "ValueError: n_embd (10) is not divisible by n_head (4)"
    assert m["n_head not divisible by kv"] == "ValueError: n_head (6) is not divisible by n_kv_head (4)"
    assert m["n_head smaller than tp"] == "ValueError: n_head (2) is smaller than tp (4)"
    assert m["vocab smaller than tp"] == "ValueError: vocab_size (3) is smaller than tp (4)"
    assert m["sequence too long"] == "ValueError: sequence length (9) is longer than block_size (8)"
    assert m["token id too large"] == ("ValueError: token id 37 is out of range for num_embeddings 37 "
                                       "(ids must be in [0, 37))")
    assert m["negative token id"].startswith("ValueError: token id -1 is out of range")
    assert m["target too large"] == ("ValueError: target id 40 is out of range for vocab_size 37 "
                                     "(and is not ignore_index -1)")
    assert m["float ids"] == "TypeError: VocabParallelEmbedding expects a tensor of integer ids, got torch.float32"
    assert m["1-D ids"] == "ValueError: GPT expects token ids of shape (B, T), got (8,)"
    assert m["bad mlp"] == "ValueError: mlp must be one of ('gelu', 'swiglu'), got 'relu'"
    assert m["zero kv heads"] == "ValueError: GPTConfig.n_kv_head must be a positive integer or None, got 0"
    assert m["attention width"] == "ValueError: ParallelSelfAttention expects (B, T, 16), got (2, 3, 12)"
    assert m["padded embedding"].startswith("ValueError: VocabParallelEmbedding.from_embedding supports plain")
    assert m["bool n_head"] == "TypeError: GPTConfig.n_head must be a positive integer, got True"
    assert m["top_k 0"] == "ValueError: top_k must be a positive integer, got 0"
    assert m["negative top_k"] == "ValueError: top_k must be a positive integer, got -2"
    assert m["float top_k"] == "TypeError: top_k must be a positive integer, got 2.5"
    assert m["negative max_new_tokens"] == "ValueError: max_new_tokens must be a non-negative integer, got -1"
    assert m["float idx"] == "TypeError: GPT expects integer token ids, got torch.float32"
    assert m["list idx"] == "TypeError: GPT expects a tensor of token ids, got list"
    assert m["float targets"] == "TypeError: GPT expects integer targets, got torch.float32"
    assert m["loss vocab mismatch"] == ("ValueError: logits of shape (3, 5) do not match targets of shape (3,) and "
                                        "this rank's 10 of 37 vocabulary rows")


def check_collective_arguments():
    """Bad arguments to the autograd collectives and the loss; then one all-reduce shows no rank was left behind."""
    x = torch.randn(4, 6)
    ids = torch.zeros(3, dtype=torch.long)
    cases = {
        "scatter dim": lambda: tensorpar.scatter_to_tp(x, 2),
        "gather dim": lambda: tensorpar.gather_from_tp(x, -3, 8),
        "reduce-scatter dim": lambda: tensorpar.reduce_scatter(x, 3),
        "all-gather dim": lambda: tensorpar.all_gather(x, 2, 8),
        "float dim": lambda: tensorpar.scatter_to_tp(x, 1.0),
        "copy a list": lambda: tensorpar.copy_to_tp([1.0, 2.0]),
        "reduce a list": lambda: tensorpar.reduce_from_tp([1.0, 2.0]),
        "scatter a list": lambda: tensorpar.scatter_to_tp([1.0, 2.0]),
        "gather a number": lambda: tensorpar.gather_from_tp(3.0, 0, 6),
        "reduce-scatter a tuple": lambda: tensorpar.reduce_scatter((x,)),
        "all-gather a list": lambda: tensorpar.all_gather([x], 0, 8),
        "unit 2.5": lambda: tensorpar.scatter_to_tp(x, -1, unit=2.5),
        "unit None": lambda: tensorpar.scatter_to_tp(x, -1, unit=None),
        "unit 0": lambda: tensorpar.scatter_to_tp(x, -1, unit=0),
        "unit -3": lambda: tensorpar.scatter_to_tp(x, -1, unit=-3),
        "unit True": lambda: tensorpar.scatter_to_tp(x, -1, unit=True),
        "gather size True": lambda: tensorpar.gather_from_tp(x, 0, True),
        "all-gather size 2.5": lambda: tensorpar.all_gather(x, 0, 2.5),
        "int64 logits": lambda: tensorpar.vocab_parallel_cross_entropy(torch.ones(3, 5, dtype=torch.long), ids, 10),
        "bool logits": lambda: tensorpar.vocab_parallel_cross_entropy(torch.ones(3, 5, dtype=torch.bool), ids, 10),
        "bool targets": lambda: tensorpar.vocab_parallel_cross_entropy(torch.randn(3, 5), ids.bool(), 10),
        "float targets": lambda: tensorpar.vocab_parallel_cross_entropy(torch.randn(3, 5), ids.float(), 10),
    }
    messages = {name: _message(fn) for name, fn in cases.items()}
    return messages, tensorpar.reduce_from_tp(torch.ones(())).item()


def test_collective_arguments_get_the_same_clear_error_at_every_tp(worlds):
    results = worlds[1].run(check_collective_arguments) + worlds[2].run(check_collective_arguments)
    assert [total for _, total in results] == [1.0, 2.0, 2.0]  # every rank went on to the same all-reduce
    m = results[0][0]
    assert all(messages == m for messages, _ in results)  # the same at tp 1 and on each rank at tp 2
    for case, op, dim in (("scatter dim", "scatter_to_tp", 2), ("gather dim", "gather_from_tp", -3),
                          ("reduce-scatter dim", "reduce_scatter", 3), ("all-gather dim", "all_gather", 2)):
        assert m[case] == f"ValueError: {op}: dim {dim} is out of range for a 2-d tensor (expected a dim in [-2, 2))"
    assert m["float dim"] == "TypeError: scatter_to_tp: dim must be an integer, got 1.0"
    for case, op, kind in (("copy a list", "copy_to_tp", "list"), ("reduce a list", "reduce_from_tp", "list"),
                           ("scatter a list", "scatter_to_tp", "list"), ("gather a number", "gather_from_tp", "float"),
                           ("reduce-scatter a tuple", "reduce_scatter", "tuple"),
                           ("all-gather a list", "all_gather", "list")):
        assert m[case] == f"TypeError: {op} expects a tensor, got {kind}"
    for unit in ("2.5", "None", "True"):
        assert m[f"unit {unit}"] == f"TypeError: scatter_to_tp: unit must be a positive integer, got {unit}"
    for unit in ("0", "-3"):
        assert m[f"unit {unit}"] == f"ValueError: scatter_to_tp: unit must be a positive integer, got {unit}"
    assert m["gather size True"] == "TypeError: gather_from_tp: size must be a positive integer, got True"
    assert m["all-gather size 2.5"] == "TypeError: all_gather: size must be a positive integer, got 2.5"
    assert m["int64 logits"] == "TypeError: logits must be floating point, got torch.int64"
    assert m["bool logits"] == "TypeError: logits must be floating point, got torch.bool"
    assert m["bool targets"] == "TypeError: targets must be integer token ids, got torch.bool"
    assert m["float targets"] == "TypeError: targets must be integer token ids, got torch.float32"


def test_rotary_positions_beyond_block_size_are_refused():
    with pytest.raises(ValueError, match=r"rotary positions cover block_size \(4\) tokens, got 5"):
        RotaryEmbedding(8, block_size=4)(5)
