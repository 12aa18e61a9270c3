"""A toy policy-gradient loop whose rollouts are sampled at one tp size and trained at another, and whose
two sides agree on every log-probability bit (tensorpar's bitwise mode).

    python examples/rl_parity.py                                  # sample at tp=2, train at tp=3 (3 ranks)
    python examples/rl_parity.py --sample-tp 1 --train-tp 4
    python examples/rl_parity.py --no-bitwise                     # the default numerics: they differ

Each step copies the trained weights to the sampler, samples a batch of continuations with
``GPT.generate(..., return_logprobs=True)`` (KV cache, tp = ``--sample-tp``), scores the same tokens with the
training forward ``-model(seq, targets, reduction="none")`` (tp = ``--train-tp``), prints the largest
``|Δ log-prob|`` and the range of the importance ratios ``exp(train - sample)`` (0.0 and exactly 1 in the
bitwise mode), and takes a REINFORCE step with the ratios as importance weights on a toy reward (the share of
even token ids). Both models live in one job of ``max(sample_tp, train_tp)`` ranks, on two process groups.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

import tensorpar
from layers import GPT, GPTConfig

CONFIG = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, vocab_size=61, block_size=32)


def copy_weights(trainer: GPT | None, sampler: GPT | None) -> None:
    """The trainer's full weights into the sampler (gathered on the trainer's ranks, sent from rank 0, which
    holds both, to every rank: a toy's transport)."""
    full = [trainer.full_state_dict() if trainer is not None else None]
    dist.broadcast_object_list(full, src=0)
    if sampler is not None:
        sampler.load_full_state_dict(full[0])


def run(sample_tp: int, train_tp: int, steps: int, batch: int, prompt: int, new: int, bitwise: bool, seed: int
        ) -> list[dict[str, float]]:
    """The loop on this rank; every step's largest |Δ log-prob|, importance-ratio range and mean reward."""
    world = dist.get_world_size()
    tensorpar.init(tp=world)
    if bitwise:
        tensorpar.bitwise.enable()
    rank = dist.get_rank()
    groups = {tp: dist.new_group(list(range(tp))) for tp in sorted({sample_tp, train_tp})}  # every rank joins each
    config = GPTConfig(**CONFIG)
    tensorpar.manual_seed(seed)
    trainer = GPT(config, group=groups[train_tp]) if rank < train_tp else None
    sampler = GPT(config, group=groups[sample_tp]).eval() if rank < sample_tp else None
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=3e-3) if trainer is not None else None
    prompts = torch.randint(0, config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(seed))
    stats = []
    for step in range(steps):
        copy_weights(trainer, sampler)
        seq = torch.zeros(batch, prompt + new, dtype=torch.long)
        old = torch.zeros(batch, new)
        if sampler is not None:
            torch.manual_seed(seed + step)
            seq, old = sampler.generate(prompts, new, temperature=1.0, return_logprobs=True)
        dist.broadcast(seq, src=0)
        dist.broadcast(old, src=0)
        row: dict[str, float] = {}
        if trainer is not None and optimizer is not None:
            logprobs = -trainer(seq[:, :-1], seq[:, 1:], reduction="none")[:, prompt - 1:]  # (B, new)
            ratio = torch.exp(logprobs - old)
            reward = (seq[:, prompt:] % 2 == 0).float().mean(1)  # (B,) the share of even tokens
            advantage = reward - reward.mean()
            loss = -(ratio * advantage[:, None]).mean()  # REINFORCE with importance weights (PPO without clipping)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            delta = (logprobs.detach() - old).abs().max().item()
            row = dict(delta=delta, ratio_min=ratio.min().item(), ratio_max=ratio.max().item(),
                       reward=reward.mean().item())
        stats.append(row)
    return stats


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sample-tp", type=int, default=2)
    parser.add_argument("--train-tp", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=4)
    parser.add_argument("--new", type=int, default=12)
    parser.add_argument("--no-bitwise", dest="bitwise", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    for name in ("sample_tp", "train_tp"):
        if not 1 <= getattr(a, name) <= 4:
            parser.error(f"--{name.replace('_', '-')} must be in 1-4 (the bitwise mode's tp sizes)")
    print(f"sampling at tp={a.sample_tp}, training at tp={a.train_tp}, bitwise mode {'on' if a.bitwise else 'off'}")
    stats = tensorpar.spawn(run, max(a.sample_tp, a.train_tp), a.sample_tp, a.train_tp, a.steps, a.batch, a.prompt,
                            a.new, a.bitwise, a.seed)[0]
    for step, row in enumerate(stats):
        print(f"step {step}: max |Δ log-prob| {row['delta']:.3g}, importance ratios [{row['ratio_min']!r}, "
              f"{row['ratio_max']!r}], mean reward {row['reward']:.3f}")
    print("OK")
    return stats


if __name__ == "__main__":
    main()
