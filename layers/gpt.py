"""A GPT (GPT-2 architecture by default) built from tensor-parallel layers.

Each rank holds ``1/tp`` of every weight matrix and embedding table:

* token and position embeddings are vocab-parallel (rows split); their partial
  lookups are summed and reduced once (``transformer.reduce``, Megatron's ``g``):
  one all-reduce of ``(B, T, C)`` (with ``positions="rope"`` there is no position
  table: each rank rotates its own query and key heads, :mod:`layers.rotary`);
* each block is pre-norm (LayerNorm, or RMSNorm) attention + MLP with residuals; attention and
  MLP each cost one all-reduce of ``(B, T, C)`` forward and one backward;
* the LM head is tied to the token embedding, so it is column-parallel over
  the vocabulary: logits come out vocab-sharded, ``(B, T, V / tp)``. The loss
  is computed from them directly (three all-reduces of ``(B, T)``); full
  logits are gathered only when asked for.

LayerNorms and row-parallel biases are replicated (tiny); everything else is
split, so a rank holds little more than ``1/tp`` of the parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

import tensorpar
from tensorpar.checks import check_int

from . import generation, hf, hf_llama
from .block import Block, run_blocks
from .config import GPTConfig
from .embedding import PositionEmbedding, VocabParallelEmbedding
from .kv_cache import KVCache
from .linear import ColumnParallelLinear
from .regions import ReduceFromTP, ReduceScatterSequence
from .sequence import ShardedDropout, layer_norm


def embed(parts: nn.ModuleDict, config: GPTConfig, idx: torch.Tensor,
          positions: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids ``(B, T)`` at ``positions`` (B, T) (default ``0..T-1``) -> the first block's input through
    ``parts`` (``wte``, ``wpe`` for learned positions, ``reduce``, ``drop``): ``(B, T, C)``, replicated, or
    with sequence parallelism this rank's tokens ``(B, T_r, C)``. With rotary positions there is no ``wpe``:
    the attention rotates its heads by position instead."""
    t = idx.shape[1]
    if t > config.block_size:
        raise ValueError(f"sequence length ({t}) is longer than block_size ({config.block_size})")
    x = parts.wte(idx)  # (B, T, C): this rank's rows of the table, the others' zero
    if "wpe" in parts:
        x = x + parts.wpe(torch.arange(t, device=idx.device) if positions is None else positions)  # (T,) or (B, T)
    x = parts.reduce(x)  # (B, T, C) or (B, T_r, C)
    return parts.drop(x, t) if config.sequence_parallel else parts.drop(x)


def initialise_(config: GPTConfig, named: Iterable[tuple[str, list[torch.Tensor]]],
                geometry: Mapping[str, Mapping[str, Any]]) -> None:
    """nanoGPT's initialisation, drawn tp-invariantly, of the tensors held for each parameter name of
    the GPT, in the GPT's order: weights ``N(0, 0.02)`` (residual projections ``N(0, 0.02 / √(2
    n_layer))``), biases 0, LayerNorm weights 1. Each weight takes one draw of the global generator
    whether this rank holds it (a pipeline stage holds some blocks only) or not, and every copy held
    of it (a tied head on another stage) gets the same values, so all layouts agree."""
    with torch.no_grad():
        for name, held in named:
            if len(geometry[name]["full_shape"]) < 2:  # biases, LayerNorms: no draw
                for p in held:
                    p.fill_(0.0 if name.endswith("bias") else 1.0)
                continue
            std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
            state = torch.get_rng_state()
            if not held:
                torch.randint(0, 2**62, ())  # the draw tiled_init would take
            for p in held:
                torch.set_rng_state(state)
                tensorpar.tiled_init.normal_(p, 0.0, std, **geometry[name])


def _check_temperature(temperature: float, *, positive: bool) -> None:
    """Raise unless ``temperature`` is a number ``>= 0`` (``> 0`` when ``positive``)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number, got {temperature!r}")
    if not (temperature > 0 if positive else temperature >= 0):  # nan included
        raise ValueError(f"temperature must be {'>' if positive else '>='} 0, got {temperature}")


class GPT(nn.Module):
    """A GPT sharded over the tp group, with nanoGPT's module and parameter names.

    ``model(idx)`` returns the full logits ``(B, T, vocab_size)``, the same on
    every rank; ``model(idx, targets)`` returns the mean cross-entropy (targets
    equal to -1 are ignored, as in nanoGPT), computed from vocab-sharded logits.
    Every rank of the tp group must be given the same ``idx`` and ``targets``,
    and seed its default generator alike (:func:`tensorpar.manual_seed`): the
    replicated regions, residual dropout included, rely on it, as in Megatron.

    Example::

        tensorpar.init(tp=2)
        model = GPT(GPTConfig(vocab_size=50257, n_layer=12, n_head=12, n_embd=768))
        loss = model(idx, targets)                  # idx, targets: (B, T) token ids
        full = model.full_state_dict()              # the unsharded keys, on every rank
    """

    def __init__(self, config: GPTConfig, *, group: ProcessGroup | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = c = config
        self.tp_group = group = tensorpar.tp_group(group)
        self.numerics = tensorpar.current_bitwise()  # its bitwise mode (None: off): its loss and norm follow
        _, tp = tensorpar.group_rank_size(group)
        learned = c.positions == "learned"
        for name in ("vocab_size", "block_size") if learned else ("vocab_size",):  # the tables are split by rows
            tensorpar.partition_sizes(getattr(c, name), tp, name=name)
        factory: dict[str, Any] = dict(device=device, dtype=dtype)
        sp = c.sequence_parallel  # the embeddings' sum reduce-scattered into this rank's tokens, gathered for the head
        # The layers initialise themselves, then reset_parameters draws every weight again: only its draws
        # count, so a model takes one draw per weight however it is built (a pipeline stage builds a few).
        with torch.random.fork_rng(devices=[]):
            table: dict[str, Any] = dict(embedding_dim=c.n_embd, reduce_output=False, group=group, **factory)
            self.transformer = nn.ModuleDict(dict(
                wte=VocabParallelEmbedding(c.vocab_size, **table),
                **(dict(wpe=PositionEmbedding(c.block_size, **table)) if learned else {}),  # rotary positions: none
                reduce=ReduceScatterSequence(group=group) if sp else ReduceFromTP(group=group),  # g (ḡ): both lookups
                drop=ShardedDropout(c.dropout, group=group) if sp else nn.Dropout(c.dropout),
                h=nn.ModuleList([Block(c, group=group, **factory) for _ in range(c.n_layer)]),
                ln_f=layer_norm(c.n_embd, bias=c.bias, sequence_parallel=sp, group=group, kind=c.norm, eps=c.norm_eps,
                                **factory),
            ))
            self.lm_head = ColumnParallelLinear(c.n_embd, c.vocab_size, bias=False, sequence_parallel=sp, group=group,
                                                **factory)
        self._tie()
        # .to(), .to_empty() and load_state_dict(assign=True) may replace the parameters: tie them again
        self.register_load_state_dict_post_hook(lambda module, _: module._tie())
        self.reset_parameters()

    def _tie(self) -> None:
        self.lm_head.weight = self.transformer.wte.weight  # tied: both split the vocabulary alike

    def _apply(self, fn: Any, recurse: bool = True) -> GPT:
        super()._apply(fn, recurse)
        self._tie()
        return self

    def reset_parameters(self) -> None:
        """nanoGPT's initialisation, drawn tp-invariantly: weights ``N(0, 0.02)`` (residual
        projections ``N(0, 0.02 / √(2 n_layer))``), biases 0, LayerNorm weights 1."""
        initialise_(self.config, [(name, [p]) for name, p in self.named_parameters()], tensorpar.shard_geometry(self))

    @staticmethod
    def _check_ids(ids: torch.Tensor, name: str = "token ids") -> None:
        """Raise unless ``ids`` is a ``(B, T)`` integer tensor (alike on every rank, before any collective)."""
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"GPT expects a tensor of {name}, got {type(ids).__name__}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"GPT expects integer {name}, got {ids.dtype}")
        if ids.dim() != 2:
            raise ValueError(f"GPT expects {name} of shape (B, T), got {tuple(ids.shape)}")

    def _hidden(self, idx: torch.Tensor, cache: KVCache | None = None, embedded: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Token ids ``(B, T)`` (checked) -> final hidden states ``(B, T, C)``, replicated (with
        sequence parallelism, this rank's tokens ``(B, T_r, C)``); after the tokens ``cache`` holds.
        ``embedded``: their embeddings' sum ``(B, T, C)``, already known (no sequence parallelism)."""
        positions = None if cache is None else cache.begin(idx.shape[1])
        if embedded is None:
            x = embed(self.transformer, self.config, idx, positions)
        else:
            x = self.transformer.drop(embedded)
        x = run_blocks(self.transformer.h, x, idx.shape[1], self.config, cache)  # (B, T, C) or (B, T_r, C)
        if cache is not None:
            cache.advance(idx.shape[1])
        return self.transformer.ln_f(x, idx.shape[1]) if self.config.sequence_parallel else self.transformer.ln_f(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, reduction: str = "mean",
                temperature: float = 1.0, cache: KVCache | None = None) -> torch.Tensor:
        """``idx`` (B, T) -> the logits (B, T, V); with ``targets`` (B, T) the cross-entropy of the logits
        divided by ``temperature``: its mean over the counted targets, ``reduction="sum"``, or per token
        ``reduction="none"`` (B, T) (0 where the target is -1), whose negation is the log-probability of each
        target: in the bitwise mode the bits :meth:`generate` returns for the tokens it sampled.

        With a ``cache`` (:meth:`new_cache`) ``idx`` continues the rows it holds, each at its own position,
        and is appended to it (prefill, then decode one token at a time)."""
        self._check_ids(idx)
        if cache is not None and idx.shape[0] != cache.batch_size:
            raise ValueError(f"idx has {idx.shape[0]} rows and the cache {cache.batch_size}")
        if targets is not None:
            self._check_ids(targets, "targets")
            if targets.shape != idx.shape:
                raise ValueError(f"targets of shape {tuple(targets.shape)} do not match idx of shape "
                                 f"{tuple(idx.shape)}")
        _check_temperature(temperature, positive=True)
        logits = self.lm_head(self._hidden(idx, cache), idx.shape[1])  # (B, T, V / tp): every token
        if targets is None:
            return tensorpar.gather_from_tp(logits, -1, self.config.vocab_size, self.tp_group)  # (B, T, V)
        return self._loss(logits, targets, reduction, temperature)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str, temperature: float) -> torch.Tensor:
        """The cross-entropy of vocab-sharded ``logits`` (*, V / tp) / ``temperature`` against ``targets`` (*)."""
        if temperature != 1:
            logits = logits / temperature
        return tensorpar.vocab_parallel_cross_entropy(logits, targets, self.config.vocab_size, ignore_index=-1,
                                                      reduction=reduction, group=self.tp_group,
                                                      bitwise=self.numerics or False)

    def new_cache(self, batch_size: int) -> KVCache:
        """An empty KV cache for ``batch_size`` rows of up to ``block_size`` tokens: each rank keeps the keys
        and values of its own KV heads (:mod:`layers.kv_cache`). Pass it to ``forward(idx, cache=...)``."""
        return KVCache(batch_size, self.config.block_size, self.config.n_layer,
                       device=self.transformer.wte.weight.device)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, *, stop_tokens: Iterable[int] | None = None,
                 prompt_lengths: torch.Tensor | Iterable[int] | None = None, pad_token: int = 0,
                 return_logprobs: bool = False, use_cache: bool = True) -> Any:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T), as nanoGPT does, with a KV cache.

        ``temperature=0`` picks the most likely token; otherwise tokens are drawn by Gumbel-max with
        uniforms for the whole vocabulary from the default generator (:mod:`layers.sampling`): reproducible
        from ``torch.manual_seed`` (:func:`tensorpar.manual_seed`), and the same draw at every tp, so the
        bitwise mode samples the same tokens at tp 1-4. Every rank returns the same tokens, picked with one
        all-gather of a few numbers per rank (the logits are never gathered). The prompt runs once (prefill)
        into a cache sharded by heads (:meth:`new_cache`), then each new token alone (decode);
        ``use_cache=False``, or a sequence longer than ``block_size`` (which keeps nanoGPT's window of
        the last ``block_size`` tokens), recomputes the context at every step instead.

        * ``prompt_lengths`` (B,): prompts of different lengths, given right-padded in ``idx`` (whatever the
          padding holds); each row continues at its own length (per-row positions), and the result is
          ``(B, max length + max_new_tokens)``, each row's tokens left-aligned, ``pad_token`` after them.
        * ``stop_tokens``: a row that samples one stops; it keeps emitting that stop token (log-prob 0),
          and generation ends when every row has stopped (the rest filled the same way).
        * ``return_logprobs=True`` returns ``(idx, logprobs)``, ``logprobs`` (B, max_new_tokens) float
          (float32 for 16-bit logits): the log-probability of each sampled token under the distribution it
          was drawn from (logits / ``temperature``; at ``temperature=0`` the model's own, temperature 1),
          ``-self(seq, targets, reduction="none", temperature=temperature)`` at the same positions: in the
          bitwise mode computed by that training path's cross-entropy, bit for bit at any tp of the mode;
          in the default numerics from statistics the sampling gather carries (to round-off). With
          ``top_k`` the distribution is renormalised over the top k (the default numerics).

        Example::

            out, logprobs = gpt.generate(prompts, 64, return_logprobs=True, stop_tokens=[eot])
        """
        self._check_ids(idx)
        if idx.shape[1] == 0:
            raise ValueError(f"generate needs at least one token of context, got idx of shape {tuple(idx.shape)}")
        check_int(max_new_tokens, "max_new_tokens", minimum=0)
        if top_k is not None:
            check_int(top_k, "top_k")
        _check_temperature(temperature, positive=False)
        return generation.generate(self, idx, max_new_tokens, temperature, top_k, stop_tokens=stop_tokens,
                                   prompt_lengths=prompt_lengths, pad_token=pad_token,
                                   return_logprobs=return_logprobs, use_cache=use_cache)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded model's state dict, on every rank (a collective)."""
        return tensorpar.full_state_dict(self)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load an unsharded state dict (from any tp size), keeping this rank's shards."""
        tensorpar.load_full_state_dict(self, state_dict)

    @classmethod
    def from_hf(cls, model: nn.Module, *, group: ProcessGroup | None = None) -> GPT:
        """A sharded GPT with the weights of a Hugging Face ``GPT2LMHeadModel``, or of a ``LlamaForCausalLM``
        with tied embeddings (a GPT with ``norm="rmsnorm", positions="rope", mlp="swiglu"``; extra ``hf``),
        on its device and in its dtype. Every rank must hold the same model.

        Example::

            hf = GPT2LMHeadModel.from_pretrained("path/to/gpt2")
            gpt = GPT.from_hf(hf)   # 1/tp of its weights on each rank
        """
        hf_config = getattr(model, "config", None)
        llama = getattr(hf_config, "model_type", None) == "llama"
        config = GPTConfig(**(hf_llama.gpt_config(hf_config) if llama else hf.gpt_config(hf_config)))
        if not hasattr(model, "lm_head"):
            raise TypeError(f"from_hf expects a GPT2LMHeadModel or LlamaForCausalLM (with its LM head), got "
                            f"{type(model).__name__}")
        weight = model.get_input_embeddings().weight
        gpt = cls(config, device="meta", dtype=weight.dtype, group=group)
        gpt.to_empty(device=weight.device)
        state = model.state_dict()
        gpt.load_full_state_dict(hf_llama.gpt_state_dict(state, config.n_layer) if llama else hf.gpt_state_dict(state))
        return gpt.train(model.training)
