"""Sampling from a :class:`~layers.GPT`: prefill the prompts into its KV cache, then one token per step.

Each step takes this rank's vocabulary slice of the last position's logits and picks the next token with
one all-gather of a few numbers per rank (:mod:`layers.sampling`: greedy, or Gumbel-max sampling, the same
draw at every tp), which also carries the statistics of the token's log-probability in the default
numerics. In the bitwise mode the token is scored by the model's own vocab-parallel cross-entropy, the
training path's: the log-probabilities are the bits ``-model(seq, targets, reduction="none",
temperature=τ)`` gives at any tp of the mode.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tensorpar.checks import check_int

from . import sampling
from .kv_cache import KVCache

GPT = Any  # a layers.GPT (which imports this module)


def last_logits(model: GPT, idx: torch.Tensor, last: torch.Tensor | None, cache: KVCache | None,
                embedded: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's vocabulary slice of the logits at position ``last[r]`` of each row of ``idx`` (B, S)
    (``None``: the last position of every row), run after the tokens ``cache`` holds (or from position 0),
    from their embeddings ``embedded`` (B, S, C) where given: ``(B, V / tp)``."""
    h = model._hidden(idx, cache, embedded)  # (B, S, C), or with sequence parallelism this rank's (B, S_r, C)
    if model.config.sequence_parallel:  # the rows' last tokens may lie on any rank: the head gathers them
        h = model.lm_head(h, idx.shape[1])  # (B, S, V / tp)
        return h[:, -1] if last is None else h[torch.arange(idx.shape[0], device=idx.device), last]
    if last is None:
        return model.lm_head(h[:, -1])  # (B, V / tp)
    return model.lm_head(h[torch.arange(idx.shape[0], device=idx.device), last])


def _lengths(idx: torch.Tensor, prompt_lengths: torch.Tensor | Iterable[int] | None) -> list[int]:
    b, t = idx.shape
    if prompt_lengths is None:
        return [t] * b
    lengths = [int(n) for n in (prompt_lengths.tolist() if isinstance(prompt_lengths, torch.Tensor)
                                else prompt_lengths)]
    if len(lengths) != b or any(not 1 <= n <= t for n in lengths):
        raise ValueError(f"prompt_lengths must hold {b} lengths in [1, {t}] (idx is {tuple(idx.shape)}), "
                         f"got {lengths}")
    return lengths


@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, *, stop_tokens: Iterable[int] | None = None,
             prompt_lengths: torch.Tensor | Iterable[int] | None = None, pad_token: int = 0,
             return_logprobs: bool = False, use_cache: bool = True) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:meth:`layers.GPT.generate` (see there)."""
    b = idx.shape[0]
    lengths = _lengths(idx, prompt_lengths)
    stops = sorted({int(s) for s in stop_tokens or ()})
    for token in [*stops, pad_token]:
        check_int(token, "a stop or pad token", minimum=0)
    block = model.config.block_size
    longest = max(lengths)
    ragged = len(set(lengths)) > 1
    cached = use_cache and longest + max_new_tokens <= block
    if ragged and longest + max_new_tokens > block:
        raise ValueError(f"prompts of different lengths need room for every token: the longest ({longest}) and "
                         f"max_new_tokens ({max_new_tokens}) exceed block_size ({block})")
    rows = torch.arange(b, device=idx.device)
    at = torch.tensor(lengths, device=idx.device)  # (B,) where each row's next token goes
    out = idx.new_full((b, longest + max_new_tokens), pad_token)  # each row's prompt, not the padding after it
    out[:, :longest] = idx[:, :longest].masked_fill(torch.arange(longest, device=idx.device) >= at[:, None], pad_token)
    logprobs = []
    stop_set = torch.tensor(stops, dtype=out.dtype, device=idx.device)
    done = torch.zeros(b, dtype=torch.bool, device=idx.device)
    stopped_with = out.new_zeros(b)
    cache = model.new_cache(b) if cached else None
    nxt = at  # (B,) the tokens sampled last
    if cache is not None:  # prefill: every prompt, right-padded to the longest; each row's last token's logits
        logits = last_logits(model, idx[:, :longest], at - 1 if ragged else None, cache)
        if ragged:
            cache.truncate_(lengths)
    # decoding, each step's gather (at tp > 1) brings the next token's embedding: no all-reduce, no lookup
    carried = cache is not None and not model.config.sequence_parallel
    # chosen once: the bitwise mode scores a sampled token by the training path's loss, for its bits (top-k:
    # by the sampler, renormalised over the k)
    by_loss = return_logprobs and model.numerics is not None and not (top_k is not None and temperature != 0)
    embedded = None
    for step in range(max_new_tokens):
        if step and cache is not None:
            logits = last_logits(model, nxt[:, None], None, cache, embedded)  # decode: (B, V / tp)
        elif cache is None:  # recompute from the start (the last block_size tokens when they are more)
            end = longest + step
            lo = max(0, end - block)
            logits = last_logits(model, out[:, lo:end], at + step - 1 - lo if ragged else None, None)
        last = step == max_new_tokens - 1
        nxt, logprob, embedded = _sample(model, logits, temperature, top_k, return_logprobs and not by_loss,
                                         by_loss, cache if carried and not last else None)
        if stops:
            nxt = torch.where(done, stopped_with, nxt)  # a row that stopped repeats its stop token, log-prob 0
        if logprob is not None:
            logprobs.append(logprob.masked_fill(done, 0.0) if stops else logprob)
        if ragged:
            out[rows, at + step] = nxt
        else:
            out[:, longest + step] = nxt
        if stops:
            newly = torch.isin(nxt, stop_set) & ~done
            stopped_with = torch.where(newly, nxt, stopped_with)
            done |= newly
            if bool(done.all()):  # the rest repeats every row's stop token
                for rest in range(step + 1, max_new_tokens):
                    out[rows, at + rest] = stopped_with
                    logprobs += [] if logprob is None else [torch.zeros_like(logprob)]
                break
    if not return_logprobs:
        return out
    scores = torch.stack(logprobs, 1) if logprobs else torch.zeros(b, 0, device=idx.device)  # (B, max_new_tokens)
    return out, scores


def _sample(model: GPT, logits: torch.Tensor, temperature: float, top_k: int | None, scored: bool, by_loss: bool,
            cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The next token of each row from this rank's logits (B, V / tp), the same on every rank
    (:func:`~layers.sampling.sample`); its log-probability (B,) under the distribution it was drawn from
    (greedy: under the model itself), from the sampler's statistics where ``scored``, as the model's
    per-token loss makes it where ``by_loss``, else ``None``; and given the ``cache`` the token continues,
    its embedding (B, 1, C) at the cache's positions, or ``None``."""
    embedding = None
    if cache is not None:
        parts = model.transformer
        share = parts.wpe(cache.lengths) if "wpe" in parts else None  # (B, C): this rank's rows' lookups
        embedding = (parts.wte.weight, share)
    nxt, logprob, embedded = sampling.sample(logits, model.config.vocab_size, temperature, top_k, model.tp_group,
                                             scored, embedding)
    if by_loss:  # -(the training path's cross-entropy of the sampled token)
        logprob = -model._loss(logits, nxt, "none", temperature or 1.0)
    return nxt, logprob, None if embedded is None else embedded[:, None]
