"""The activation side of a plan: the bytes saved for backward, the largest transient, the peak.

(Skeleton: placeholders.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import GPTConfig

if TYPE_CHECKING:
    from .plan_layout import Layout


def activation_bytes(config: GPTConfig, layout: Layout, *, tp_rank: int = 0, stage: int = 0) -> int:
    """Bytes saved for backward on one rank at the step's fullest moment (placeholder)."""
    return 0


def transient_bytes(config: GPTConfig, layout: Layout, *, tp_rank: int = 0, stage: int = 0) -> int:
    """The largest short-lived buffer of the step on one rank (placeholder)."""
    return 0


def peak_bytes(config: GPTConfig, layout: Layout, *, params: int, grads: int, optimizer: int,
               tp_rank: int = 0, stage: int = 0) -> int:
    """The most bytes one rank holds at once during a step (placeholder)."""
    return params + grads + optimizer
