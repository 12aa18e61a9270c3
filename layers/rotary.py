"""Rotary position embeddings (RoPE, Su et al.) of query and key heads, Llama's convention.

Each head's features are two halves ``[x1 | x2]`` rotated pairwise, feature ``i`` with ``i + d/2``
(Hugging Face Llama's "rotate half", not the interleaved pairs of the paper's code), by the angle
``position * theta ** (-2i / d)``. A head's rotation depends on its token's position only, so each
rank rotates the heads it holds, with nothing to communicate.

The cosines and sines are one table for positions ``0..block_size-1``, computed whole (float32, or
float64 for a float64 model) and read by position: a token's rotation is the same bits whether it comes
in a prompt of many tokens or alone while decoding (a kernel's scalar tail computes ``cos`` with other
bits than its vector body), which the bitwise mode's position invariance needs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_table(block_size: int, head_dim: int, theta: float, device: torch.device | str | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[cos | sin]`` of every position's angles: ``(block_size, 2 * head_dim)``, in ``dtype``."""
    exact = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=exact) / head_dim)  # (d/2,)
    angles = torch.arange(block_size, device=device, dtype=exact)[:, None] * inv_freq  # (block_size, d/2)
    angles = torch.cat([angles, angles], -1)  # (block_size, d): the halves rotate alike
    return torch.cat([angles.cos(), angles.sin()], -1).to(dtype)


class RotaryEmbedding(nn.Module):
    """The angles of tokens' positions, which :func:`rotate` turns query and key heads ``(B, h, T, d)`` by:
    ``positions=None`` means ``0..T-1``; a ``(B, T)`` tensor gives each row's own (a KV cache's).

    The table is a non-persistent buffer (not in the state dict), computed again whenever the module
    moves or is materialised (``to``, ``to_empty``).

    Example::

        rope = RotaryEmbedding(64, block_size=1024)
        angles = rope(q.shape[2])                      # (T, 128): [cos | sin] at positions 0..T-1
        q, k = rotate(q, angles), rotate(k, angles)    # (B, h, T, 64) each
    """

    def __init__(self, head_dim: int, block_size: int, theta: float = 10000.0, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding rotates pairs of features: head_dim ({head_dim}) must be even")
        self.head_dim, self.block_size, self.theta = head_dim, block_size, theta
        dtype = dtype or torch.get_default_dtype()
        self.register_buffer("table", rope_table(block_size, head_dim, theta, device, dtype), persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        super()._apply(fn, recurse)
        if self.table.device.type != "meta":  # materialised or moved: the values, in the buffer's place
            with torch.no_grad():
                self.table.copy_(rope_table(self.block_size, self.head_dim, self.theta, self.table.device,
                                            self.table.dtype))
        return self

    def forward(self, t: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The ``[cos | sin]`` rows of ``t`` tokens at ``positions`` (``None``: ``0..t-1``; else ``(B, t)``):
        ``(t, 2d)`` or ``(B, 1, t, 2d)``, for :func:`rotate`."""
        if t > self.block_size:
            raise ValueError(f"rotary positions cover block_size ({self.block_size}) tokens, got {t}")
        return self.table[:t] if positions is None else self.table[positions][:, None]

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, block_size={self.block_size}, theta={self.theta}"


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Heads ``x`` ``(B, h, T, d)`` turned by the angles of ``table`` (:meth:`RotaryEmbedding.forward`)."""
    cos, sin = table.to(x.dtype).chunk(2, -1)  # (T, d) or (B, 1, T, d) each
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin  # (B, h, T, d)
