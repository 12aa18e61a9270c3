"""A plain nanoGPT-style GPT in torch.nn only: the model the whole-step benchmark measures ours against.

Written the way one would without tensorpar: one fused ``c_attn`` for Q, K and V, SDPA
with ``is_causal``, a tanh-GELU MLP of ``4 C``, pre-LayerNorm blocks, learned positions
and an LM head tied to the token embedding. It reads the fields of a
:class:`layers.GPTConfig` (``block_size``, ``vocab_size``, ``n_layer``, ``n_head``,
``n_embd``, ``dropout``, ``bias``) and has nanoGPT's parameter names, so a full state
dict of our GPT loads into it once ``q_proj``, ``k_proj`` and ``v_proj`` are concatenated.

``generate`` samples from it with a KV cache written plainly, gpt-fast style: each layer's keys and values
preallocated ``(B, n_head, block_size, hs)``, written by slicing, prefill causal and each decoded token
attending to the cache's first ``pos + 1`` slots; the model the generation benchmark measures ours against.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None = None, pos: int = 0) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
                   for z in self.c_attn(x).split(self.n_embd, dim=2))
        if cache is not None:  # [keys, values] (B, nh, block_size, hs): store these, read all so far
            cache[0][:, :, pos:pos + t] = k
            cache[1][:, :, pos:pos + t] = v
            if pos:  # decoding one token: it reads every slot so far
                k, v = cache[0][:, :, :pos + t], cache[1][:, :, :pos + t]
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=t > 1)
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None = None, pos: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, pos)
        return x + self.mlp(self.ln_2(x))


class PlainGPT(nn.Module):
    """``model(idx)`` -> logits ``(B, T, V)``; ``model(idx, targets)`` -> mean cross-entropy (-1 ignored)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "n_kv_head", None) not in (None, config.n_head) or getattr(config, "mlp", "gelu") != "gelu":
            raise ValueError("PlainGPT is multi-head attention with a GELU MLP: n_kv_head must be None or n_head "
                             f"(got {config.n_kv_head}) and mlp 'gelu' (got {config.mlp!r})")
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def last_logits(self, idx: torch.Tensor, caches: list[list[torch.Tensor]], pos: int) -> torch.Tensor:
        """The logits ``(B, V)`` after ``idx`` (B, T), which follows the ``pos`` tokens held in ``caches``."""
        t = idx.shape[1]
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(pos, pos + t, device=idx.device))
        for block, cache in zip(self.transformer.h, caches, strict=True):
            x = block(x, cache, pos)
        return self.lm_head(self.transformer.ln_f(x[:, -1]))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0) -> torch.Tensor:
        """``idx`` (B, T) followed by ``max_new_tokens`` tokens sampled with a KV cache (greedy at
        ``temperature=0``): ``(B, T + max_new_tokens)``."""
        b, t = idx.shape
        c = self.config
        shape = (b, c.n_head, c.block_size, c.n_embd // c.n_head)
        caches = [[idx.new_zeros(shape, dtype=self.lm_head.weight.dtype) for _ in range(2)] for _ in range(c.n_layer)]
        tokens = [idx]
        logits = self.last_logits(idx, caches, 0)  # prefill
        for step in range(max_new_tokens):
            if step:
                logits = self.last_logits(tokens[-1], caches, t + step - 1)  # decode one token
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                nxt = torch.multinomial(F.softmax(logits / temperature, -1), 1)
            tokens.append(nxt)  # (B, 1)
        return torch.cat(tokens, 1)
