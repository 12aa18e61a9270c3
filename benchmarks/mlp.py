"""MLP forward+backward: tensorpar at tp=1 against plain nn.Linear, and tp=2 against tp=1.

    python benchmarks/mlp.py [--hidden 768] [--tokens 1024] [--rounds 7] [--write]

Everything runs with one thread per rank and is measured side by side in one
run: each round times the dense MLP, our MLP at tp=1 (both in this process)
and our MLP at tp=2 (two pooled worker processes), so drift in the machine
hits all three alike. A tp=2 step takes as long as its slower rank. Figures
are medians over rounds. ``--write`` records them in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from results import machine, write_section
from torch import nn

import tensorpar
from layers import ColumnParallelLinear, RowParallelLinear
from tensorpar.testing import World


def dense_mlp(h: int) -> nn.Module:
    return nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))


def our_mlp(h: int) -> nn.Module:
    return nn.Sequential(ColumnParallelLinear(h, 4 * h), nn.GELU(), RowParallelLinear(4 * h, h))


def step_times(model: nn.Module, tokens: int, h: int, iters: int) -> list[float]:
    """Seconds per forward+backward (input and weight gradients) of ``iters`` steps, after one warm-up."""
    x = torch.randn(tokens, h, requires_grad=True)
    g = torch.randn(tokens, h)
    times = []
    for i in range(iters + 1):
        for p in model.parameters():
            p.grad = None
        x.grad = None
        start = time.perf_counter()
        model(x).backward(g)
        if i:
            times.append(time.perf_counter() - start)
    return times


_MODELS: dict[int, nn.Module] = {}


def time_ours(h: int, tokens: int, iters: int) -> list[float]:
    """In a pool worker: our MLP at the pool's tp, built once per size."""
    if h not in _MODELS:
        torch.manual_seed(0)
        _MODELS[h] = our_mlp(h)
    return step_times(_MODELS[h], tokens, h, iters)


def measure(h: int, tokens: int, rounds: int, iters: int, pool: World) -> dict[str, float]:
    torch.manual_seed(0)
    dense, ours = dense_mlp(h), our_mlp(h)
    samples: dict[str, list[float]] = {"dense": [], "tp1": [], "tp2": []}
    for _ in range(rounds):
        samples["dense"] += step_times(dense, tokens, h, iters)
        samples["tp1"] += step_times(ours, tokens, h, iters)
        per_rank = pool.run(time_ours, h, tokens, iters)
        samples["tp2"] += [max(ts) for ts in zip(*per_rank)]  # a step ends when its slower rank does
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[768])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="record the table in benchmarks/RESULTS.md")
    args = parser.parse_args()

    torch.set_num_threads(1)
    tensorpar.init(tp=1)  # a world of one for the tp=1 model in this process
    pool = World(2, timeout=600)
    rows = []
    try:
        for h in args.hidden:
            m = measure(h, args.tokens, args.rounds, args.iters, pool)
            rows.append((h, m))
    finally:
        pool.close()

    lines = ["| hidden | tokens | dense ms | tp=1 ms | tp=2 ms | tp=1 / dense (target ≤ 1.02) | "
             "tp=1 / tp=2 speed-up (target ≥ 1.85) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for h, m in rows:
        lines.append(f"| {h} | {args.tokens} | {m['dense'] * 1e3:.1f} | {m['tp1'] * 1e3:.1f} | {m['tp2'] * 1e3:.1f} | "
                     f"{m['tp1'] / m['dense']:.3f} | {m['tp1'] / m['tp2']:.2f}× |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        write_section("MLP h → 4h → GELU → h, forward+backward, fp32, one thread per rank",
                      f"{machine()}, gloo; medians of {args.rounds} interleaved rounds × {args.iters} steps "
                      f"(`python benchmarks/mlp.py --write`).\n\n{table}")

if __name__ == "__main__":
    main()
