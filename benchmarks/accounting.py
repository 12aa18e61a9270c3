"""Communication and memory of the sharded GPT, against Megatron's formula and total / tp.

    python benchmarks/accounting.py [--tokens 256] [--batch 2] [--write]

* Communication: torch's ``CommDebugMode`` (``tensorpar.testing.count_collectives``) records every
  collective of one block's forward+backward, and of the whole model's, at tp=2. Megatron-LM's count for
  a block is 2 all-reduces of B·T·C forward and 2 backward; the model adds the
  embedding's (forward), the tied LM head's (backward) and the vocab-parallel
  loss's 3 of B·T. The ratio of recorded bytes to that formula must be 1.000.
* Memory: per-rank parameter bytes of GPT-2 small (12 layers, 12 heads, 768,
  vocab 50257), built on the meta device at tp=2 and tp=4, against the unsharded
  model's bytes / tp (the largest rank; the vocabulary is split unpadded).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

import tensorpar
from layers import GPT, GPTConfig
from results import machine, write_section
from tensorpar.testing import count_collectives


def traffic_shapes(t: int) -> list[tuple[int, int]]:
    """(tp, T) of the traffic table: even at tp 2 and 4, uneven at tp 2, 3 and 4."""
    return [(2, t), (4, t), (2, t + 1), (3, t + 1), (4, t + 1)]


GPT2_SMALL = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024)


def count_bytes(b: int, t: int) -> dict[str, object]:
    """On every rank of the current mesh: the collectives of one block, and of a 2-layer GPT with its loss,
    with and without sequence parallelism."""
    torch.manual_seed(0)
    config = GPTConfig(**(GPT2_SMALL | dict(n_layer=2)))
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (b, t))
    x = torch.randn(b, t, config.n_embd, requires_grad=True)
    with count_collectives() as block:
        model.transformer.h[0](x).sum().backward()
    with count_collectives() as whole:
        model(idx, idx).backward()
    act, tokens = b * t * config.n_embd * 4, b * t * 4  # float32 bytes
    return dict(
        block=(block.count(), block.bytes(), 4 * act),
        whole=(whole.count(), whole.bytes(), (4 * config.n_layer + 2) * act + 3 * tokens),
        block_summary=sorted((phase, op, numel, n) for (phase, op, _, numel), n in block.summary().items()),
        sequence=sequence_traffic(b, t),
    )


def sequence_traffic(b: int, t: int) -> dict[str, float]:
    """On every rank: bytes one rank sends (ring algorithms) for one block's forward+backward, plain tp
    and sequence-parallel, split as Megatron counts them, and the formulas.

    Per block, Megatron's tensor parallelism all-reduces ``B·T·C`` twice forward and twice backward:
    ``4 · 2 (n-1)/n · B·T·C·s`` bytes per rank. Sequence parallelism replaces each all-reduce by a
    reduce-scatter and an all-gather, ``(n-1)/n · B·T·C·s`` each: the same. Ours adds, in backward,
    one all-gather per column region (its input, kept as this rank's tokens) and one all-reduce of
    each LayerNorm's weight and bias gradients (``2C`` elements).
    """
    mesh = tensorpar.current_mesh()
    n, c = mesh.tp, GPT2_SMALL["n_embd"]
    torch.manual_seed(0)
    figures: dict[str, float] = {}
    for sp in (False, True):
        block = GPT(GPTConfig(**(GPT2_SMALL | dict(n_layer=1, sequence_parallel=sp)))).transformer.h[0]
        local = tensorpar.sequence_sizes(t, n)[mesh.tp_rank] if sp else t
        x = torch.randn(b, local, c, requires_grad=True)
        with count_collectives() as counts:
            block(x, t).sum().backward()
        # an activation's collectives move B·T·C, uneven token shards padded to the largest
        logical = b * t * c
        padded = b * n * max(tensorpar.sequence_sizes(t, n)) * c if sp else logical
        activation = [r for r in counts.records if r.numel in (logical, padded)]
        regathers = counts.traffic("all_gather", "backward") / 2  # of the 4 backward all-gathers, 2 gather inputs
        key = "sequence" if sp else "plain"
        moved = sum(r.traffic() for r in activation) - (regathers if sp else 0)
        figures[f"{key} activations"] = moved * logical / padded
        figures[f"{key} activations padded"] = moved
        figures[f"{key} all"] = counts.traffic()
        figures[f"{key} count"] = counts.count()
    ring = (n - 1) / n * b * t * c * 4  # one all-gather or reduce-scatter of B·T·C floats
    figures["megatron"] = 4 * 2 * ring
    figures["ours with sequence parallelism"] = 4 * 2 * ring + 2 * ring + 2 * 2 * (n - 1) / n * 2 * c * 4
    return figures


def traffic_table(results: dict[tuple[int, int], dict[str, float]], b: int) -> str:
    """``{(tp, T): sequence_traffic figures}`` as one markdown table of ratios to the formulas."""
    rows = [f"| tp | T (B={b}, C={GPT2_SMALL['n_embd']}, fp32) | Megatron's bytes per rank | plain tp | "
            "sequence parallel, activations | padding included | everything (with re-gathers, LayerNorm "
            "gradients) vs ours | collectives plain / sequence parallel |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (tp, t), f in results.items():
        m = f["megatron"]
        rows.append(f"| {tp} | {t} | {m:.0f} | {f['plain all'] / m:.3f} | {f['sequence activations'] / m:.3f} | "
                    f"{f['sequence activations padded'] / m:.3f} | "
                    f"{f['sequence all'] / f['ours with sequence parallelism']:.3f} | "
                    f"{f['plain count']:.0f} / {f['sequence count']:.0f} |")
    return "\n".join(rows)


def parameter_bytes() -> tuple[int, int]:
    """(this rank's parameter bytes, the unsharded model's) for GPT-2 small on the meta device."""
    model = GPT(GPTConfig(**GPT2_SMALL), device="meta")
    geometry = tensorpar.shard_geometry(model)
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    full = sum(math.prod(geometry[name]["full_shape"]) * p.element_size() for name, p in model.named_parameters())
    return local, full


def _spawned(fn: Any, *args: Any) -> Any:
    tensorpar.init()
    return fn(*args)


def spawned_parameter_bytes(tp: int) -> tuple[int, int]:
    """(largest rank's parameter bytes, unsharded bytes) of GPT-2 small at ``tp`` local ranks."""
    results = tensorpar.spawn(_spawned, tp, parameter_bytes)
    return max(r[0] for r in results), results[0][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="record the figures in benchmarks/RESULTS.md")
    args = parser.parse_args()

    comm = tensorpar.spawn(_spawned, 2, count_bytes, args.batch, args.tokens)[0]
    rows = [f"| what (tp=2, B={args.batch}, T={args.tokens}, C=768, fp32) | collectives | bytes | Megatron's formula "
            "| ratio |", "|---|---:|---:|---:|---:|"]
    for name, label in (("block", "one block, forward+backward"), ("whole", "2-layer GPT with loss")):
        n, got, formula = comm[name]
        rows.append(f"| {label} | {n} | {got} | {formula} | {got / formula:.3f} |")
    detail = ", ".join(f"{n}× {op} of {numel} elements ({phase})" for phase, op, numel, n in comm["block_summary"])

    mem = ["| tp | largest rank's parameter bytes | unsharded bytes / tp | ratio (target ≤ 1.003) |",
           "|---:|---:|---:|---:|"]
    for tp in (2, 4):
        local, full = spawned_parameter_bytes(tp)
        mem.append(f"| {tp} | {local} | {full / tp:.0f} | {local / (full / tp):.4f} |")

    traffic = traffic_table({(tp, t): tensorpar.spawn(_spawned, tp, sequence_traffic, args.batch, t)[0]
                             for tp, t in traffic_shapes(args.tokens)}, args.batch)
    text = "\n".join(rows) + f"\n\nOne block: {detail}.\n\n" + "\n".join(mem) + "\n\n" + traffic
    print(text)
    if args.write:
        write_section("Collective bytes and per-rank parameter memory of the GPT",
                      f"{machine()}, gloo (`python benchmarks/accounting.py --write`). Memory: GPT-2 small "
                      f"(12 layers, 12 heads, n_embd 768, vocab 50257, block 1024), built on the meta device.\n\n"
                      + text)


if __name__ == "__main__":
    main()
