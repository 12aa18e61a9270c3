"""Tensor-parallel ``nn.Module``s built on :mod:`tensorpar`."""

from .attention import ParallelSelfAttention
from .block import Block
from .config import GPTConfig
from .embedding import VocabParallelEmbedding
from .gpt import GPT
from .hf_parallel import parallelize_hf
from .linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from .mlp import ParallelMLP
from .numerics import SegmentwiseActivation
from .parallelize import STYLES, HeadRow, QKVColumn, Segmentwise, parallelize
from .pipeline import GPTStage, PipelinedGPT
from .regions import AllGatherSequence, CopyToTP, ReduceFromTP, ReduceScatterSequence
from .rotary import RotaryEmbedding
from .sequence import ParallelLayerNorm, ParallelRMSNorm, SequenceParallelLayerNorm, ShardedDropout

__all__ = ["GPT", "STYLES", "AllGatherSequence", "Block", "ColumnParallelLinear", "CopyToTP", "GPTConfig", "GPTStage",
           "HeadRow", "ParallelLayerNorm", "ParallelMLP", "ParallelRMSNorm", "ParallelSelfAttention", "PipelinedGPT",
           "QKVColumn", "ReduceFromTP", "ReduceScatterSequence", "ReplicatedLinear", "RotaryEmbedding",
           "RowParallelLinear", "Segmentwise", "SegmentwiseActivation", "SequenceParallelLayerNorm", "ShardedDropout",
           "VocabParallelEmbedding", "parallelize", "parallelize_hf"]
