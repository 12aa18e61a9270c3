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
from .plan import Layout, Plan, RankPlan, Suggestions, nearest_fits, plan, plan_rank, suggest
from .regions import AllGatherSequence, CopyToTP, ReduceFromTP, ReduceScatterSequence
from .rotary import RotaryEmbedding
from .sequence import ParallelLayerNorm, ParallelRMSNorm, SequenceParallelLayerNorm, ShardedDropout

__all__ = ["GPT", "STYLES", "AllGatherSequence", "Block", "ColumnParallelLinear", "CopyToTP", "GPTConfig", "GPTStage",
           "HeadRow", "Layout", "ParallelLayerNorm", "ParallelMLP", "ParallelRMSNorm", "ParallelSelfAttention",
           "PipelinedGPT", "Plan", "QKVColumn", "RankPlan", "ReduceFromTP", "ReduceScatterSequence", "ReplicatedLinear",
           "RotaryEmbedding", "RowParallelLinear", "Segmentwise", "SegmentwiseActivation", "SequenceParallelLayerNorm",
           "ShardedDropout", "Suggestions", "VocabParallelEmbedding", "nearest_fits", "parallelize", "parallelize_hf",
           "plan", "plan_rank", "suggest"]
