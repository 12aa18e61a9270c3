"""Tensor-parallel ``nn.Module``s built on :mod:`tensorpar`."""

from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]
