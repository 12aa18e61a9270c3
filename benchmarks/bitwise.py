"""The bitwise mode's price: step time and saved activations against the default mode, at tp 1 and 2.

    python benchmarks/bitwise.py [--rounds 5] [--write]

Four workloads, each in both modes on the same ranks (one CPU thread each: the mode's own setting,
and the default mode's too, so that only the mode differs): the MLP at hidden 768 (1024 tokens,
forward+backward), a GPT block (n_embd 768, 12 heads, 4×256 tokens, forward+backward) and a small
GPT's whole training step (4 layers, n_embd 256, 8 heads, vocabulary 8192, 4×256 tokens: forward,
loss, backward, clipping, AdamW), and the same step of the demo model, ``examples/train_gpt.py``'s
defaults (4 layers, n_embd 128, 4 heads, no biases, 256 byte values, 16×64 tokens); ``--workloads``
picks some. Figures are medians over interleaved rounds of the slowest rank's
step; memory is the bytes of the distinct storages autograd keeps for backward in one forward
(parameters excluded), the largest rank's. Target: bitwise / default ≤ 1.5 at tp = 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import activation_memory
import tensorpar
from layers import GPT, Block, GPTConfig, ParallelMLP
from results import machine, write_section
from tensorpar.testing import World

SMALL_GPT = dict(n_layer=4, n_embd=256, n_head=8, vocab_size=8192, block_size=256)
DEMO_GPT = dict(n_layer=4, n_embd=128, n_head=4, vocab_size=256, block_size=64, bias=False)  # train_gpt.py's
GPT_STEPS = {"small GPT step": (SMALL_GPT, 4), "demo GPT step": (DEMO_GPT, 16)}  # the model and its batch
WORKLOADS = ("MLP h=768", "GPT block", *GPT_STEPS)
ORDERS = [(1, False), (1, True), (2, False), (2, True)]
_BUILT: dict[tuple[str, bool], tuple[nn.Module, Callable[[], torch.Tensor], Any]] = {}


def _workload(name: str) -> tuple[nn.Module, Callable[[], torch.Tensor], Any]:
    """``name``'s module, a step closure and its optimizer (built once per mode in this rank)."""
    bitwise = tensorpar.current_bitwise() is not None
    if (name, bitwise) in _BUILT:
        return _BUILT[(name, bitwise)]
    torch.manual_seed(0)
    optimizer = None
    if name == "MLP h=768":
        module: nn.Module = ParallelMLP(768, 4 * 768)
        x = torch.randn(1024, 768, requires_grad=True)

        def step() -> torch.Tensor:
            y = module(x)
            y.backward(torch.ones_like(y))
            return y
    elif name == "GPT block":
        module = Block(GPTConfig(n_embd=768, n_head=12, block_size=256))
        xb = torch.randn(4, 256, 768, requires_grad=True)

        def step() -> torch.Tensor:
            y = module(xb)
            y.backward(torch.ones_like(y))
            return y
    else:
        spec, batch = GPT_STEPS[name]
        module = GPT(GPTConfig(**spec))
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        ids = torch.randint(0, spec["vocab_size"], (batch, spec["block_size"] + 1),
                            generator=torch.Generator().manual_seed(0))

        def step() -> torch.Tensor:
            loss = module(ids[:, :-1], ids[:, 1:])
            loss.backward()
            tensorpar.clip_grad_norm_(module, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss
    _BUILT[(name, bitwise)] = (module, step, optimizer)
    return _BUILT[(name, bitwise)]


def time_steps(name: str, steps: int, clock: str = "wall") -> list[float]:
    """In a pool rank: seconds of each of ``steps`` steps of ``name`` in the current mode, after a warm-up:
    elapsed (``clock="wall"``), or this process's CPU time (``"cpu"``: what the rank computed, waits for
    its peers and for a busy machine's other processes left out)."""
    torch.set_num_threads(1)
    module, step, _ = _workload(name)
    now = time.perf_counter if clock == "wall" else time.process_time
    times = []
    for i in range(steps + 1):
        module.zero_grad(set_to_none=True)
        start = now()
        step()
        if i:
            times.append(now() - start)
    return times


def saved_bytes(name: str) -> int:
    """In a pool rank: bytes of the distinct non-parameter storages one step of ``name`` saves for backward."""
    module, step, _ = _workload(name)
    saved = activation_memory.saved_bytes(module, step)
    module.zero_grad(set_to_none=True)
    return saved


def measure(pools: dict[int, World], rounds: int, steps: int, workloads: tuple[str, ...] = WORKLOADS,
            clock: str = "wall") -> tuple[dict[Any, float], dict[Any, int]]:
    samples: dict[Any, list[float]] = {}
    for r in range(rounds):
        for name in workloads:
            for tp, bitwise in ORDERS[r % len(ORDERS):] + ORDERS[:r % len(ORDERS)]:  # each round another first
                per_rank = pools[tp].run(time_steps, name, steps, clock, bitwise=bitwise, timeout=600)
                samples.setdefault((name, tp, bitwise), []).extend(max(ts) for ts in zip(*per_rank, strict=True))
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    memory = {(name, tp, bitwise): max(pools[tp].run(saved_bytes, name, bitwise=bitwise))
              for name in workloads for tp in (1, 2) for bitwise in (False, True)}
    return {k: statistics.median(v) for k, v in samples.items()}, memory


def report(times: dict[Any, float], memory: dict[Any, int]) -> str:
    lines = ["| workload | tp | default ms | bitwise ms | bitwise / default | default saved MiB | bitwise saved MiB | "
             "bitwise / default |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in dict.fromkeys(name for name, _, _ in times):
        for tp in (1, 2):
            d, b = times[(name, tp, False)], times[(name, tp, True)]
            md, mb = memory[(name, tp, False)], memory[(name, tp, True)]
            lines.append(f"| {name} | {tp} | {d * 1e3:.1f} | {b * 1e3:.1f} | {b / d:.2f} | {md / 2**20:.1f} | "
                         f"{mb / 2**20:.1f} | {mb / md:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per workload, mode and round")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="elapsed time, or each rank's CPU time (on a machine others load)")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--write", action="store_true", help="record the table in benchmarks/RESULTS.md")
    args = parser.parse_args()
    pools = {tp: World(tp, timeout=600) for tp in (1, 2)}
    try:
        times, memory = measure(pools, args.rounds, args.steps, tuple(args.workloads), args.clock)
    finally:
        for pool in pools.values():
            pool.close()
    table = report(times, memory)
    print(table)
    if args.write:
        write_section("The bitwise mode's price", f"{machine()}, gloo, one thread per rank; medians of {args.rounds} "
                      f"interleaved rounds × {args.steps} steps of the slowest rank "
                      f"(`python benchmarks/bitwise.py --write`). Target: bitwise / default ≤ 1.5 at tp = 2.\n\n"
                      + table)


if __name__ == "__main__":
    main()
