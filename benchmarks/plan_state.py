"""The plan's parameter, gradient and optimizer bytes per rank against what real ranks hold (CPU, gloo).

    python benchmarks/plan_state.py [--n-layer 2] [--block-size 32] [--optimizer adamw]

For each layout (tp 1-4; pp 2 at tp 1 and 2; dp 2 under DDP, ZeRO, FSDP2 and FSDP2 with the optimizer
state offloaded to the host), in float32 and bfloat16, for a GPT of uneven heads, KV heads and
vocabulary and for a Llama-style one, every rank builds the model and optimizer as
``examples/train_gpt.py`` does, steps once and counts the bytes of the distinct storages of its
parameters, gradients and optimizer state, DDP's gradient buckets and, under offload, the host's
(:func:`layers.plan_measure.measure_state`); :func:`layers.plan` gives the planned ones. Each row shows
the rank with the most planned bytes; the last columns the largest |plan - measured| over every rank.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

import tensorpar
from layers import GPTConfig, Layout, plan
from layers.plan_measure import STATE_FIELDS, measure_state

UNEVEN = dict(n_head=6, n_kv_head=3, n_embd=126, vocab_size=1001)
LLAMA = dict(n_head=6, n_kv_head=2, n_embd=96, vocab_size=1001, norm="rmsnorm", positions="rope", mlp="swiglu",
             bias=False)
#: (tp, pp, dp) and the dp shardings run on it; "fsdp+offload": FSDP2 with ``offload_optimizer``
MESHES = [((1, 1, 1), ["ddp"]), ((2, 1, 1), ["ddp"]), ((3, 1, 1), ["ddp"]), ((4, 1, 1), ["ddp"]),
          ((1, 2, 1), ["ddp"]), ((2, 2, 1), ["ddp"]), ((1, 1, 2), ["ddp", "zero", "fsdp", "fsdp+offload"])]


def _rank(cases: list[tuple[dict[str, Any], dict[str, Any]]], tp: int, pp: int, dp: int,
          batch: int) -> list[tuple[dict[str, int], dict[str, int]]]:
    """On every rank: each (config, layout)'s measured and planned bytes."""
    mesh = tensorpar.init(tp=tp, dp=dp, pp=pp)
    torch.set_num_threads(1)
    rows = []
    for i, (fields, layout_fields) in enumerate(cases):
        config, layout = GPTConfig(**fields), Layout(**layout_fields)
        g = torch.Generator().manual_seed(i * 100 + mesh.dp_rank)  # each dp rank its own batch
        idx, targets = (torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g) for _ in range(2))
        measured, _ = measure_state(config, layout, idx, targets, seed=i)
        planned = dataclasses.asdict(plan(config, layout).rank(mesh.tp_rank, mesh.pp_rank, mesh.dp_rank))
        rows.append((measured, {k: planned[k] for k in STATE_FIELDS}))
    return rows


def measure(configs: dict[str, dict[str, Any]], optimizer: str, batch: int) -> list[dict[str, Any]]:
    """One row per (config, layout, dtype): the figures of the rank with the most planned bytes, and the
    largest |plan - measured| of each kind over every rank."""
    results = []
    for (tp, pp, dp), shardings in MESHES:
        cases, names = [], []
        for name, fields in configs.items():
            for sharding in shardings:
                for dtype in ("float32", "bfloat16"):
                    layout = dict(tp=tp, pp=pp, dp=dp, microbatches=pp, dp_sharding=sharding.split("+")[0],
                                  offload_optimizer=sharding.endswith("offload"), dtype=dtype, optimizer=optimizer)
                    cases.append((fields, layout))
                    names.append(dict(config=name, sharding=sharding if dp > 1 else "", **layout))
        per_rank = tensorpar.spawn(_rank, tp * pp * dp, cases, tp, pp, dp, batch)
        for i, name in enumerate(names):
            ranks = [r[i] for r in per_rank]
            measured, planned = max(ranks, key=lambda r: sum(r[1].values()))
            row: dict[str, Any] = dict(name, plan=planned, measured=measured)
            for kind in ("params", "grads", "optimizer", "ddp_bucket"):
                keys = [k for k in STATE_FIELDS if k.endswith(f"{kind}_bytes")]  # the device's and the host's
                row[f"diff_{kind}"] = max(abs(p[k] - m[k]) for m, p in ranks for k in keys)
            results.append(row)
    return results


def _both(figures: dict[str, int], kind: str) -> str:
    """The device's bytes of a kind, or the host's (marked) where the device holds none."""
    device, host = figures[f"{kind}_bytes"], figures.get(f"host_{kind}_bytes", 0)
    return f"{device:,}" if device or not host else f"{host:,} (host)"


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| config | tp | pp | dp | dtype | params: plan B | measured B | grads: plan B | measured B "
            "| optimizer: plan B | measured B | max abs(plan - measured) over ranks: params / grads / optimizer "
            "/ DDP buckets |",
            "|:---|---:|---:|:---|:---|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in results:
        dp = f"{r['dp']} {r['sharding']}".strip()
        cells = [_both(r[side], kind) for kind in ("params", "grads", "optimizer") for side in ("plan", "measured")]
        rows.append(f"| {r['config']} | {r['tp']} | {r['pp']} | {dp} | {r['dtype']} | {' | '.join(cells)} "
                    f"| {r['diff_params']} / {r['diff_grads']} / {r['diff_optimizer']} / {r['diff_ddp_bucket']} |")
    worst = max(max(r[f"diff_{k}"] for k in ("params", "grads", "optimizer", "ddp_bucket")) for r in results)
    rows.append(f"\nlargest abs(plan - measured) over every layout, rank and kind: {worst} bytes")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    args = parser.parse_args()
    common = dict(n_layer=args.n_layer, block_size=args.block_size)
    configs = {"uneven": dict(UNEVEN, **common), "llama": dict(LLAMA, **common)}
    print(f"uneven: {configs['uneven']}\nllama: {configs['llama']}\nB={args.batch}, {args.optimizer}; each row "
          "the rank with the most planned bytes\n")
    print(table(measure(configs, args.optimizer, args.batch)))


if __name__ == "__main__":
    main()
