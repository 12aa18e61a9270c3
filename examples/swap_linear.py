"""Convert an existing dense model to tensor parallelism by a plan, and check it.

    python examples/swap_linear.py                     # tp=2: 2 local processes, gloo on CPU
    python examples/swap_linear.py --tp 3 --hidden 250 # sizes need not divide by tp

The model is an ordinary ``torch.nn`` language model: a token embedding, a stack
of residual MLP blocks (LayerNorm, fc1, GELU, fc2) and a linear head. One call
to ``layers.parallelize`` swaps its layers for their sharded twins, keeping
the weights:

* ``embed``          -> ``VocabParallelEmbedding`` (rows of the table split),
* ``blocks.*.fc1``   -> ``ColumnParallelLinear``   (output features split),
* ``blocks.*.fc2``   -> ``RowParallelLinear``      (input features split, output all-reduced),
* ``head``           -> ``ColumnParallelLinear`` with ``gather_output=True``.

Each rank then holds about ``1/tp`` of the parameters. The script compares the
sharded model with the dense one on every rank (weights, forward output, every
parameter gradient, gathered to full size), prints the errors and each rank's
parameter memory, and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import copy
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tensorpar
from layers import ColumnParallelLinear, parallelize
from tensorpar.testing import TOLERANCES, rel_error

DTYPES = {"float32": torch.float32, "float64": torch.float64}


class MLPBlock(nn.Module):
    """``x + fc2(gelu(fc1(ln(x))))``. ``(*, d) -> (*, d)``."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    """Token ids ``(B, T)`` -> logits ``(B, T, vocab)``: embedding, MLP blocks, LayerNorm, head."""

    def __init__(self, vocab: int, d: int, hidden: int, n_layer: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([MLPBlock(d, hidden) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)  # (B, T, d)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


#: Which layer becomes which sharded twin; globs match every block.
PLAN: dict[str, Any] = {
    "embed": "embedding",
    "blocks.*.fc1": "column",
    "blocks.*.fc2": "row",
    # a plan value may also be any callable that converts the dense module
    "head": functools.partial(ColumnParallelLinear.from_linear, gather_output=True),
}


def param_bytes(model: nn.Module) -> int:
    """Bytes held by the parameters of ``model`` (tied parameters counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run(vocab: int, d: int, hidden: int, n_layer: int, batch: int, seq: int, dtype_name: str) -> dict[str, Any]:
    """On every rank: build the dense model, parallelize a copy, compare; return the measurements."""
    mesh = tensorpar.init()  # every spawned rank is a tp rank
    dtype = DTYPES[dtype_name]
    torch.manual_seed(0)  # the same dense model and data on every rank
    dense = TinyLM(vocab, d, hidden, n_layer).to(mesh.device, dtype)
    sharded = parallelize(copy.deepcopy(dense), PLAN)

    idx = torch.randint(0, vocab, (batch, seq)).to(mesh.device)
    grad_out = torch.randn(batch, seq, vocab, dtype=dtype).to(mesh.device)  # fed to both backward passes
    y_dense, y = dense(idx), sharded(idx)  # (B, T, vocab) each
    y_dense.backward(grad_out)
    y.backward(grad_out)

    # collectives first, comparisons after: a mismatch then reports on every rank alike
    full_weights = tensorpar.full_state_dict(sharded)
    grads = tensorpar.full_grads(sharded)
    dense_grads = {k: p.grad for k, p in dense.named_parameters()}
    if set(grads) != set(dense_grads):
        raise RuntimeError(f"sharded gradients {sorted(grads)} do not match the dense {sorted(dense_grads)}")
    # each gradient is measured against the larger of its own norm and the whole gradient's
    scale = torch.cat([g.double().flatten().cpu() for g in dense_grads.values()]).norm().item()
    weights_equal = all(torch.equal(full_weights[k], v) for k, v in dense.state_dict().items())
    errors = {"output": rel_error(y, y_dense)}
    errors.update({f"grad {k}": rel_error(grads[k], dense_grads[k], scale) for k in sorted(dense_grads)})
    return {
        "rank": mesh.rank,
        "weights_equal": weights_equal,
        "errors": errors,
        "bytes": param_bytes(sharded),
        "dense_bytes": param_bytes(dense),
        "fc1": tuple(sharded.blocks[0].fc1.weight.shape),
        "embed": tuple(sharded.embed.weight.shape),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (local processes)")
    parser.add_argument("--vocab", type=int, default=1001, help="vocabulary size; need not divide by tp")
    parser.add_argument("--d", type=int, default=128, help="model width")
    parser.add_argument("--hidden", type=int, default=511, help="MLP hidden size; need not divide by tp")
    parser.add_argument("--layers", type=int, default=2, help="number of MLP blocks")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args()
    for name in ("tp", "vocab", "d", "hidden", "layers", "batch", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
    for name in ("vocab", "hidden"):
        if getattr(args, name) < args.tp:
            parser.error(f"--{name} ({getattr(args, name)}) must be at least --tp ({args.tp}): "
                         "every rank needs a shard")

    results = tensorpar.spawn(run, args.tp, args.vocab, args.d, args.hidden, args.layers, args.batch, args.seq,
                              args.dtype)
    first = results[0]
    print(f"dense TinyLM: vocab {args.vocab}, width {args.d}, {args.layers} MLP blocks of hidden {args.hidden}, "
          f"{args.dtype}; parallelized at tp={args.tp} by the plan:")
    for pattern, style in PLAN.items():
        shown = style if isinstance(style, str) else "ColumnParallelLinear.from_linear(gather_output=True)"
        print(f"    {pattern!r:16} -> {shown}")

    print(f"\n{'rank':>4}  {'embed shard':>12}  {'fc1 shard':>11}  {'param bytes':>12}  {'dense / tp':>11}  ratio")
    ideal = first["dense_bytes"] / args.tp
    for r in results:
        print(f"{r['rank']:>4}  {r['embed']!s:>12}  {r['fc1']!s:>11}  {r['bytes']:>12,}  "
              f"{ideal:>11,.0f}  {r['bytes'] / ideal:.3f}")
    print(f"dense model: {first['dense_bytes']:,} bytes of parameters on every process")

    tolerance = TOLERANCES[DTYPES[args.dtype]]
    worst: dict[str, float] = {}
    for r in results:
        for name, err in r["errors"].items():
            worst[name] = max(worst.get(name, 0.0), err)
    print(f"\nrelative error vs the dense model, worst over ranks (tolerance {tolerance:.0e}):")
    for name, err in worst.items():
        print(f"    {name:24} {err:.2e}" + ("" if err <= tolerance else "   MISMATCH"))

    failures = [name for name, err in worst.items() if not err <= tolerance]  # NaN fails too
    if not all(r["weights_equal"] for r in results):
        failures.append("weights (full_state_dict differs from the dense state dict)")
    if failures:
        raise SystemExit(f"MISMATCH: the parallelized model differs from the dense one in: {', '.join(failures)}")
    print(f"OK: the parallelized model matches the dense one at tp={args.tp} "
          f"(weights bitwise, output and gradients within {tolerance:.0e})")


if __name__ == "__main__":
    main()
