"""Every benchmark side by side in one run: MLP against peers, strong scaling, communication, memory.

    python benchmarks/run.py [--rounds 7] [--write]        (make bench)

One thread per rank. The dense and tp=1 MLPs of a size take turns step by
step (each step starting with the other), so drift in the machine hits both
alike. The tp=2 contenders each run their steps in a row, in turn (each round
starting with another one): each holds its own process groups, and taking
turns step by step would time how fast one wakes from another's collectives
(at h=64 that added 1 ms to tensorpar's 1.9 ms step and nothing to the peers'),
which no training loop does. Figures are medians over rounds. The
tp=1 and dense models run in this process; tp=2 contenders run in a pool of
two processes in one gloo group, and a tp=2 step lasts as long as its slower
rank. ``--write`` records the tables in benchmarks/RESULTS.md.

* MLP h -> 4h -> GELU -> h, fp32, forward+backward with input and weight
  gradients, at h = 64 (64 tokens), 256 and 768 (1024 tokens): tensorpar at
  tp=1 against the dense ``nn.Linear`` MLP; tensorpar at tp=2 against PyTorch
  DTensor (``ColwiseParallel``/``RowwiseParallel``), fairscale and
  Megatron-Core at tp=2 (the ``bench`` extra; a missing peer is reported);
  with sequence parallelism (tokens split outside the MLP), tensorpar against
  DTensor's plan (``input_layouts=Shard(0)``, ``output_layouts=Shard(0)``) and
  Megatron-Core's ``sequence_parallel=True``.
* Strong scaling, tp=2 (2 ranks x 1 thread) against tp=1 (1 thread): the MLP
  at h=768 and a GPT block (n_embd 768, 12 heads, 4 x 256 tokens), with and
  without sequence parallelism, next to the cap measured in the same run: each
  rank running its tp=2 share of the MLP with no communication at all; the same
  block compiled whole by ``torch.compile`` (inductor) against eager, at tp 1 and 2.
* Communication: bytes one block moves forward+backward against Megatron's
  formula, and the all-reduce bandwidth, gloo's and ours, measured in the same run.
* Memory: per-rank parameter bytes of GPT-2 small against total / tp; saved
  activations per rank with and without activation checkpointing
  (``activation_memory.py``); distributed checkpoint save and load time and
  peak memory per rank (``checkpoint_bench.py``), at tp 1, 2 and 4.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import accounting
import activation_memory
import checkpoint_bench
import peers
import tensorpar
from layers import Block, GPTConfig
from results import machine, write_section
from tensorpar.comm.collectives import start_all_reduce_
from tensorpar.testing import World

SIZES = {64: (64, 300), 256: (1024, 12), 768: (1024, 5)}  # hidden: (tokens, steps per measurement)
BLOCK = dict(n_embd=768, n_head=12, batch=4, seq=256, steps=2)
ACTIVATIONS = dict(activation_memory.GPT2_WIDTH, n_layer=4, block_size=256)  # the saved-activation GPT


def step_times(model: nn.Module, x: torch.Tensor, steps: int) -> list[float]:
    """Seconds of each of ``steps`` forward+backward passes (input and weight gradients), after a warm-up."""
    return alternating_step_times([(model, x)], steps)[0]


def alternating_step_times(runs: list[tuple[nn.Module, torch.Tensor]], steps: int) -> list[list[float]]:
    """Seconds of each of ``steps`` forward+backward passes of every (model, input) of ``runs``, the models
    taking turns step by step (each step starting with the next one), after a warm-up step of each: drift in
    the machine then falls on all of them alike, however short it lasts."""
    grads = [torch.randn_like(x) for _, x in runs]
    times: list[list[float]] = [[] for _ in runs]
    for i in range(steps + 1):
        for j in range(len(runs)):
            k = (i + j) % len(runs)
            (model, x), g = runs[k], grads[k]
            model.zero_grad(set_to_none=True)
            x.grad = None
            start = time.perf_counter()
            model(x).backward(g)
            if i:
                times[k].append(time.perf_counter() - start)
    return times


_CACHE: dict[tuple[str, int], nn.Module] = {}


def _my_tokens(tokens: int) -> int:
    mesh = tensorpar.current_mesh()
    return tensorpar.sequence_sizes(tokens, mesh.tp)[mesh.tp_rank]


def time_mlp(lib: str, h: int, tokens: int, steps: int) -> list[float]:
    """In a pool rank: ``lib``'s tp MLP at hidden ``h``, built once; a sequence-parallel one gets this
    rank's tokens."""
    if (lib, h) not in _CACHE:
        torch.manual_seed(0)
        _CACHE[(lib, h)] = (peers.SEQUENCE_BUILDERS[lib](h, tokens) if lib in peers.SEQUENCE_BUILDERS
                            else peers.no_communication(h) if lib == CAP else peers.BUILDERS[lib](h))
    local = _my_tokens(tokens) if lib in peers.SEQUENCE_BUILDERS else tokens
    return step_times(_CACHE[(lib, h)], torch.randn(local, h, requires_grad=True), steps)


CAP = "no communication"


class _SequenceBlock(nn.Module):
    def __init__(self, block: nn.Module, seq: int) -> None:
        super().__init__()
        self.block, self.seq = block, seq

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x, self.seq)


def gpt_block(n_embd: int, n_head: int, seq: int, compiled: bool, sequence_parallel: bool = False) -> nn.Module:
    """A GPT block, eager or compiled whole by inductor (its first call compiles)."""
    torch.manual_seed(0)
    block = Block(GPTConfig(n_embd=n_embd, n_head=n_head, block_size=seq, sequence_parallel=sequence_parallel))
    if compiled:
        block.compile(fullgraph=True)
    return _SequenceBlock(block, seq) if sequence_parallel else block


def time_block(n_embd: int, n_head: int, batch: int, seq: int, steps: int, compiled: bool = False,
               sequence_parallel: bool = False) -> list[float]:
    key = ("block", compiled, sequence_parallel)
    if key not in _CACHE:
        _CACHE[key] = gpt_block(n_embd, n_head, seq, compiled, sequence_parallel)
    local = _my_tokens(seq) if sequence_parallel else seq
    return step_times(_CACHE[key], torch.randn(batch, local, n_embd, requires_grad=True), steps)


def all_reduce_bandwidth(numel: int, repeats: int, ours: bool) -> float:
    """Bus bandwidth of a float32 all-reduce of ``numel`` elements, GB/s (2 (n-1)/n x bytes / time):
    gloo's own (``dist.all_reduce``), or tensorpar's (``start_all_reduce_``: c10d's, started then waited for)."""
    x = torch.ones(numel)
    group = tensorpar.current_mesh().tp_group

    def reduce() -> None:
        if ours:
            start_all_reduce_(x, group).wait()
        else:
            dist.all_reduce(x, group=group)

    reduce()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        reduce()
        times.append(time.perf_counter() - start)
    n = dist.get_world_size()
    return 2 * (n - 1) / n * numel * 4 / statistics.median(times) / 1e9


def slowest_rank(per_rank: list[list[float]]) -> list[float]:
    return [max(ts) for ts in zip(*per_rank, strict=True)]  # a step ends when its slower rank does


def measure(pool: World, rounds: int, libs: list[str]) -> dict[str, Any]:
    samples: dict[Any, list[float]] = {}
    local = {("dense", h): peers.dense(h) for h in SIZES} | {("tp1", h): peers.ours(h) for h in SIZES}
    blocks = {compiled: gpt_block(BLOCK["n_embd"], BLOCK["n_head"], BLOCK["seq"], compiled)
              for compiled in (False, True)}
    for r in range(rounds):
        for h, (tokens, steps) in SIZES.items():
            x = torch.randn(tokens, h, requires_grad=True)
            pair = [("dense", h), ("tp1", h)][r % 2:] + [("dense", h), ("tp1", h)][:r % 2]  # each round another first
            for key, times in zip(pair, alternating_step_times([(local[key], x) for key in pair], steps), strict=True):
                samples.setdefault(key, []).extend(times)
            contenders = libs + ([CAP] if h == max(SIZES) else [])
            for lib in contenders[r % len(contenders):] + contenders[:r % len(contenders)]:  # each round another first
                per_rank = pool.run(time_mlp, lib, h, tokens, steps)
                samples.setdefault((lib, h), []).extend(slowest_rank(per_rank))
        xb = torch.randn(BLOCK["batch"], BLOCK["seq"], BLOCK["n_embd"], requires_grad=True)
        for compiled in (r % 2 == 1, r % 2 == 0):  # the first step of each compiles, untimed
            samples.setdefault(("block", 1, compiled), []).extend(step_times(blocks[compiled], xb, BLOCK["steps"]))
            for sp in (r % 2 == 0, r % 2 == 1) if not compiled else (False,):
                samples.setdefault(("block", 2, compiled, sp), []).extend(
                    slowest_rank(pool.run(time_block, *BLOCK.values(), compiled, sp)))
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--write", action="store_true", help="record the tables in benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tensorpar.init(tp=1)  # a world of one for the tp=1 models in this process
    everyone = [*peers.BUILDERS, *peers.SEQUENCE_BUILDERS]
    missing = {lib: why for lib in everyone if (why := peers.available(lib))}
    libs = [lib for lib in everyone if lib not in missing]
    pool = World(2, timeout=900)
    try:
        pool.run(peers.available, "fairscale")  # start the pool outside the timings
        m = measure(pool, args.rounds, libs)
        bandwidth = {ours: statistics.median(pool.run(all_reduce_bandwidth, 4 << 20, 9, ours))  # 16 MB
                     for ours in (False, True)}
        comm = pool.run(accounting.count_bytes, 2, 256)[0]
    finally:
        pool.close()
    traffic = {(tp, t): tensorpar.spawn(accounting._spawned, tp, accounting.sequence_traffic, 2, t)[0]
               for tp, t in accounting.traffic_shapes(256)}
    memory = {tp: accounting.spawned_parameter_bytes(tp) for tp in (2, 4)}
    saved = activation_memory.measure([1, 2, 4], ACTIVATIONS, 1, 256)
    checkpoints = checkpoint_bench.measure([1, 2, 4], checkpoint_bench.CONFIG)
    print(report(m, libs, missing, bandwidth, comm, traffic, memory, saved, checkpoints))
    if args.write:
        write_section("All benchmarks, side by side (benchmarks/run.py)",
                      f"{machine()}, gloo, one thread per rank; medians of {args.rounds} interleaved rounds "
                      f"(`python benchmarks/run.py --write`).\n\n"
                      + report(m, libs, missing, bandwidth, comm, traffic, memory, saved, checkpoints))


def report(m: dict[Any, float], libs: list[str], missing: dict[str, str], bandwidth: dict[bool, float],
           comm: dict[str, Any], traffic: dict[tuple[int, int], dict[str, float]], memory: dict[int, tuple[int, int]],
           saved: dict[int, dict[str, int]], checkpoints: Any) -> str:
    plain = [lib for lib in libs if lib in peers.BUILDERS]
    sequence = [lib for lib in libs if lib in peers.SEQUENCE_BUILDERS]
    head = ("| h | tokens | dense ms | tp=1 ms | tp=1 / dense | " + " | ".join(f"{lib} tp=2 ms" for lib in libs)
            + " | tensorpar / best peer | tensorpar SP / best SP peer | speed-up tp=1 / tp=2 | with SP |")
    rows = [head, "|" + "---:|" * (head.count("|") - 1)]
    for h, (tokens, _) in SIZES.items():
        best = min((m[(lib, h)] for lib in plain if lib != "tensorpar"), default=float("nan"))
        best_sp = min((m[(lib, h)] for lib in sequence if lib != "tensorpar SP"), default=float("nan"))
        rows.append(f"| {h} | {tokens} | {m[('dense', h)] * 1e3:.3f} | {m[('tp1', h)] * 1e3:.3f} | "
                    f"{m[('tp1', h)] / m[('dense', h)]:.3f} | "
                    + " | ".join(f"{m[(lib, h)] * 1e3:.3f}" for lib in libs)
                    + f" | {m[('tensorpar', h)] / best:.3f} | {m[('tensorpar SP', h)] / best_sp:.3f} "
                    f"| {m[('tp1', h)] / m[('tensorpar', h)]:.2f}× | {m[('tp1', h)] / m[('tensorpar SP', h)]:.2f}× |")
    h = max(SIZES)
    block = {key: m[("block", 2, False, key)] for key in (False, True)}
    n, sent, formula = comm["block"]
    return "\n".join([
        "MLP h → 4h → GELU → h, fp32, forward+backward; SP: with sequence parallelism, each rank holding "
        "tokens / 2 of the input and output. Targets: tp=1 / dense ≤ 1.02 at h=768 and ≤ 1.05 at "
        "h=64; tensorpar / best peer below 1 at every h; speed-up ≥ 1.92× at h=768, with and without SP.", "",
        *rows, "",
        f"Cap on the speed-up at h={h}, measured in the same rounds: each rank running its tp=2 share of the MLP "
        f"(h → 2h → h) with no communication takes {m[(CAP, h)] * 1e3:.3f} ms, a speed-up of "
        f"{m[('tp1', h)] / m[(CAP, h)]:.2f}× over tp=1; tensorpar reaches "
        f"{m[(CAP, h)] / m[('tensorpar', h)]:.3f} of it, {m[(CAP, h)] / m[('tensorpar SP', h)]:.3f} with SP.", "",
        f"GPT block (n_embd {BLOCK['n_embd']}, {BLOCK['n_head']} heads, {BLOCK['batch']}×{BLOCK['seq']} tokens) "
        f"forward+backward (target ≥ 1.90×): tp=1 {m[('block', 1, False)] * 1e3:.1f} ms, "
        f"tp=2 {block[False] * 1e3:.1f} ms (speed-up {m[('block', 1, False)] / block[False]:.2f}×), "
        f"tp=2 with SP {block[True] * 1e3:.1f} ms (speed-up {m[('block', 1, False)] / block[True]:.2f}×).", "",
        "The same block compiled whole (`torch.compile(fullgraph=True)`, inductor; target: compiled tp=2 faster "
        f"than eager): tp=1 eager {m[('block', 1, False)] * 1e3:.1f} ms, compiled {m[('block', 1, True)] * 1e3:.1f} ms "
        f"(compiled / eager {m[('block', 1, True)] / m[('block', 1, False)]:.3f}), tp=2 eager {block[False] * 1e3:.1f} "
        f"ms, compiled {m[('block', 2, True, False)] * 1e3:.1f} ms (compiled / eager "
        f"{m[('block', 2, True, False)] / block[False]:.3f}).", "",
        f"Communication of one block at tp=2 (B=2, T=256, C=768): {n} collectives, {sent} bytes; Megatron's formula "
        f"{formula} bytes; ratio {sent / formula:.3f}. All-reduce of 16 MB between the 2 ranks, bus bandwidth: "
        f"gloo {bandwidth[False]:.2f} GB/s, tensorpar (c10d, async) {bandwidth[True]:.2f} GB/s.", "",
        "Bytes each rank sends for one block's forward+backward (ring algorithms), plain and sequence-parallel, "
        "as ratios to Megatron's formula (`accounting.sequence_traffic`):", "",
        accounting.traffic_table(traffic, 2), "",
        "Per-rank parameter bytes of GPT-2 small (largest rank) / (total / tp): "
        + ", ".join(f"tp={tp}: {local / (full / tp):.4f}" for tp, (local, full) in memory.items())
        + " (target ≤ 1.003).", "",
        "Saved activations per rank with and without activation checkpointing (largest rank; fp32, B=1, T=256, "
        "GPT-2 width, 4 layers):", "", activation_memory.table(saved, ACTIVATIONS, 1, 256), "",
        "One block's saved activations per rank with sequence parallelism, against the formula of "
        "`activation_memory.block_formula` (B=1, T=256):", "",
        activation_memory.sequence_table(saved, ACTIVATIONS, 1, 256),
        "",
        "Distributed checkpoints: save and load of the model and its AdamW state, each rank its own shards "
        f"(GPT {checkpoint_bench.CONFIG}):", "", checkpoint_bench.table(checkpoints), "",
    ] + ([f"Not measured: {lib} ({why})." for lib, why in missing.items()]))


if __name__ == "__main__":
    main()
