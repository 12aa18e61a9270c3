"""Shard a Hugging Face causal LM in place: GPT-2, Llama, Mistral and Qwen2 (``transformers`` models).

The model keeps its own forward code. Attention is independent per head, and
the Hugging Face attention modules reshape their projections with
``(*input_shape, -1, head_dim)``, so a rank that holds whole heads runs the
same code on its heads once its projections output them and its per-rank
attributes say how many it has (GPT-2's ``split_size`` and ``num_heads``;
``num_key_value_groups`` elsewhere). What changes, per decoder layer:

* attention: Q, K and V column-parallel by whole heads, the output projection row-parallel over the
  same heads, partitioned as :mod:`layers.attention` partitions them (:func:`~layers.heads.head_layout`;
  K and V held whole by a :class:`~layers.hf_modules.ReplicatedHeadsLinear` when tp exceeds the KV heads);
* MLP: the up (and gate) projections column-parallel, the down projection row-parallel;
* one ``f`` enters each region and one ``g`` leaves it, as in Megatron: Q, K
  and V (gate and up) share a :class:`~layers.regions.CopyToTP`, stored on
  the attention (MLP) module as ``copy_in`` and applied to its input by a
  forward pre-hook; GPT-2's fused ``c_attn`` and ``c_fc`` apply their own. Two
  all-reduces forward and two backward per layer (two more backward, of the K and
  V weight gradients, when K and V are held whole).

The token embedding is vocab-parallel and the LM head column-parallel over
the same rows with its output gathered, so Hugging Face's loss (``labels=``) and
``generate`` see full logits; a tied head keeps sharing the embedding's shard.
Everything else (norms, GPT-2's position embedding, rotary embeddings) is
replicated. :func:`tensorpar.full_state_dict` gives the unsharded model's keys
and shapes, in Hugging Face's own layouts.

In bitwise mode (:mod:`layers.numerics`) the linear layers compute by segments, the activations
between them run one segment at a time, and ``copy_in`` passes gradients through (the column
layers sum them); grouped-query models need at least as many KV heads as the largest tp of the mode.

Attention-probability dropout in training draws one mask for all the heads from the default
generator and each rank keeps its heads' slice (:mod:`layers.hf_attention`): the dense model's masks
at every tp, when it draws them as ``torch.rand(B, n_head, T, S) >= p``.

Not covered: attention implementations other than ``"eager"`` and ``"sdpa"``,
attention-probability dropout in training at tp > 1 with GPT-2's ``reorder_and_upcast_attn``
(it raises at the forward), GPT-2 cross-attention, ``output_attentions`` (each
rank returns its own heads), resizing the embeddings afterwards.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from torch import nn
from torch.distributed import ProcessGroup

import tensorpar

from . import hf_attention, numerics
from .embedding import VocabParallelEmbedding
from .heads import head_layout
from .hf_modules import ColumnParallelConv1D, PaddedVocabParallelEmbedding, ReplicatedHeadsLinear, RowParallelConv1D
from .linear import ColumnParallelLinear, RowParallelLinear
from .regions import CopyToTP

_ATTENTION = ("eager", "sdpa")


def parallelize_hf(model: nn.Module, *, group: ProcessGroup | None = None) -> nn.Module:
    """Shard a ``transformers`` GPT-2, Llama, Mistral or Qwen2 causal LM over the tp group, in place.

    Every rank must hold the same dense model (built from one seed, or loaded
    from one checkpoint). Returns ``model``, whose forward, loss and
    ``generate`` are used as before and give the dense model's results; see
    the module docstring for what is split and how.

    Example::

        tensorpar.init(tp=3)
        model = LlamaForCausalLM.from_pretrained(path)   # the same on every rank
        layers.parallelize_hf(model)                     # e.g. 4 heads: 2, 1, 1 per rank
        out = model(input_ids, labels=input_ids)         # full logits and loss on every rank
        out.loss.backward()
        state = tensorpar.full_state_dict(model)         # the Hugging Face keys and shapes
    """
    names = [c.__name__ for c in type(model).__mro__]
    kind = next((name for name in names if name in _ARCHITECTURES), None)
    if kind is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise TypeError(f"parallelize_hf does not support {type(model).__name__} (model_type {model_type!r}); "
                        f"supported: {', '.join(_ARCHITECTURES)}")
    config = model.config
    if config._attn_implementation not in _ATTENTION:
        raise ValueError(f"parallelize_hf supports attn_implementation {' or '.join(map(repr, _ATTENTION))}, "
                         f"got {config._attn_implementation!r}")
    if isinstance(model.get_input_embeddings(), VocabParallelEmbedding):
        raise ValueError(f"this {kind} is already parallelized")
    group = tensorpar.tp_group(group)
    rank, tp = tensorpar.group_rank_size(group)
    _check_vocab(model, tp)  # every check before anything changes
    _ARCHITECTURES[kind](model, config, group, rank, tp)
    _shard_vocab(model, group)
    return numerics.mark(model)  # in bitwise mode, its norm follows (tensorpar.clip_grad_norm_)


def _at_least_tp(tp: int, **sizes: int) -> None:
    for name, value in sizes.items():
        if value < tp:
            raise ValueError(f"{name} ({value}) is smaller than tp ({tp})")


def _gpt2(model: nn.Module, config: Any, group: ProcessGroup, rank: int, tp: int) -> None:
    """GPT-2: ``c_attn`` ``[Q | K | V]`` split by heads in each block, ``c_fc`` by features."""
    if config.add_cross_attention:
        raise ValueError("parallelize_hf does not support GPT-2 with add_cross_attention=True")
    n_head, inner = config.n_head, config.n_inner or 4 * config.n_embd
    _at_least_tp(tp, num_attention_heads=n_head, n_inner=inner)
    heads = len(head_layout(n_head, n_head, tp, rank).query)
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        d = attn.head_dim
        attn.c_attn = ColumnParallelConv1D.from_conv1d(attn.c_attn, unit=d, blocks=3, group=group)
        attn.c_proj = RowParallelConv1D.from_conv1d(attn.c_proj, unit=d, group=group)
        attn.split_size, attn.num_heads = heads * d, heads  # this rank's Q (K, V) width and heads
        if config.reorder_and_upcast_attn:  # its own eager path, whose dropout draws per rank
            _refuse_attention_dropout(attn, tp, lambda a: a.attn_dropout.p, "attn_pdrop")
        else:
            hf_attention.install(attn, head_layout(n_head, n_head, tp, rank).query, n_head)
        mlp.c_fc = ColumnParallelConv1D.from_conv1d(mlp.c_fc, group=group)
        mlp.c_proj = RowParallelConv1D.from_conv1d(mlp.c_proj, group=group)
        mlp.act = numerics.segmentwise(mlp.act, inner, group)  # in bitwise mode, GELU by segments of c_fc's output


def _llama(model: nn.Module, config: Any, group: ProcessGroup, rank: int, tp: int) -> None:
    """Llama, Mistral and Qwen2: separate Q, K, V (grouped-query) and a gated MLP."""
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    if n_head % n_kv:
        raise ValueError(f"num_attention_heads ({n_head}) is not divisible by num_key_value_heads ({n_kv})")
    _at_least_tp(tp, num_attention_heads=n_head, intermediate_size=config.intermediate_size)
    numerics.check_hf_kv_heads(n_head, n_kv)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _shard_attention(attn, n_head, n_kv, group, rank, tp)
        hf_attention.install(attn, head_layout(n_head, n_kv, tp, rank).query, n_head)
        _enter_region(attn, group)
        column = dict(copy_input=False, group=group)  # behind copy_in's f
        mlp.gate_proj = ColumnParallelLinear.from_linear(mlp.gate_proj, **column)
        mlp.up_proj = ColumnParallelLinear.from_linear(mlp.up_proj, **column)
        mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, group=group)
        mlp.act_fn = numerics.segmentwise(mlp.act_fn, config.intermediate_size, group)  # bitwise: SiLU by segments
        _enter_region(mlp, group)


def _shard_attention(attn: nn.Module, n_head: int, n_kv: int, group: ProcessGroup, rank: int, tp: int) -> None:
    """Split Q/K/V/O by whole heads as :class:`~layers.attention.ParallelSelfAttention` does."""
    d, heads = attn.head_dim, head_layout(n_head, n_kv, tp, rank)
    column = dict(copy_input=False, group=group)  # behind copy_in's f
    # local query heads per local KV head (eager's and sdpa's repeat_kv); 1 where they read unevenly
    # (query heads 1-3 of groups of 2 read KV heads 0, 1, 1): then one KV head per query head
    groups = heads.group_size or 1
    if not heads.kv_replicated:  # whole query groups per rank: a KV head and its g query heads
        unit = n_head // n_kv * d
        attn.k_proj = ColumnParallelLinear.from_linear(attn.k_proj, unit=d, **column)
        attn.v_proj = ColumnParallelLinear.from_linear(attn.v_proj, unit=d, **column)
    else:  # query heads alone; K and V whole, giving the KV heads this rank's query heads read
        unit, kv_heads = d, list(heads.kv_reads if heads.group_size else heads.kv_read)
        attn.k_proj = ReplicatedHeadsLinear.from_linear(attn.k_proj, head_dim=d, heads=kv_heads, group=group)
        attn.v_proj = ReplicatedHeadsLinear.from_linear(attn.v_proj, head_dim=d, heads=kv_heads, group=group)
    attn.q_proj = ColumnParallelLinear.from_linear(attn.q_proj, unit=unit, **column)
    attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, unit=unit, group=group)
    attn.num_key_value_groups = groups


def _enter_region(module: nn.Module, group: ProcessGroup) -> None:
    """Give ``module`` one ``f`` (``module.copy_in``) applied to its input (its forward's first
    argument, passed by position or by name) before its forward runs."""
    module.copy_in = CopyToTP(group=group)
    first = next(iter(inspect.signature(module.forward).parameters))  # "hidden_states", or "x"
    module.register_forward_pre_hook(functools.partial(_copy_in_hook, name=first), with_kwargs=True)


def _copy_in_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                  name: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args:
        return (module.copy_in(args[0]), *args[1:]), kwargs
    return args, {**kwargs, name: module.copy_in(kwargs[name])}


def _refuse_attention_dropout(attn: nn.Module, tp: int, rate: Callable[[nn.Module], float], option: str) -> None:
    """At tp > 1, make a training forward with attention-probability dropout raise (GPT-2 with
    ``reorder_and_upcast_attn``, whose own eager path would draw each rank's masks alone)."""
    if tp > 1:
        attn.register_forward_pre_hook(functools.partial(_dropout_hook, rate=rate, option=option))


def _dropout_hook(module: nn.Module, args: tuple[Any, ...], *, rate: Callable[[nn.Module], float],
                  option: str) -> None:
    """Raise for a training forward with attention-probability dropout."""
    if module.training and rate(module) > 0:
        raise ValueError(f"attention dropout ({option}={rate(module)}) in training is not supported by "
                         "parallelize_hf at tp > 1 with reorder_and_upcast_attn=True: each rank would draw its "
                         "heads' masks from the default generator, which would then differ between ranks; set "
                         f"config.{option} = 0.0 or reorder_and_upcast_attn = False before building the model, "
                         "or call model.eval()")


def _check_vocab(model: nn.Module, tp: int) -> None:
    """Raise unless the token embedding and the LM head can be split as :func:`_shard_vocab` does."""
    dense, head = model.get_input_embeddings(), model.lm_head
    vocab, dim = dense.weight.shape
    _at_least_tp(tp, vocab_size=vocab)
    if dense.max_norm is not None or dense.scale_grad_by_freq or dense.sparse:
        raise ValueError("parallelize_hf supports token embeddings without max_norm, scale_grad_by_freq or sparse")
    if (head.in_features, head.out_features) != (dim, vocab):
        raise ValueError(f"lm_head maps {head.in_features} -> {head.out_features} features, expected {dim} -> {vocab}")


def _shard_vocab(model: nn.Module, group: ProcessGroup) -> None:
    """Token embedding vocab-parallel; the LM head column-parallel over the same rows, output gathered."""
    dense, head = model.get_input_embeddings(), model.lm_head
    vocab, dim = dense.weight.shape
    options = dict(group=group, device="meta", dtype=dense.weight.dtype)
    if dense.padding_idx is None:
        embedding = VocabParallelEmbedding(vocab, dim, **options)
    else:
        embedding = PaddedVocabParallelEmbedding(vocab, dim, padding_idx=dense.padding_idx, **options)
    embedding.to_empty(device=dense.weight.device)
    tensorpar.load_full_state_dict(embedding, {"weight": dense.weight.detach()})
    tied = head.weight is dense.weight
    sharded_head = ColumnParallelLinear.from_linear(head, gather_output=True, group=group)
    if tied:  # the same rows on the same rank: the head keeps sharing the embedding's shard
        sharded_head.weight = embedding.weight
    model.set_input_embeddings(embedding)
    model.lm_head = sharded_head


#: The supported classes (found in the model's class hierarchy) and how each is split.
_ARCHITECTURES: Mapping[str, Callable[[nn.Module, Any, ProcessGroup, int, int], None]] = MappingProxyType({
    "GPT2LMHeadModel": _gpt2, "LlamaForCausalLM": _llama, "MistralForCausalLM": _llama,
    "Qwen2ForCausalLM": _llama})
