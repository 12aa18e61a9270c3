"""Swap a dense MLP for its tensor-parallel twin at tp=2 and check they agree.

    python examples/demo.py            # 2 local processes, gloo on CPU

Each rank keeps half of fc1's rows and half of fc2's columns; one all-reduce in
forward and one in backward make the sharded MLP compute exactly what the dense
one does. Initialisation, outputs and gradients are compared on every rank.
"""

import argparse
import copy
from collections import OrderedDict

import torch
from torch import nn

import tensorpar
from tensorpar.testing import assert_sharded_equivalent


def dense_mlp(d: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(OrderedDict(fc1=nn.Linear(d, hidden), act=nn.GELU(), fc2=nn.Linear(hidden, d)))


def run(d: int, hidden: int, tokens: int) -> dict:
    mesh = tensorpar.init()  # every spawned rank is a tp rank
    torch.manual_seed(0)     # the same dense model on every rank
    dense = dense_mlp(d, hidden)
    sharded = tensorpar.parallelize(copy.deepcopy(dense), {"fc1": "column", "fc2": "row"})

    x = torch.randn(tokens, d)
    with tensorpar.count_collectives() as counts:
        errors = assert_sharded_equivalent(sharded, dense, x)
    return {
        "rank": mesh.rank,
        "fc1": tuple(sharded.fc1.weight.shape), "fc2": tuple(sharded.fc2.weight.shape),
        "params": sum(p.numel() for p in sharded.parameters()),
        "dense_params": sum(p.numel() for p in dense.parameters()),
        "worst_error": max(errors.values()),
        "all_reduces": counts.count("all_reduce", phase="forward") + counts.count("all_reduce", phase="backward"),
        "repr": repr(sharded.fc1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--d", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=383, help="need not divide by tp")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    results = tensorpar.spawn(run, args.tp, args.d, args.hidden, args.tokens)
    print(f"dense MLP {args.d} -> {args.hidden} -> GELU -> {args.d}, swapped to tensor parallel at tp={args.tp}\n")
    for r in results:
        print(f"rank {r['rank']}: fc1 weight {r['fc1']}, fc2 weight {r['fc2']}, "
              f"{r['params']:,} of {r['dense_params']:,} parameters, "
              f"{r['all_reduces']} all-reduces in forward+backward")
        print(f"        {r['repr']}")
    worst = max(r["worst_error"] for r in results)
    print(f"\nworst relative error vs the dense MLP (output, input grad, every weight grad): {worst:.2e}")
    if worst > 1e-5:
        raise SystemExit("MISMATCH: the sharded MLP does not match the dense one")
    print("OK: the sharded MLP matches the dense one")


if __name__ == "__main__":
    main()
