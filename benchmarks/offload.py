"""Optimizer state in host memory (FSDP2's CPUOffloadPolicy, as ``train_gpt.py --offload-optimizer``
uses it): the bytes it keeps on the host, and the step time with and without it.

    python benchmarks/offload.py [--n-layer 12 --n-embd 768 --n-head 12 --block-size 1024 --batch 8]

The GPT at pp=1, tp=1, dp=1 in one process, AdamW (betas 0.9/0.95, weight decay 0.1 on
matrices), on a GPU under bf16 autocast over float32 parameters (as examples/train_gpt.py
trains). Offloaded: the GPT under ``tensorpar.fully_shard_dp(..., offload_policy=
CPUOffloadPolicy())``, each block its own unit, so FSDP2 keeps the parameters, their
gradients and AdamW's state on the host (pinned on a GPU), copies each unit's parameters to
the device for its forward and backward, moves its gradients back, and AdamW steps on the
host. On CPU the defaults shrink to sizes that run in seconds and the "device" is the CPU
itself: the times then show FSDP2's own work and copies, not a transfer's.

Printed: where each run keeps its parameters, gradients (as after a backward) and AdamW state,
in bytes, the bytes a step moves at most (each parameter up twice, for forward and backward,
each gradient down), and each one's median step time (forward,
backward, optimizer; the two timed in turn, after two warm-up steps each).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor

import tensorpar
from gpu import timer
from layers import GPT, GPTConfig

#: (option, default on a GPU, default on CPU): GPT-2 small on a GPU, seconds on CPU
SIZES = (("n-layer", 12, 2), ("n-embd", 768, 128), ("n-head", 12, 4), ("vocab-size", 50304, 256),
         ("block-size", 1024, 64), ("batch", 8, 4), ("iters", 10, 5))


def build(config: GPTConfig, idx: torch.Tensor,
          offload: bool) -> tuple[Callable[[], None], nn.Module, torch.optim.Optimizer]:
    """One training step (forward, backward, optimizer) of a fresh GPT, the GPT and its optimizer."""
    tensorpar.manual_seed(0)
    model = GPT(config, device=idx.device)
    cuda = idx.device.type == "cuda"
    if offload:
        tensorpar.fully_shard_dp(model, modules=model.transformer.h, offload_policy=CPUOffloadPolicy(pin_memory=cuda))
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95))
    autocast = torch.autocast("cuda", torch.bfloat16) if cuda else contextlib.nullcontext()

    def step() -> None:
        with autocast:
            loss = model(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, model, optimizer


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state, by the device type holding them."""
    tensors = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    held: dict[str, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        held[local.device.type] = held.get(local.device.type, 0) + local.numel() * local.element_size()
    return held


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for option, on_gpu, on_cpu in SIZES:
        parser.add_argument(f"--{option}", type=int, default=on_gpu if cuda else on_cpu)
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    tensorpar.init(tp=1)
    config = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    idx = torch.randint(0, args.vocab_size, (args.batch, args.block_size), device=device)
    print(f"GPT {args.n_layer}x{args.n_embd}, {args.n_head} heads, vocab {args.vocab_size}, batch "
          f"{args.batch}x{args.block_size}, float32 parameters on {device}" + (" (bf16 autocast)" if cuda else ""))
    (plain, plain_model, adamw), (ours, model, offloaded) = (build(config, idx, offload) for offload in (False, True))
    run = timer(device)
    times: dict[str, list[float]] = {"plain": [], "ours": []}
    for _ in range(2):  # warm-up: the optimizers' state is made here
        run(plain), run(ours)
    for _ in range(args.iters):  # interleaved
        times["plain"].append(run(plain))
        times["ours"].append(run(ours))
    med = {k: statistics.median(v) for k, v in times.items()}
    n = sum(p.numel() for p in plain_model.parameters())
    for name, m, opt in (("plain", plain_model, adamw), ("offloaded", model, offloaded)):
        for p in m.parameters():  # gradients as after a backward, before zero_grad
            p.grad = torch.zeros_like(p)
        held = held_bytes(m, opt)
        print(f"{name}: parameters, gradients and AdamW state, by where they are: "
              + ", ".join(f"{where} {b:,} bytes ({b / n:.2f} per parameter)" for where, b in sorted(held.items())))
    moved = 3 * 4 * n  # float32 parameters up for forward and again for backward, float32 gradients down
    print(f"bytes moved per step on a GPU, at most: {moved:,} (each parameter H2D twice, each gradient D2H; "
          "the root's parameters stay gathered from forward to backward)")
    print(f"step time (median of {args.iters}): AdamW on the device {med['plain'] * 1e3:.1f} ms, offloaded "
          f"{med['ours'] * 1e3:.1f} ms (ratio {med['ours'] / med['plain']:.2f})")


if __name__ == "__main__":
    main()
