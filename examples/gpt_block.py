"""A sharded GPT-2 block against the same block written in plain torch.nn.

    python examples/gpt_block.py                          # tp=2: 2 local processes, gloo on CPU
    python examples/gpt_block.py --tp 3 --n-head 5        # heads need not divide by tp

``layers.Block`` is a pre-LayerNorm transformer block whose attention is split
by head (one ``c_attn`` for Q, K and V, column-parallel, ``c_proj``
row-parallel) and whose MLP is split by hidden feature (``c_fc`` column,
``c_proj`` row). ``DenseBlock`` below is the unsharded block with the same
parameter names, so its ``state_dict()`` loads straight into the sharded one
with ``tensorpar.load_full_state_dict``. The script does that on every rank,
then compares the output, the input gradient and every parameter gradient
(gathered to full size), prints the errors and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tensorpar
from layers import Block, GPTConfig
from tensorpar.testing import TOLERANCES, assert_sharded_equivalent

DTYPES = {"float32": torch.float32, "float64": torch.float64}


class DenseSelfAttention(nn.Module):
    """Causal multi-head self-attention, unsharded, written out. ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)  # rows [Q | K | V]
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (z.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
                   for z in self.c_attn(x).split(C, dim=-1))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, nh, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)  # (B, T, C): heads side by side
        return self.c_proj(y)


class DenseMLP(nn.Module):
    """``c_proj(gelu_tanh(c_fc(x)))`` with hidden ``4 * n_embd``. ``(*, C) -> (*, C)``."""

    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class DenseBlock(nn.Module):
    """GPT-2's pre-LayerNorm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``. ``(B, T, C)``."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = DenseSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = DenseMLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def randomize_layernorms(block: nn.Module) -> None:
    """Give the LayerNorms non-trivial weights (fresh ones are 1 and 0), so their gradients are tested too."""
    with torch.no_grad():
        for module in block.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.normal_(1.0, 0.1)
                module.bias.normal_(0.0, 0.1)


def run(n_embd: int, n_head: int, batch: int, seq: int, dtype_name: str) -> dict[str, Any]:
    """On every rank: load the dense block's weights into a sharded one and compare them."""
    mesh = tensorpar.init()  # every spawned rank is a tp rank
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)  # the same dense block and input on every rank
    dense = DenseBlock(n_embd, n_head).to(mesh.device, dtype)
    randomize_layernorms(dense)
    block = Block(GPTConfig(n_embd=n_embd, n_head=n_head), device=mesh.device, dtype=dtype)
    tensorpar.load_full_state_dict(block, dense.state_dict())

    x = torch.randn(batch, seq, n_embd, dtype=dtype).to(mesh.device)
    # rtol=inf: return every error and let the caller judge, so a mismatch still prints the table
    errors = assert_sharded_equivalent(block, dense, x, rtol=math.inf)
    return {
        "rank": mesh.rank,
        "errors": errors,
        "heads": block.attn.local_heads,
        "c_attn": tuple(block.attn.c_attn.weight.shape),
        "c_fc": tuple(block.mlp.c_fc.weight.shape),
        "params": sum(p.numel() for p in block.parameters()),
        "dense_params": sum(p.numel() for p in dense.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (local processes)")
    parser.add_argument("--n-embd", type=int, default=80, help="model width, a multiple of --n-head")
    parser.add_argument("--n-head", type=int, default=5, help="attention heads; need not divide by tp")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=12)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args()
    for name in ("tp", "n_embd", "n_head", "batch", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd ({args.n_embd}) is not divisible by --n-head ({args.n_head})")
    if args.n_head < args.tp:
        parser.error(f"--n-head ({args.n_head}) must be at least --tp ({args.tp}): every rank needs a whole head")

    results = tensorpar.spawn(run, args.tp, args.n_embd, args.n_head, args.batch, args.seq, args.dtype)
    print(f"GPT-2 block, n_embd={args.n_embd}, n_head={args.n_head}, {args.dtype}, input "
          f"({args.batch}, {args.seq}, {args.n_embd}), sharded at tp={args.tp}\n")
    for r in results:
        print(f"rank {r['rank']}: {r['heads']} heads, c_attn {r['c_attn']}, c_fc {r['c_fc']}, "
              f"{r['params']:,} of {r['dense_params']:,} parameters")

    tolerance = TOLERANCES[DTYPES[args.dtype]]
    worst: dict[str, float] = {}
    for r in results:
        for name, err in r["errors"].items():
            worst[name] = max(worst.get(name, 0.0), err)
    print(f"\nrelative error vs the dense block, worst over ranks (tolerance {tolerance:.0e}):")
    for name, err in worst.items():
        print(f"    {name:28} {err:.2e}" + ("" if err <= tolerance else "   MISMATCH"))
    failures = [name for name, err in worst.items() if not err <= tolerance]  # NaN fails too
    if failures:
        raise SystemExit(f"MISMATCH: the sharded block differs from the dense one in: {', '.join(failures)}")
    print(f"OK: the sharded block matches the dense one at tp={args.tp} "
          f"(output, input grad and {len(worst) - 2} parameter grads within {tolerance:.0e})")


if __name__ == "__main__":
    main()
