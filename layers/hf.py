"""Hugging Face GPT-2 configs and state dicts in our GPT's terms (optional extra ``hf``).

This module maps configs and keys; :meth:`layers.gpt.GPT.from_hf` builds the
model from them. ``transformers`` is never imported here: the model is read
through its config and state dict. GPT-2 stores its projections as ``Conv1D`` with weights of
shape ``(in, out)`` (transposed against ``nn.Linear``), and Q, K and V fused in
one ``c_attn``; both are undone on the way in.
"""

from __future__ import annotations

from typing import Any

import torch

_TRANSPOSED = ("attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _check_supported(hf: Any) -> None:
    """Raise for GPT-2 variants whose computation differs from our Block."""
    if getattr(hf, "model_type", None) != "gpt2":
        raise TypeError(f"from_hf expects a GPT-2 model (GPT2LMHeadModel), got model_type "
                        f"{getattr(hf, 'model_type', None)!r}")
    differences = {
        "activation_function": (hf.activation_function, ("gelu_new", "gelu_pytorch_tanh")),
        "n_inner": (hf.n_inner, (None, 4 * hf.n_embd)),
        "layer_norm_epsilon": (hf.layer_norm_epsilon, (1e-5,)),
        "scale_attn_weights": (hf.scale_attn_weights, (True,)),
        "scale_attn_by_inverse_layer_idx": (hf.scale_attn_by_inverse_layer_idx, (False,)),
        "tie_word_embeddings": (getattr(hf, "tie_word_embeddings", True), (True,)),
        # one rate serves every dropout of the GPT, so GPT-2's three must agree
        "attn_pdrop, embd_pdrop": ((hf.attn_pdrop, hf.embd_pdrop), ((hf.resid_pdrop, hf.resid_pdrop),)),
    }
    unsupported = [f"{k}={v!r} (supported: {ok})" for k, (v, ok) in differences.items() if v not in ok]
    if unsupported:
        raise ValueError("from_hf: unsupported GPT-2 settings: " + "; ".join(unsupported))


def gpt_config(hf: Any) -> dict[str, Any]:
    """The ``GPTConfig`` fields of a Hugging Face ``GPT2Config``; raises for settings our GPT lacks."""
    _check_supported(hf)
    return dict(block_size=hf.n_positions, vocab_size=hf.vocab_size, n_layer=hf.n_layer, n_head=hf.n_head,
                n_embd=hf.n_embd, dropout=hf.resid_pdrop, bias=True)


def gpt_state_dict(state: dict[str, torch.Tensor], n_embd: int) -> dict[str, torch.Tensor]:
    """A GPT-2 state dict in our key layout: Q/K/V split, Conv1D weights transposed."""
    out = {}
    for key, value in state.items():
        if not key.startswith(("transformer.", "lm_head.")) or key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers of older transformers versions
        if ".attn.c_attn." in key:
            prefix, kind = key.split(".attn.c_attn.")
            parts = value.split(n_embd, dim=-1)  # (C, 3C) or (3C,): Q, K, V
            for name, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                out[f"{prefix}.attn.{name}.{kind}"] = part.t() if kind == "weight" else part
        else:
            out[key] = value.t() if key.endswith(_TRANSPOSED) else value
    out.setdefault("lm_head.weight", out["transformer.wte.weight"])
    return out
