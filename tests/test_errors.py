"""Bad input gets a clear error naming the numbers, on every rank alike (so no rank hangs)."""

import torch

from layers import ColumnParallelLinear, RowParallelLinear


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
