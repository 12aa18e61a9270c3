"""Tensor-parallel ``nn.Module``s built on :mod:`tensorpar`."""

from .attention import ParallelSelfAttention
from .embedding import VocabParallelEmbedding
from .gpt import GPT, Block, GPTConfig
from .linear import ColumnParallelLinear, RowParallelLinear
from .mlp import ParallelMLP

__all__ = ["GPT", "Block", "ColumnParallelLinear", "GPTConfig", "ParallelMLP", "ParallelSelfAttention",
           "RowParallelLinear", "VocabParallelEmbedding"]
