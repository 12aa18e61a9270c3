"""Hypothesis strategies for tensor-parallel tests: tp sizes, feature counts that do or do not divide by
tp, batch shapes and dtypes. Draw in the test process, never inside the ranks (see :mod:`tensorpar.testing`)."""

from __future__ import annotations

import torch

try:
    from hypothesis import strategies as st
except ImportError as e:
    raise ImportError(f"tensorpar.testing.strategies needs hypothesis: pip install 'tensorpar[test]' ({e})") from e


def tp_sizes(max_tp: int = 4) -> st.SearchStrategy[int]:
    """Tensor-parallel sizes 1..``max_tp``, shrinking towards 1."""
    return st.integers(1, max_tp)


def features(tp: int, max_value: int = 64, *, multiple_of: int = 1) -> st.SearchStrategy[int]:
    """Feature counts at least ``tp`` (units of ``multiple_of``), divisible by ``tp`` or not."""
    return st.integers(tp, max(tp, max_value // multiple_of)).map(lambda n: n * multiple_of)


def batch_shapes(max_dims: int = 2, max_side: int = 5) -> st.SearchStrategy[tuple[int, ...]]:
    """Leading batch dims for a linear layer, including none at all."""
    return st.lists(st.integers(1, max_side), max_size=max_dims).map(tuple)


def dtypes() -> st.SearchStrategy[torch.dtype]:
    return st.sampled_from([torch.float64, torch.float32, torch.bfloat16])
