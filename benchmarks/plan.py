"""The plan's saved activations and step peak per rank against what real ranks measure (CPU, gloo).

    python benchmarks/plan.py [--n-layer 2] [--n-embd 128] [--n-head 6] [--vocab-size 1001] [--batch 2]
                              [--tokens 96] [--dropout 0.0] [--tp 1 2 3 4] [--llama] [--bitwise]

For each tp, with sequence parallelism and activation checkpointing on and off, in float32 and under
bfloat16 autocast, every rank trains the GPT one AdamW step and measures a second one
(:func:`layers.plan_measure.measure_step`): the bytes saved for backward (a ``saved_tensors_hooks`` pack
hook, each storage once, parameters excluded) and the peak of the step's live tensors, optimizer step
included (a ``TorchDispatchMode`` following every storage). The plan (:mod:`layers.plan_activations`)
is given the parameter, gradient and optimizer bytes measured from the model. Each row is the largest
rank (by measured peak); the ratio columns give the worst rank's plan / measured. ``--bitwise``: the model
built in tensorpar's bitwise mode (one CPU thread a rank, as in every row), planned as such.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import tensorpar
from layers import GPTConfig
from layers.plan import Layout
from layers.plan_activations import activation_bytes, peak_bytes
from layers.plan_measure import measure_step
from tensorpar.bitwise.settings import use_bitwise

MIB = 2**20


def _rank(cases: list[dict[str, Any]], batch: int, tokens: int, bitwise: bool) -> list[dict[str, Any]]:
    """On every rank: each case's measured figures and its plan."""
    tensorpar.init()
    torch.set_num_threads(1)
    mesh = tensorpar.current_mesh()
    rows = []
    for case in cases:
        config = GPTConfig(**case["config"])
        autocast = torch.bfloat16 if case["autocast"] else None
        with use_bitwise(bitwise):
            found = measure_step(config, batch, tokens, autocast=autocast)
        layout = Layout(tp=mesh.tp, sequence_parallel=config.sequence_parallel,
                        activation_checkpointing=config.activation_checkpointing, micro_batch=batch, seq_len=tokens,
                        autocast="bfloat16" if autocast else None, bitwise=bitwise)
        rows.append(dict(found, planned_saved=activation_bytes(config, layout, tp_rank=mesh.tp_rank),
                         planned_peak=peak_bytes(config, layout, params=found["params"], grads=found["grads"],
                                                 optimizer=found["optimizer"], tp_rank=mesh.tp_rank)))
    return rows


def measure(config: dict[str, Any], tp_sizes: list[int], batch: int, tokens: int, bitwise: bool = False
            ) -> list[dict[str, Any]]:
    """One row per (tp, sequence parallelism, checkpointing, autocast): the largest rank's figures and
    the worst rank's ratios."""
    results = []
    for tp in tp_sizes:
        cases = [dict(config=dict(config, sequence_parallel=sp, activation_checkpointing=ac), autocast=bf16,
                      tp=tp, sp=sp, ac=ac) for sp in ((False, True) if tp > 1 else (False,))
                 for ac in (False, True) for bf16 in (False, True)]
        per_rank = tensorpar.spawn(_rank, tp, [{k: c[k] for k in ("config", "autocast")} for c in cases],
                                   batch, tokens, bitwise)
        for i, case in enumerate(cases):
            ranks = [r[i] for r in per_rank]
            big = max(ranks, key=lambda r: r["peak"])
            saved = [r["planned_saved"] / r["saved"] for r in ranks]
            peak = [r["planned_peak"] / r["peak"] for r in ranks]
            results.append(dict(case, **big, saved_ratio=max(saved, key=lambda x: abs(x - 1)),
                                peak_ratio=max(peak, key=lambda x: abs(x - 1))))
    return results


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| tp | seq. parallel | checkpointing | dtype | saved: plan MiB | measured MiB | plan / measured "
            "| peak: plan MiB | measured MiB | plan / measured |",
            "|---:|:---:|:---:|:---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        rows.append(f"| {r['tp']} | {'on' if r['sp'] else 'off'} | {'on' if r['ac'] else 'off'} "
                    f"| {'bf16 autocast' if r['autocast'] else 'fp32'} | {r['planned_saved'] / MIB:.3f} "
                    f"| {r['saved'] / MIB:.3f} | {r['saved_ratio']:.3f} | {r['planned_peak'] / MIB:.3f} "
                    f"| {r['peak'] / MIB:.3f} | {r['peak_ratio']:.3f} |")
    saved, peak = [r["saved_ratio"] for r in results], [r["peak_ratio"] for r in results]
    rows.append(f"\nplan / measured over every rank: saved {min(saved):.3f}-{max(saved):.3f} (bound 0.95-1.05), "
                f"peak {min(peak):.3f}-{max(peak):.3f} (bound 0.90-1.10)")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=126)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--vocab-size", type=int, default=1001)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--llama", action="store_true", help="RMSNorm, rotary positions, SwiGLU, 2 KV heads, no bias")
    parser.add_argument("--bitwise", action="store_true", help="the model in tensorpar's bitwise mode")
    args = parser.parse_args()
    config = dict(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab_size,
                  block_size=args.tokens, dropout=args.dropout)
    if args.llama:
        config.update(norm="rmsnorm", positions="rope", mlp="swiglu", n_kv_head=2, bias=False)
    print(f"GPT {config}, B={args.batch}, T={args.tokens}, AdamW{', bitwise mode' if args.bitwise else ''}; each row "
          "the largest rank (the ratios: the worst rank)\n")
    print(table(measure(config, args.tp, args.batch, args.tokens, args.bitwise)))


if __name__ == "__main__":
    main()
