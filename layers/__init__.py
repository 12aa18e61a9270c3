"""Tensor-parallel ``nn.Module``s built on :mod:`tensorpar`."""

from .attention import ParallelSelfAttention
from .embedding import VocabParallelEmbedding
from .gpt import GPT, Block, GPTConfig
from .hf_parallel import parallelize_hf
from .linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from .mlp import ParallelMLP
from .parallelize import STYLES, parallelize
from .regions import CopyToTP, ReduceFromTP

__all__ = ["GPT", "STYLES", "Block", "ColumnParallelLinear", "CopyToTP", "GPTConfig", "ParallelMLP",
           "ParallelSelfAttention", "ReduceFromTP", "ReplicatedLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "parallelize", "parallelize_hf"]
