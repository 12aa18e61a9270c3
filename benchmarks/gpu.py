"""The GPU figures: a GPT block at tp=1 against plain PyTorch, its MFU, and per-rank shard compute.

    python benchmarks/gpu.py [--n-embd 4096 --n-head 32 --seq 2048 --batch 1] [--write]

In bf16 on a GPU (fp32 on CPU, where the defaults shrink to sizes that run in
seconds, to check the script itself). Rounds interleave every measurement;
figures are medians.

* The matmul ceiling: an 8192² bf16 matmul's rate, measured in the same run.
* Our ``Block`` at tp=1 against a plain-PyTorch block written the way one
  would without tensorpar (one fused QKV ``nn.Linear``, SDPA, tanh-GELU MLP
  of 4C): the ratio plain / ours (≥ 1.0 means ours is as fast or faster), and
  ours' model-FLOPs utilisation against the matmul ceiling. Model FLOPs of a
  block step: forward 2·B·T·12C² (the weight matmuls) + 4·B·T²·C (scores and
  weighted sum), times 3 for forward+backward.
* Per-rank shard compute for tp = 1, 2, 4, 8, simulated on one device: the
  work one rank does at tp (C/tp of the Q/K/V and MLP-up rows, H/tp heads,
  C/tp of the output and MLP-down columns), without communication, as time
  T_tp; compute-scaling efficiency T_1 / (tp · T_tp).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import tensorpar
from layers import Block, GPTConfig
from results import machine, write_section

TP_SIZES = (1, 2, 4, 8)


class PlainBlock(nn.Module):
    def __init__(self, c: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.c_attn, self.attn_proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.c_fc, self.mlp_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in self.c_attn(self.ln_1(x)).split(c, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class ShardBlock(nn.Module):
    """The computation one rank of a tp-way block does: its heads and its slice of the MLP, no communication."""

    def __init__(self, c: int, n_head: int, tp: int) -> None:
        super().__init__()
        self.heads, self.head_dim = n_head // tp, c // n_head
        width = self.heads * self.head_dim
        self.ln_1, self.ln_2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.c_attn, self.attn_proj = nn.Linear(c, 3 * width), nn.Linear(width, c)
        self.c_fc, self.mlp_proj = nn.Linear(c, 4 * c // tp), nn.Linear(4 * c // tp, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.c_attn(self.ln_1(x)).split(self.heads * self.head_dim, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


def timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    def run(fn: Callable[[], None]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start
    return run


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-embd", type=int, default=4096 if cuda else 256)
    parser.add_argument("--n-head", type=int, default=32 if cuda else 8)
    parser.add_argument("--seq", type=int, default=2048 if cuda else 256)
    parser.add_argument("--batch", type=int, default=1 if cuda else 4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=10 if cuda else 3)
    parser.add_argument("--write", action="store_true", help="record the figures in benchmarks/RESULTS.md")
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    b, t, c = args.batch, args.seq, args.n_embd

    tensorpar.init(tp=1)
    torch.manual_seed(0)
    ours = Block(GPTConfig(n_embd=c, n_head=args.n_head, block_size=t), device=device, dtype=dtype)
    plain = PlainBlock(c, args.n_head).to(device, dtype)
    x = torch.randn(b, t, c, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    n = 8192 if cuda else 1024
    a1, a2 = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    shards = {tp: ShardBlock(c, args.n_head, tp).to(device, dtype) for tp in TP_SIZES if args.n_head % tp == 0}

    def steps(model: nn.Module) -> Callable[[], None]:
        def fn() -> None:
            for _ in range(args.iters):
                model.zero_grad(set_to_none=True)
                model(x).backward(grad)
        return fn

    def matmuls() -> None:
        for _ in range(args.iters):
            a1 @ a2

    run = timer(device)
    contenders = {"ours": steps(ours), "plain": steps(plain), "matmul": matmuls}
    contenders |= {f"shard{tp}": steps(shard) for tp, shard in shards.items()}
    for fn in contenders.values():  # warm-up
        run(fn)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            times[name].append(run(fn) / args.iters)
    med = {k: statistics.median(v) for k, v in times.items()}
    flops = 3 * (2 * b * t * 12 * c * c + 4 * b * t * t * c)
    rate = 2 * n**3 / med["matmul"]
    name = torch.cuda.get_device_name() if cuda else "CPU"
    text = (f"| device | dtype | B×T×C, heads | ours ms | plain ms | plain / ours (target ≥ 1.0) | "
            f"matmul TFLOP/s | our TFLOP/s | MFU (target ≥ 60%) |\n|---|---|---|---:|---:|---:|---:|---:|---:|\n"
            f"| {name} | {str(dtype).removeprefix('torch.')} | {b}×{t}×{c}, {args.n_head} | {med['ours'] * 1e3:.2f} | "
            f"{med['plain'] * 1e3:.2f} | {med['plain'] / med['ours']:.3f} | {rate / 1e12:.1f} | "
            f"{flops / med['ours'] / 1e12:.1f} | {100 * flops / med['ours'] / rate:.1f}% |\n\n"
            "| tp | one rank's block compute ms | compute-scaling efficiency T1 / (tp · Ttp) |\n|---:|---:|---:|\n"
            + "\n".join(f"| {tp} | {med[f'shard{tp}'] * 1e3:.2f} | {med['shard1'] / (tp * med[f'shard{tp}']):.3f} |"
                        for tp in shards))
    print(text)
    if args.write:
        write_section(f"GPU figures: block at tp=1 against plain PyTorch, MFU, shard compute ({name})",
                      f"{machine()}; medians of {args.rounds} interleaved rounds × {args.iters} steps "
                      f"(`python benchmarks/gpu.py --write`).\n\n{text}")


if __name__ == "__main__":
    main()
