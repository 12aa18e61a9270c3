"""The GPT's transformer block, and running a stack of them (checkpointed or not).

A :class:`Block` is pre-LayerNorm attention and MLP with residuals; attention and MLP each end in
Megatron's ``g`` (an all-reduce of ``(B, T, C)``, or with sequence parallelism a reduce-scatter into
this rank's tokens), so a block costs two all-reduces forward and two backward.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

import tensorpar
from tensorpar.random import RNGStatesTracker, recompute_contexts

from .attention import ParallelSelfAttention
from .config import GPTConfig
from .kv_cache import KVCache, LayerCache
from .linear import check_activation
from .mlp import ParallelMLP
from .rotary import RotaryEmbedding
from .sequence import layer_norm


class Block(nn.Module):
    """Pre-norm transformer block (LayerNorm or RMSNorm): ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``.
    ``(B, T, C)``, or with ``config.sequence_parallel`` this rank's tokens ``(B, T_r, C)`` of ``seq_len`` (found with
    one small collective when not given)."""

    def __init__(self, config: GPTConfig, *, group: ProcessGroup | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        c = config
        self.tp_group, self.sequence_parallel = tensorpar.tp_group(group), c.sequence_parallel
        norm = functools.partial(layer_norm, c.n_embd, bias=c.bias, sequence_parallel=c.sequence_parallel,
                                 group=group, device=device, dtype=dtype, kind=c.norm, eps=c.norm_eps)
        common = dict(bias=c.bias, dropout=c.dropout, sequence_parallel=c.sequence_parallel, group=group,
                      device=device, dtype=dtype)
        self.ln_1 = norm()
        rotary = RotaryEmbedding(c.n_embd // c.n_head, c.block_size, c.rope_theta, device=device, dtype=dtype) \
            if c.positions == "rope" else None
        self.attn = ParallelSelfAttention(c.n_embd, c.n_head, n_kv_head=c.kv_heads, rotary=rotary, **common)
        self.ln_2 = norm()
        self.mlp = ParallelMLP(c.n_embd, c.mlp_hidden, activation=c.mlp, **common)

    def forward(self, x: torch.Tensor, seq_len: int | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        """``cache``: this block's keys and values so far (:mod:`layers.kv_cache`), which ``x`` follows."""
        check_activation(x, type(self).__name__)
        if not self.sequence_parallel:  # seq_len is x's
            x = x + self.attn(self.ln_1(x), cache=cache)  # (B, T, C)
            return x + self.mlp(self.ln_2(x))
        seq_len = tensorpar.sequence_length(x, seq_len, self.tp_group)
        x = x + self.attn(self.ln_1(x, seq_len), seq_len, cache)  # (B, T_r, C)
        return x + self.mlp(self.ln_2(x, seq_len), seq_len)


def _checkpointed(block: Block, x: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``block(x)``, keeping only ``x`` for backward: the block runs again during backward, with
    the default generator and the tp streams of its sharded dropout put back as they were."""
    trackers = list({id(m.rng): m.rng for m in block.modules()
                     if isinstance(getattr(m, "rng", None), RNGStatesTracker)}.values())
    return checkpoint(block, x, seq_len, use_reentrant=False,
                      context_fn=functools.partial(recompute_contexts, *trackers))


def run_blocks(blocks: Iterable[Block], x: torch.Tensor, seq_len: int, config: GPTConfig,
               cache: KVCache | None = None) -> torch.Tensor:
    """``x`` through ``blocks`` in turn, each checkpointed when ``config.activation_checkpointing`` (and
    gradients are on, without a ``cache``), each with its layer of ``cache``."""
    if cache is not None:
        for block, layer in zip(blocks, cache.layers, strict=True):
            x = block(x, seq_len, layer)
        return x
    recompute = config.activation_checkpointing and torch.is_grad_enabled()
    for block in blocks:
        x = _checkpointed(block, x, seq_len) if recompute else block(x, seq_len)  # (B, T, C) or (B, T_r, C)
    return x
