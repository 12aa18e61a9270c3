"""Learning-rate schedules for training loops."""

from __future__ import annotations

import math


def cosine_lr(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``min_lr`` at step ``total`` (nanoGPT's)."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step >= total:
        return min_lr
    ratio = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
