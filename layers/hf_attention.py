"""Attention-probability dropout for a Hugging Face attention module holding some of the heads.

Each head must get its own mask, the same whatever tp the model runs at, while the ranks' default
generators (which the replicated dropouts of the residual stream use) stay in step. So a training
forward with dropout ``p`` draws one mask for *all* the model's heads from the default generator,
``torch.rand(B, n_head, T, S) >= p`` (every rank draws it alike), and each rank keeps its own heads'
slice: the masks a dense model drawing one such mask would use, at every tp. The draw is tp times this
rank's share of it, the trade for masks that do not depend on tp (:mod:`layers.attention` does the same
inside a compiled graph and in the bitwise mode). With dropout off it calls the model's own attention.

The module finds this function through Hugging Face's attention registry under :data:`NAME`: its
``config`` becomes a :class:`HeadsConfig`, which answers :data:`NAME` for ``_attn_implementation``
and everything else from the model's config, so the model's masks and the eval path are unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

#: The key of :func:`attention` in ``transformers``' ``ALL_ATTENTION_FUNCTIONS``.
NAME = "tensorpar_heads"


class HeadsConfig:
    """A model config as one attention module sees it: ``_attn_implementation`` is :data:`NAME`,
    everything else (read or written) is the model's config's."""

    def __init__(self, config: Any) -> None:
        object.__setattr__(self, "model_config", config)

    def __getattr__(self, name: str) -> Any:
        if name == "model_config":  # not yet set (a copy being made)
            raise AttributeError(name)
        if name == "_attn_implementation":
            return NAME
        return getattr(self.model_config, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.model_config, name, value)


def install(attn: Any, heads: range, n_head: int) -> None:
    """Make ``attn`` (a Hugging Face attention module holding query heads ``heads`` of ``n_head``) drop
    its heads' slice of one mask for all."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if NAME not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(NAME, attention)
    attn.tp_heads, attn.tp_n_head = heads, n_head
    attn.tp_eager = sys.modules[type(attn).__module__].eager_attention_forward  # the model's own
    attn.config = HeadsConfig(attn.config)


def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
              **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Hugging Face's attention interface: ``(B, h, T, d)`` queries, ``(B, h_kv, S, d)`` keys and values,
    the mask the model made for its own implementation -> ``(B, T, h, d)`` and the probabilities."""
    if not (dropout and module.training):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        implementation = module.config.model_config._attn_implementation
        own: Callable[..., Any] = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, module.tp_eager)
        return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    b, h, t, d = query.shape
    s = key.shape[2]
    key, value = (x.repeat_interleave(h // x.shape[1], 1) for x in (key, value))  # (B, h, S, d), as repeat_kv
    scores = query @ key.transpose(-2, -1) * (d**-0.5 if scaling is None else scaling)  # (B, h, T, S)
    if attention_mask is None:  # causal, the last query at the last key
        causal = torch.ones(t, s, dtype=torch.bool, device=query.device).tril(s - t)
        scores = scores.masked_fill(~causal, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[..., :s], float("-inf"))
    else:
        scores = scores + attention_mask[..., :s]
    probs = scores.softmax(-1).to(value.dtype)
    lo = module.tp_heads.start
    keep = torch.rand(b, module.tp_n_head, t, s, device=query.device)[:, lo:lo + h] >= dropout  # (B, h, T, S)
    dropped = probs * keep / (1 - dropout)
    return (dropped @ value).transpose(1, 2).contiguous(), dropped
