"""The transformer MLP, column -> activation -> row.

The hidden features are split across ranks: ``c_fc`` (and SwiGLU's gate,
``c_gate``) are column-parallel, the activation is elementwise, so it runs on
each rank's slice, and ``c_proj`` is row-parallel over the same slice. One
``f`` (``copy_in``) enters, shared by the up and gate projections (one
backward all-reduce), and one ``g`` leaves: one all-reduce of ``(*, C)`` each way.
With ``sequence_parallel=True`` the input and output are this rank's tokens
``(..., T_r, C)``: ``copy_in`` all-gathers them (``f̄``) and ``c_proj``
reduce-scatters (``ḡ``), as in :mod:`layers.attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

import tensorpar
from tensorpar.checks import check_int

from . import numerics
from .linear import ColumnParallelLinear, RowParallelLinear, check_activation
from .regions import RegionInput
from .sequence import ShardedDropout

ACTIVATIONS = ("gelu", "swiglu")


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (GPT-2's)."""
    return F.gelu(x, approximate="tanh")


class ParallelMLP(nn.Module):
    """``c_proj(act(c_fc(x)))``, sharded over the hidden features. ``(*, C) -> (*, C)``, replicated.

    ``activation="gelu"``: GELU with the tanh approximation (GPT-2).
    ``activation="swiglu"``: ``c_proj(silu(c_gate(x)) * c_fc(x))`` (LLaMA).
    ``dropout`` applies to the output, with the same mask on every rank.

    Example::

        tensorpar.init(tp=2)
        mlp = ParallelMLP(768, 3072)   # c_fc (1536, 768) and c_proj (768, 1536) on each rank
        y = mlp(x)                     # (B, T, 768)
    """

    def __init__(self, n_embd: int, hidden: int, *, activation: str = "gelu", bias: bool = True,
                 dropout: float = 0.0, sequence_parallel: bool = False, group: ProcessGroup | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        for name, value in (("n_embd", n_embd), ("hidden", hidden)):
            check_int(value, f"{type(self).__name__}: {name}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation, self.sequence_parallel = activation, sequence_parallel
        factory = dict(group=group, device=device, dtype=dtype)
        self.copy_in = RegionInput(sequence_parallel=sequence_parallel, group=group)
        self.c_fc = ColumnParallelLinear(n_embd, hidden, bias, copy_input=False, **factory)
        gated = activation == "swiglu"
        self.c_gate = ColumnParallelLinear(n_embd, hidden, bias, copy_input=False, **factory) if gated else None
        self.c_proj = RowParallelLinear(hidden, n_embd, bias, sequence_parallel=sequence_parallel, **factory)
        self.dropout = ShardedDropout(dropout, group=group) if sequence_parallel else nn.Dropout(dropout)
        # (h, fn) -> fn(h) on the hidden features, in bitwise mode by segments (chosen once)
        self.activate = numerics.elementwise(hidden, tensorpar.tp_group(group))

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """``(*, C)``, or with sequence parallelism this rank's tokens ``(..., T_r, C)`` of ``seq_len``
        (found with one small collective when not given)."""
        check_activation(x, type(self).__name__)
        # f, or f̄ (..., T, C) whose (..., T_r, C) they keep: shared by the up and gate projections
        with self.copy_in.entered(x, seq_len) as x:
            if self.c_gate is None:
                h = self.activate(self.c_fc(x), gelu_tanh)  # (*, H / tp)
            else:
                h = self.activate(self.c_gate(x), F.silu) * self.c_fc(x)
        y = self.c_proj(h)  # (*, C) summed over ranks, or (..., T_r, C)
        return self.dropout(y, x.shape[-2]) if self.sequence_parallel else self.dropout(y)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}" + (", sequence_parallel=True" if self.sequence_parallel else "")
