"""A plain, unsharded GPT written with torch.nn only (nanoGPT-shaped): the twin the
sharded layers are checked against. It imports nothing from tensorpar or layers.

nanoGPT's fused Q/K/V projection c_attn, rows [Q | K | V] (grouped-query attention when
n_kv_head < n_head: fewer K and V rows), attention
written out by hand (scores, causal mask, softmax, dropout, weighted sum), GELU-tanh
or SwiGLU MLP, LayerNorm or RMSNorm, learned positions or rotary embeddings (RoPE, rotate-half,
as Hugging Face Llama), LM head tied to the token embedding.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class RefConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    n_kv_head: int | None = None
    mlp: str = "gelu"
    norm: str = "layernorm"
    positions: str = "learned"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def norm(c):
    return RMSNorm(c.n_embd, c.norm_eps) if c.norm == "rmsnorm" else nn.LayerNorm(c.n_embd, c.norm_eps, bias=c.bias)


def rotate(x, theta):
    """Rotary embedding of heads (B, h, T, d) at positions 0..T-1: feature i turns with i + d/2."""
    T, d = x.shape[-2:]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)           # (d/2,)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq                # (T, d/2)
    angle = torch.cat([angle, angle], dim=-1)                                       # (T, d)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_head, self.n_kv_head = c.n_head, c.n_kv_head or c.n_head
        self.rope_theta = c.rope_theta if c.positions == "rope" else None
        self.head_dim = c.n_embd // c.n_head
        self.c_attn = nn.Linear(c.n_embd, c.n_embd + 2 * self.n_kv_head * self.head_dim, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.attn_dropout = nn.Dropout(c.dropout)
        self.resid_dropout = nn.Dropout(c.dropout)

    def forward(self, x):
        B, T, C = x.shape
        kv = self.n_kv_head * self.head_dim
        q, k, v = self.c_attn(x).split([C, kv, kv], dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)      # (B, nh, T, hd)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)   # (B, nkv, T, hd)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.rope_theta is not None:
            q, k = rotate(q, self.rope_theta), rotate(k, self.rope_theta)
        group = self.n_head // self.n_kv_head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, nh, T, hd)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)                     # (B, nh, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        att = self.attn_dropout(att)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.swiglu = c.mlp == "swiglu"
        hidden = 8 * c.n_embd // 3 if self.swiglu else 4 * c.n_embd
        self.c_fc = nn.Linear(c.n_embd, hidden, bias=c.bias)
        if self.swiglu:
            self.c_gate = nn.Linear(c.n_embd, hidden, bias=c.bias)
        self.c_proj = nn.Linear(hidden, c.n_embd, bias=c.bias)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x):
        h = F.silu(self.c_gate(x)) * self.c_fc(x) if self.swiglu else F.gelu(self.c_fc(x), approximate="tanh")
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1 = norm(c)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = norm(c)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class RefGPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab_size, c.n_embd),
            **({"wpe": nn.Embedding(c.block_size, c.n_embd)} if c.positions == "learned" else {}),
            drop=nn.Dropout(c.dropout),
            h=nn.ModuleList([Block(c) for _ in range(c.n_layer)]),
            ln_f=norm(c),
        ))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied

    def forward(self, idx, targets=None):
        _B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx)
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(pos)
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size:])[:, -1, :]
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("Inf")
                # Gumbel-max: argmax of logits + Gumbel noise drawn per vocabulary entry (B, V) is a draw
                # from softmax(logits), the draw the sharded GPT makes (the same uniforms at every tp)
                noise = -torch.log(-torch.log(torch.rand(logits.shape, dtype=torch.float32, device=logits.device)))
                nxt = (logits + noise).argmax(-1, keepdim=True)
            idx = torch.cat((idx, nxt), dim=1)
        return idx
