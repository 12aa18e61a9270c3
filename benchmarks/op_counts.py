"""Matmuls and copies per training step of our GPT at tp=1 against a plain nanoGPT-style GPT.

    python benchmarks/op_counts.py [--shape small|gpt2] [--batch 2] [--tokens 64]

A ``TorchDispatchMode`` counts the aten ops of one training step (forward, loss,
backward, AdamW step) of each model on the CPU, at the same configuration: matmuls
(``mm``, ``addmm``, ``bmm``, ``matmul``, ``baddbmm``, ``linear``) and copies
(``copy_``, ``clone``, ``_to_copy``, ``cat``, ``contiguous``, ``index``, ``index_select``,
``repeat_interleave``, ``expand_copy``, ``_unsafe_view`` of non-viewable input is not
counted: it is a view). The plain model is nanoGPT's: one ``c_attn`` of ``(3C, C)``,
SDPA, a GELU MLP, the LM head tied to the token embedding.
"""

from __future__ import annotations

import argparse
import collections

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tensorpar
from layers import GPT, GPTConfig

MATMULS = ("mm", "addmm", "bmm", "matmul", "baddbmm", "linear")
COPIES = ("copy_", "clone", "_to_copy", "cat", "contiguous", "index", "index_select", "repeat_interleave",
          "expand_copy", "stack")
SHAPES = {"small": dict(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=64),
          "gpt2": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024)}


class OpCounter(TorchDispatchMode):
    """Counts every aten op called while it is active, by its packet name (``aten.mm``...)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class PlainAttention(nn.Module):
    def __init__(self, c: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn, self.c_proj = nn.Linear(c, 3 * c), nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in self.c_attn(x).split(c, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class PlainBlock(nn.Module):
    def __init__(self, c: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(c), PlainAttention(c, n_head), nn.LayerNorm(c)
        self.c_fc, self.c_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, n_layer: int, n_head: int, n_embd: int, vocab_size: int, block_size: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([PlainBlock(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def step_counts(model: nn.Module, idx: torch.Tensor, autocast: bool) -> collections.Counter[str]:
    """Aten ops of the second training step (the first creates AdamW's state), under bf16 autocast
    when ``autocast``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    for _ in range(2):
        with OpCounter() as counter:
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                loss = model(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return counter.counts


def summary(counts: collections.Counter[str]) -> tuple[int, int, dict[str, int]]:
    copies = {k: counts[k] for k in COPIES if counts[k]}
    return sum(counts[k] for k in MATMULS), sum(copies.values()), copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="small")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--all", action="store_true", help="print every op's count")
    args = parser.parse_args()
    tensorpar.init(tp=1)
    shape = SHAPES[args.shape]
    torch.manual_seed(0)
    idx = torch.randint(0, shape["vocab_size"], (args.batch, args.tokens))
    models = {"plain": PlainGPT(**shape), "ours": GPT(GPTConfig(**shape))}
    for autocast in (False, True):
        for name, model in models.items():
            counts = step_counts(model, idx, autocast)
            matmuls, copies, which = summary(counts)
            print(f"{args.shape} {'bf16 autocast' if autocast else 'fp32':13s} {name:5s}: {matmuls} matmuls, "
                  f"{copies} copies per training step {which}")
            if args.all:
                print(dict(sorted(counts.items())))


if __name__ == "__main__":
    main()
