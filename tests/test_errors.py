"""Bad input gets a clear error naming the numbers, on every rank alike (so no rank hangs)."""

import torch
from torch import nn

import tensorpar
from layers import (
    GPT,
    ColumnParallelLinear,
    GPTConfig,
    ParallelSelfAttention,
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
    assert m["loss vocab mismatch"] == ("ValueError: logits of shape (3, 5) do not match targets of shape (3,) and "
                                        "this rank's 10 of 37 vocabulary rows")
