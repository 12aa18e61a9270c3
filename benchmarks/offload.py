"""Optimizer state in host memory (tensorpar.OffloadedOptimizer): its bytes, the bytes a step moves,
and the step time with and without it.

    python benchmarks/offload.py [--n-layer 12 --n-embd 768 --n-head 12 --block-size 1024 --batch 8]
                                 [--param-dtype float32|bfloat16]

The GPT at pp=1, tp=1 in one process, AdamW (betas 0.9/0.95, weight decay 0.1 on
matrices). On a GPU: bf16 autocast over float32 parameters (as examples/train_gpt.py
trains), or parameters in bfloat16 with ``--param-dtype bfloat16`` (torch's AdamW then
updates them directly; the offloaded one keeps float32 masters). On CPU the defaults
shrink to sizes that run in seconds and the "device" is the CPU itself: the times then
show the copies' cost, not a transfer's.

Printed: the host memory the offloaded optimizer holds (masters and state, and with its
transfer buffers), the device memory AdamW's state would take instead, the bytes a step
moves (gradients down, parameters up), and each one's median step time (forward, backward,
optimizer; the two timed in turn, after two warm-up steps each).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable

import torch

import tensorpar
from gpu import timer
from layers import GPT, GPTConfig

#: (option, default on a GPU, default on CPU): GPT-2 small on a GPU, seconds on CPU
SIZES = (("n-layer", 12, 2), ("n-embd", 768, 128), ("n-head", 12, 4), ("vocab-size", 50304, 256),
         ("block-size", 1024, 64), ("batch", 8, 4), ("iters", 10, 5))


def build(config: GPTConfig, idx: torch.Tensor, dtype: torch.dtype,
          offload: bool) -> tuple[Callable[[], None], torch.optim.Optimizer]:
    """One training step (forward, backward, optimizer) of a fresh GPT, and its optimizer."""
    tensorpar.manual_seed(0)
    model = GPT(config, device=idx.device, dtype=dtype)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = (tensorpar.OffloadedOptimizer(groups, torch.optim.AdamW, lr=3e-4, betas=(0.9, 0.95)) if offload
                 else torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95)))
    cuda = idx.device.type == "cuda"
    autocast = torch.autocast("cuda", torch.bfloat16) if cuda and dtype == torch.float32 else contextlib.nullcontext()

    def step() -> None:
        with autocast:
            loss = model(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, optimizer


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for option, on_gpu, on_cpu in SIZES:
        parser.add_argument(f"--{option}", type=int, default=on_gpu if cuda else on_cpu)
    parser.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.param_dtype)
    tensorpar.init(tp=1)
    config = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    idx = torch.randint(0, args.vocab_size, (args.batch, args.block_size), device=device)
    print(f"GPT {args.n_layer}x{args.n_embd}, {args.n_head} heads, vocab {args.vocab_size}, batch "
          f"{args.batch}x{args.block_size}, parameters in {args.param_dtype} on {device}"
          + (" (bf16 autocast)" if cuda and dtype == torch.float32 else ""))
    (plain, adamw), (ours, offloaded) = (build(config, idx, dtype, offload) for offload in (False, True))
    assert isinstance(offloaded, tensorpar.OffloadedOptimizer)
    run = timer(device)
    times: dict[str, list[float]] = {"plain": [], "ours": []}
    for _ in range(2):  # warm-up: the optimizers' state and buffers are made here
        run(plain), run(ours)
    for _ in range(args.iters):  # interleaved
        times["plain"].append(run(plain))
        times["ours"].append(run(ours))
    med = {k: statistics.median(v) for k, v in times.items()}
    n = sum(p.numel() for group in adamw.param_groups for p in group["params"])
    host, moved = offloaded.host_bytes(), offloaded.bytes_moved_per_step()
    held = sum(v.numel() * v.element_size() for s in adamw.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))
    print(f"parameters: {n:,} ({n * dtype.itemsize:,} bytes on the device)")
    print(f"host-resident optimizer bytes (masters + state): {host:,} ({host / n:.2f} per parameter); "
          f"with transfer buffers: {offloaded.host_bytes(buffers=True):,}")
    print(f"optimizer state that torch's AdamW keeps on the device instead: {held:,} bytes")
    print(f"bytes moved per step: {moved:,} ({moved // 2:,} gradients D2H + {moved // 2:,} parameters H2D)")
    print(f"step time (median of {args.iters}): AdamW on the device {med['plain'] * 1e3:.1f} ms, offloaded "
          f"{med['ours'] * 1e3:.1f} ms (ratio {med['ours'] / med['plain']:.2f})")

if __name__ == "__main__":
    main()
