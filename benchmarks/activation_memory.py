"""Activation memory per rank of the sharded GPT, with and without activation checkpointing.

    python benchmarks/activation_memory.py [--batch 1] [--tokens 256] [--n-layer 4] [--tp 1 2 4]

Every tensor autograd keeps for backward passes through a
``torch.autograd.graph.saved_tensors_hooks`` pack hook during one forward of
the GPT with its loss; the bytes of the distinct storages it sees, parameters
excluded, are the rank's saved activations (the largest rank's are reported).
With checkpointing, what a block saves inside is packed by the checkpoint's
own (inner) hooks and dropped; the checkpoint keeps the block's input, which
the outer hook does see. One block's bytes are the difference between GPTs of
2 and 1 layers. Without checkpointing a block keeps a few ``(B, T, C)``
tensors and its ``1/tp`` shares of the attention and MLP activations; with it,
exactly its input, ``B·T·C`` elements, at any tp.

With sequence parallelism (``--sequence-parallel`` figures, always measured)
everything a block keeps is split: the LayerNorms' inputs and outputs hold
this rank's tokens, and the column layers keep their input as this rank's
tokens too (gathered again in backward). :func:`block_formula` gives the bytes
per rank for our block; it is Korthikanti et al.'s accounting (2022, eq. 2-4)
adjusted to what this block stores: fp32 rather than fp16, no dropout masks
(p = 0 here; they add one byte per element per mask), and scaled-dot-product
attention, which keeps the ``(B, h, T)`` log-sum-exp instead of the ``(B, h,
T, T)`` scores, softmax and its dropout (their ``5as/h`` term). Per block:

* LayerNorm inputs and outputs: ``4·B·T·C``, and each LayerNorm's mean and
  1/std, ``4·B·T``: replicated in plain tp, split by tokens with sequence parallelism;
* Q, K, V and the attention output, ``4·B·T·C`` (``2 (1 + g⁻¹)`` with
  grouped KV heads), the log-sum-exp, ``B·h·T``, and the MLP's hidden
  activation before and after GELU, ``8·B·T·C``: split by heads and
  hidden features in both.

So ``(4 BTC + 4 BT) + (12 BTC + BhT) / tp`` elements in plain tp and all of it
``/ tp`` with sequence parallelism, plus ``4C`` (both LayerNorms' weights and
biases, joined into one tensor whose gradient is summed over the group),
times 4 bytes.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import tensorpar
from layers import GPT, GPTConfig

GPT2_WIDTH = dict(n_head=12, n_embd=768, vocab_size=50257, block_size=1024)


def saved_bytes(module: nn.Module, forward: Callable[[], Any]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``forward()`` runs, ``module``'s
    parameters excluded (the graph ``forward`` builds keeps every one alive meanwhile; it is dropped after)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}  # data pointer -> bytes

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = forward()
    del result
    return sum(storages.values())


def saved_activation_bytes(config: dict[str, Any], batch: int, tokens: int) -> int:
    """On every rank: bytes of the distinct non-parameter storages saved for backward by one
    forward of ``GPT(GPTConfig(**config))`` with its loss, on ``(batch, tokens)`` token ids."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**config))
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens + 1), generator=torch.Generator().manual_seed(0))
    return saved_bytes(model, lambda: model(ids[:, :-1], ids[:, 1:]))


def rank_figures(config: dict[str, Any], batch: int, tokens: int) -> dict[str, int]:
    """On every rank: saved bytes of the whole GPT and of one block, without and with checkpointing,
    and with sequence parallelism."""
    figures = {}
    for kind, options in (("plain", {}), ("checkpointed", dict(activation_checkpointing=True)),
                          ("sequence", dict(sequence_parallel=True))):
        one, two, whole = (saved_activation_bytes(dict(config, n_layer=n, **options), batch, tokens)
                           for n in (1, 2, config["n_layer"]))
        figures[f"gpt {kind}"], figures[f"block {kind}"] = whole, two - one
    return figures


def block_formula(batch: int, tokens: int, n_embd: int, n_head: int, tp: int, sequence_parallel: bool) -> float:
    """Bytes one block keeps for backward per rank, fp32, multi-head attention, GELU MLP (see above)."""
    btc, bt = batch * tokens * n_embd, batch * tokens
    replicated = 4 * btc + 4 * bt  # LayerNorm inputs and outputs, means and 1/stds
    split = 12 * btc + batch * n_head * tokens  # Q, K, V, attention output, log-sum-exp, MLP hidden x 2
    summed = 2 * 2 * n_embd if tp > 1 else 0  # both LayerNorms' weight and bias, joined to be summed over tp
    return 4 * ((replicated + split) / tp + summed if sequence_parallel else replicated + split / tp)


def _spawned(config: dict[str, Any], batch: int, tokens: int) -> dict[str, int]:
    tensorpar.init()
    torch.set_num_threads(1)
    return rank_figures(config, batch, tokens)


def measure(tp_sizes: list[int], config: dict[str, Any], batch: int, tokens: int) -> dict[int, dict[str, int]]:
    """``{tp: figures}``, each figure the largest over the tp ranks (shards may be uneven)."""
    results = {}
    for tp in tp_sizes:
        per_rank = tensorpar.spawn(_spawned, tp, config, batch, tokens)
        results[tp] = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
    return results


def table(results: dict[int, dict[str, int]], config: dict[str, Any], batch: int, tokens: int) -> str:
    """A markdown table of ``measure``'s figures, in MiB, with the checkpointed / plain ratios."""
    mib = 2**20
    head = (f"| tp | GPT ({config['n_layer']} layers) plain MiB | checkpointed MiB | ratio "
            f"| one block plain MiB | checkpointed MiB | ratio | block input B·T·C·4 MiB |")
    rows = [head, "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    element = torch.empty((), dtype=torch.get_default_dtype()).element_size()
    block_input = batch * tokens * config["n_embd"] * element
    for tp, f in results.items():
        rows.append(f"| {tp} | {f['gpt plain'] / mib:.2f} | {f['gpt checkpointed'] / mib:.2f} "
                    f"| {f['gpt checkpointed'] / f['gpt plain']:.3f} | {f['block plain'] / mib:.2f} "
                    f"| {f['block checkpointed'] / mib:.2f} | {f['block checkpointed'] / f['block plain']:.3f} "
                    f"| {block_input / mib:.2f} |")
    return "\n".join(rows)


def sequence_table(results: dict[int, dict[str, int]], config: dict[str, Any], batch: int, tokens: int) -> str:
    """One block's saved bytes per rank, plain tp and sequence-parallel, against :func:`block_formula`."""
    mib, base = 2**20, results[1]["block plain"]
    rows = ["| tp | plain tp MiB | formula MiB | sequence parallel MiB | formula MiB "
            "| sequence parallel / (tp=1 / tp) (target ≤ 1.05) |", "|---:|---:|---:|---:|---:|---:|"]
    for tp, f in results.items():
        plain, seq = (block_formula(batch, tokens, config["n_embd"], config["n_head"], tp, sp) for sp in (False, True))
        rows.append(f"| {tp} | {f['block plain'] / mib:.3f} | {plain / mib:.3f} | {f['block sequence'] / mib:.3f} "
                    f"| {seq / mib:.3f} | {f['block sequence'] / (base / tp):.3f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=GPT2_WIDTH["n_embd"])
    parser.add_argument("--n-head", type=int, default=GPT2_WIDTH["n_head"])
    parser.add_argument("--vocab-size", type=int, default=GPT2_WIDTH["vocab_size"])
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    config = dict(GPT2_WIDTH, n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                  vocab_size=args.vocab_size, block_size=max(args.tokens, 1), dropout=args.dropout)
    results = measure(args.tp, config, args.batch, args.tokens)
    print(f"Saved activations per rank (largest rank), fp32, B={args.batch}, T={args.tokens}, "
          f"n_embd={args.n_embd}, {args.n_head} heads, vocab {args.vocab_size}, dropout {args.dropout}:\n")
    print(table(results, config, args.batch, args.tokens))
    print(f"\nOne block with sequence parallelism (B={args.batch}, T={args.tokens}):\n")
    print(sequence_table(results, config, args.batch, args.tokens))


if __name__ == "__main__":
    main()
