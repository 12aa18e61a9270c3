"""The GPT's configuration: nanoGPT's ``GPTConfig``, with the options tensorpar adds."""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorpar.checks import check_int

from .mlp import ACTIVATIONS

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")


@dataclass
class GPTConfig:
    """nanoGPT's configuration, plus grouped-query attention, the MLP, norm and position kinds and
    activation checkpointing.

    ``n_kv_head=None`` means ``n_head`` (multi-head attention); ``mlp`` is
    ``"gelu"`` (hidden ``4 * n_embd``) or ``"swiglu"`` (hidden ``8 * n_embd // 3``).
    ``norm`` is ``"layernorm"`` (GPT-2) or ``"rmsnorm"`` (Llama: a scale, no bias), both with ``norm_eps``;
    ``positions`` is ``"learned"`` (a ``wpe`` table, GPT-2) or ``"rope"`` (rotary embeddings of base
    ``rope_theta`` on every query and key head, Llama's rotate-half convention; no ``wpe``). Llama is
    ``norm="rmsnorm", positions="rope", mlp="swiglu", bias=False`` (any ``n_kv_head``).
    ``activation_checkpointing=True`` keeps only each block's input for backward
    and runs the block's forward again there (``torch.utils.checkpoint``,
    non-reentrant), with the same dropout masks: less memory, one more forward.
    ``sequence_parallel=True`` splits the tokens across the tp group outside the
    matmuls (LayerNorm, dropout, residual stream; :mod:`tensorpar.comm.sequence`):
    the same traffic, about ``1/tp`` of the activations per rank. Any sequence
    length: 17 tokens at tp=4 are split 5/4/4/4. Neither changes the weights, so
    checkpoints move freely between them.
    """

    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    n_kv_head: int | None = None
    mlp: str = "gelu"
    norm: str = "layernorm"
    positions: str = "learned"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    activation_checkpointing: bool = field(default=False, metadata={"state": False})  # how it runs: not checkpointed
    sequence_parallel: bool = field(default=False, metadata={"state": False})

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            check_int(getattr(self, name), f"GPTConfig.{name}")
        check_int(self.n_kv_head, "GPTConfig.n_kv_head", optional=True)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) is not divisible by n_head ({self.n_head})")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head ({self.n_head}) is not divisible by n_kv_head ({self.kv_heads})")
        if self.mlp not in ACTIVATIONS:
            raise ValueError(f"mlp must be one of {ACTIVATIONS}, got {self.mlp!r}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {self.positions!r}")
        if self.positions == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"positions='rope' rotates pairs of features: head_dim (n_embd // n_head = "
                             f"{self.n_embd // self.n_head}) must be even")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"GPTConfig.{name} must be a number > 0, got {value!r}")
        for name in ("activation_checkpointing", "sequence_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"GPTConfig.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def mlp_hidden(self) -> int:
        return 4 * self.n_embd if self.mlp == "gelu" else 8 * self.n_embd // 3

    def parameter_count(self, *, non_embedding: bool = True) -> int:
        """The unsharded GPT's parameters, the tied LM head counted once; without the position table
        when ``non_embedding`` (nanoGPT's ``get_num_params``: the count that does matmuls, for MFU)."""
        c, hidden, kv_width = self.n_embd, self.mlp_hidden, self.kv_heads * (self.n_embd // self.n_head)
        b = int(self.bias)
        norm = c + (b * c if self.norm == "layernorm" else 0)  # RMSNorm: a scale only
        attention = (c * c + b * c) + 2 * (c * kv_width + b * kv_width) + (c * c + b * c)  # Q, K and V, out
        mlp = (2 if self.mlp == "swiglu" else 1) * (c * hidden + b * hidden) + (hidden * c + b * c)
        positions = 0 if non_embedding or self.positions == "rope" else self.block_size * c
        return self.vocab_size * c + positions + self.n_layer * (2 * norm + attention + mlp) + norm
