"""Generation speed: new tokens/s with the KV cache, by recomputation, and a plain cached nanoGPT-style model.

    python benchmarks/generate.py [--rounds 3] [--write]

Greedy generation of ``--new`` (256) tokens after a ``--prompt`` (64) token prompt, batch 1 and 8, one
thread per rank: our GPT's cache path (``generate``) and recomputation path (``use_cache=False``) at
tp 1 and 2 (a pool of two gloo processes), and the plain single-process model of ``plain_gpt.py`` with
its plainly written KV cache, loaded with the same weights (tp 1). The bitwise mode's cache path is
timed beside the default's. New tokens/s count the prefill in. On a shared, oversubscribed machine the
CPU time a rank spends (``time.process_time``) is far steadier than the wall clock, so the ratios are
of CPU time (tokens/s by the wall clock are given too): the decode time per token is the CPU time
between consecutive calls of the LM head, and "flat" compares the mean of the last 32 decode steps
with the first 32's (at tp 1 the plain model's beside ours: the last steps' attention reads five times the
keys, which shows at batch 8 in both). Figures are medians over interleaved rounds (recomputation, far slower, runs
``--recompute-rounds`` times); a tp=2 run counts its slower rank.

At tp > 1 the cache and recomputation paths are timed once more with the ranks' collectives replaced by
local stand-ins of the same shapes (``without_communication``: the sums and picks are then wrong, every
other operation of the step is the same): the ratio they reach is the cap that communication leaves room
for on this machine, as ``run.py``'s no-communication MLP is for the speed-up.
Targets (CPU): cache / recomputation ≥ 5, ours / plain at tp 1 ≤ 1.10 (time), last 32 / first 32 ≤ 1.2.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import sys
import time
from typing import Any
from unittest import mock

import torch
from torch import nn

import layers.sampling
import tensorpar.comm.collectives
import tensorpar.comm.linear
from layers import GPT, GPTConfig
from plain_gpt import PlainGPT
from results import machine, write_section
from tensorpar.testing import World

MODEL = dict(n_layer=4, n_embd=256, n_head=8, vocab_size=8192, bias=True, dropout=0.0)
PATHS = ("cache", "recompute", "plain", "bitwise", "cache, no communication", "recompute, no communication")
_BUILT: dict[tuple[str, bool], nn.Module] = {}


def _model(kind: str, bitwise: bool, config: dict[str, Any]) -> nn.Module:
    """This rank's model (built once per kind and mode): ours, or the plain one with our weights."""
    key = (kind, bitwise)
    if key not in _BUILT:
        torch.manual_seed(0)
        ours = GPT(GPTConfig(**config)).eval()
        if kind == "plain":
            plain = PlainGPT(GPTConfig(**config)).eval()
            plain.load_state_dict(ours.full_state_dict())
            _BUILT[key] = plain
        else:
            _BUILT[key] = ours
    return _BUILT[key]


def without_communication() -> contextlib.ExitStack:
    """A context in which this rank's generation issues no collective: each all-reduce returns its input and
    the token's gather stacks this rank's candidates as every rank's (greedy decoding, the default numerics)."""
    def alone(x: torch.Tensor, group: Any, *, op: str = "sum") -> tensorpar.comm.collectives.Pending:
        return tensorpar.comm.collectives.Pending(x)

    def stacked(rows: torch.Tensor, dim: int, sizes: list[int], group: Any) -> torch.Tensor:
        return torch.cat([rows] * len(sizes), dim)

    stack = contextlib.ExitStack()
    for module, name, stand_in in ((tensorpar.comm.linear, "start_all_reduce_", alone),  # the row maps'
                                   (tensorpar.comm.collectives, "start_all_reduce_", alone),  # the embeddings'
                                   (layers.sampling, "all_gather_along", stacked)):
        stack.enter_context(mock.patch.object(module, name, stand_in))
    return stack


def time_generation(path: str, batch: int, prompt: int, new: int, config: dict[str, Any]
                    ) -> tuple[float, float, list[float]]:
    """In a pool rank: seconds to generate ``new`` tokens for ``batch`` prompts of ``prompt`` tokens on
    ``path`` (wall-clock, and this process's CPU time), and the CPU seconds of each decode step (between
    consecutive LM-head calls)."""
    torch.set_num_threads(1)
    model = _model("plain" if path == "plain" else "ours", path == "bitwise", config)
    idx = torch.randint(0, config["vocab_size"], (batch, prompt), generator=torch.Generator().manual_seed(batch))
    stamps: list[float] = []
    hook = model.lm_head.register_forward_hook(lambda *_: stamps.append(time.process_time()))
    alone = without_communication() if path.endswith("no communication") else contextlib.nullcontext()
    with alone:
        try:
            model.generate(idx, 16, temperature=0)  # warm-up
            stamps.clear()
            start, cpu = time.perf_counter(), time.process_time()
            if path == "plain":
                model.generate(idx, new, temperature=0)
            else:
                model.generate(idx, new, temperature=0, use_cache=not path.startswith("recompute"))
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        finally:
            hook.remove()
    return elapsed, cpu, [b - a for a, b in itertools.pairwise(stamps)]


def measure(pools: dict[int, World], args: argparse.Namespace, config: dict[str, Any]
            ) -> dict[tuple[str, int, int], tuple[float, float, float]]:
    """(path, tp, batch) -> medians of new tokens/s, of the same by CPU time, of last-32 / first-32 decode time."""
    runs = [(path, tp, b) for b in args.batch for tp in args.tp for path in PATHS
            if not (path == "plain" and tp > 1) and not (path.endswith("no communication") and tp == 1)]
    samples: dict[tuple[str, int, int], list[tuple[float, float, float]]] = {}
    for r in range(args.rounds):
        for path, tp, b in runs[r % len(runs):] + runs[:r % len(runs)]:  # each round another first
            if path.startswith("recompute") and r >= args.recompute_rounds:
                continue
            per_rank = pools[tp].run(time_generation, path, b, args.prompt, args.new, config,
                                     bitwise=path == "bitwise", timeout=3600)
            elapsed, cpu = (max(run[i] for run in per_rank) for i in (0, 1))
            steps = [max(s) for s in zip(*(run[2] for run in per_rank), strict=True)]
            flat = statistics.mean(steps[-32:]) / statistics.mean(steps[:32])
            samples.setdefault((path, tp, b), []).append((b * args.new / elapsed, b * args.new / cpu, flat))
            print(f"round {r + 1}: {path} tp={tp} batch={b}: {b * args.new / elapsed:.1f} tokens/s "
                  f"({b * args.new / cpu:.1f} by CPU time), flat {flat:.2f}", file=sys.stderr)
    return {k: tuple(statistics.median(run[i] for run in v) for i in range(3)) for k, v in samples.items()}  # type: ignore[misc]


def report(figures: dict[tuple[str, int, int], tuple[float, float, float]], args: argparse.Namespace) -> str:
    lines = ["| tp | batch | cache tok/s (wall) | cache tok/s (CPU) | recompute tok/s (CPU) | cache / recompute | "
             "no communication: cache / recompute | plain cached tok/s (CPU) | ours / plain (time) | "
             "last 32 / first 32 | bitwise tok/s (CPU) | bitwise / default (time) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for tp in args.tp:
        for b in args.batch:
            wall, cache, flat = figures[("cache", tp, b)]
            recompute = figures[("recompute", tp, b)][1]
            bitwise = figures[("bitwise", tp, b)][1]
            _, plain, plain_flat = figures.get(("plain", 1, b), (float("nan"),) * 3)
            vs_plain = f"{plain:.1f} | {plain / cache:.2f}" if tp == 1 else "– | –"
            flatness = f"{flat:.2f} (plain {plain_flat:.2f})" if tp == 1 else f"{flat:.2f}"
            alone = "–"
            if tp > 1:  # the same ratio with no collective issued
                cut = [figures[(f"{path}, no communication", tp, b)][1] for path in ("cache", "recompute")]
                alone = f"{cut[0] / cut[1]:.1f}"
            lines.append(f"| {tp} | {b} | {wall:.1f} | {cache:.1f} | {recompute:.1f} | {cache / recompute:.1f} | "
                         f"{alone} | {vs_plain} | {flatness} | {bitwise:.1f} | {cache / bitwise:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--recompute-rounds", type=int, default=1, help="rounds that also time recomputation")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--n-layer", type=int, default=MODEL["n_layer"])
    parser.add_argument("--n-embd", type=int, default=MODEL["n_embd"])
    parser.add_argument("--n-head", type=int, default=MODEL["n_head"])
    parser.add_argument("--write", action="store_true", help="record the table in benchmarks/RESULTS.md")
    args = parser.parse_args()
    config = dict(MODEL, n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                  block_size=args.prompt + args.new)
    load = os.getloadavg()
    pools = {tp: World(tp, timeout=3600) for tp in args.tp}
    try:
        figures = measure(pools, args, config)
    finally:
        for pool in pools.values():
            pool.close()
    load_after = os.getloadavg()
    table = report(figures, args)
    shape = (f"{config['n_layer']} layers, n_embd {config['n_embd']}, {config['n_head']} heads, vocabulary "
             f"{config['vocab_size']}, fp32; {args.new} new tokens after {args.prompt}, greedy")
    loads = f"1-minute load {load[0]:.1f} before, {load_after[0]:.1f} after"
    print(f"{shape}; {loads}\n{table}")
    if args.write:
        write_section("Generation speed", f"{machine()}, gloo, one thread per rank; {shape}; medians of "
                      f"{args.rounds} interleaved rounds (recomputation: {args.recompute_rounds}); ratios and per-step "
                      f"times of CPU time (`time.process_time`, the slower rank's), steady where the wall clock "
                      f"is not on this shared machine; \"no communication\": the same two paths with every collective "
                      f"replaced by a local stand-in of its shape (wrong sums, the same other work: the ratio the "
                      f"machine allows before any message); {loads} "
                      f"(`python benchmarks/generate.py --write`). Targets: cache / recompute ≥ 5, ours / plain "
                      f"(time) ≤ 1.10 at tp 1, last 32 / first 32 ≤ 1.2.\n\n" + table)


if __name__ == "__main__":
    main()
