"""Hugging Face Llama (``LlamaForCausalLM``) in our GPT's terms, both ways: configs and keys only.

A GPT with ``norm="rmsnorm", positions="rope", mlp="swiglu"`` computes what Llama computes:
RMSNorm before attention and MLP and at the end, rotary embeddings on each query and key head
(rotate-half), grouped-query attention (query head ``i`` reads KV head ``i // g`` in both), the
SwiGLU MLP ``down(silu(gate(x)) * up(x))`` of width ``8 * n_embd // 3``, the LM head tied to the token
embedding (``tie_word_embeddings``). Biases (``bias=True``) are Llama's ``attention_bias`` and
``mlp_bias``. Our fused ``c_attn`` (rows ``[Q | K | V]``) is Llama's ``q_proj``, ``k_proj`` and
``v_proj``; ``c_gate``, ``c_fc`` and ``mlp.c_proj`` are ``gate_proj``, ``up_proj`` and ``down_proj``.
Llama has attention dropout only: a GPT's ``dropout`` is exported as it (the same model in eval mode).
:func:`layers.hf.export_llama` writes the files; :meth:`layers.GPT.from_hf` reads a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any

import torch

#: GPTConfig fields that change how the model is run, not what it computes
_RUNTIME_ONLY = ("activation_checkpointing", "sequence_parallel")
#: what Llama needs of a GPT's options
_REQUIRED = (("norm", "rmsnorm"), ("positions", "rope"), ("mlp", "swiglu"))
#: our per-block keys and Llama's
_BLOCK_KEYS = (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm"), ("attn.c_proj", "self_attn.o_proj"),
               ("mlp.c_gate", "mlp.gate_proj"), ("mlp.c_fc", "mlp.up_proj"), ("mlp.c_proj", "mlp.down_proj"))


def check_exportable(config: Any) -> None:
    """Raise ``ValueError`` naming each ``GPTConfig`` field that Llama cannot express."""
    known = {"block_size", "vocab_size", "n_layer", "n_head", "n_embd", "dropout", "bias", "n_kv_head",
             "rope_theta", "norm_eps", *dict(_REQUIRED), *_RUNTIME_ONLY}
    wrong = [f"{name}={getattr(config, name)!r} (Llama needs {ok!r})"
             for name, ok in _REQUIRED if getattr(config, name) != ok]
    wrong += [f"{f.name}={getattr(config, f.name)!r} (Llama has no such setting; keep {f.default!r})"
              for f in fields(config) if f.name not in known and f.default is not MISSING
              and getattr(config, f.name) != f.default]
    if wrong:
        raise ValueError("export_llama: GPTConfig fields Llama cannot express: " + "; ".join(wrong))


def llama_config(config: Any, dtype: torch.dtype, *, eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` computing what a GPT of ``config`` computes."""
    check_exportable(config)
    name = str(dtype).removeprefix("torch.")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
            "hidden_size": config.n_embd, "intermediate_size": config.mlp_hidden,
            "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
            "num_key_value_heads": config.kv_heads, "head_dim": config.n_embd // config.n_head,
            "hidden_act": "silu", "max_position_embeddings": config.block_size, "rms_norm_eps": config.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
            "rope_theta": config.rope_theta,  # where transformers 4.x reads it
            "attention_bias": config.bias, "mlp_bias": config.bias, "attention_dropout": config.dropout,
            "tie_word_embeddings": True, "initializer_range": 0.02, "pretraining_tp": 1,
            "bos_token_id": eos_token_id, "eos_token_id": eos_token_id, "dtype": name, "torch_dtype": name}


def llama_state_dict(state: Mapping[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """Our full state dict in Llama's keys; the tied ``lm_head.weight`` left out, as Llama saves it."""
    c, kv = config.n_embd, config.kv_heads * (config.n_embd // config.n_head)
    out = {"model.embed_tokens.weight": state["transformer.wte.weight"],
           "model.norm.weight": state["transformer.ln_f.weight"]}
    for i in range(config.n_layer):
        ours, theirs = f"transformer.h.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            if f"{ours}attn.c_attn.{kind}" in state:  # [Q | K | V] rows
                for part, value in zip("qkv", state[f"{ours}attn.c_attn.{kind}"].split([c, kv, kv]), strict=True):
                    out[f"{theirs}self_attn.{part}_proj.{kind}"] = value
            for key, name in _BLOCK_KEYS:
                if f"{ours}{key}.{kind}" in state:
                    out[f"{theirs}{name}.{kind}"] = state[f"{ours}{key}.{kind}"]
    return {k: v.contiguous() for k, v in out.items()}


def gpt_config(hf: Any) -> dict[str, Any]:
    """The ``GPTConfig`` fields of a Hugging Face ``LlamaConfig``; raises for settings our GPT lacks."""
    c, heads = hf.hidden_size, hf.num_attention_heads
    rope = getattr(hf, "rope_parameters", None) or {"rope_type": "default", "rope_theta": hf.rope_theta}
    differences = {
        "hidden_act": (hf.hidden_act, ("silu",)),
        "intermediate_size": (hf.intermediate_size, (8 * c // 3,)),
        "head_dim": (getattr(hf, "head_dim", None) or c // heads, (c // heads,)),
        "rope_parameters": (rope.get("rope_type", "default"), ("default",)),
        "mlp_bias": (hf.mlp_bias, (hf.attention_bias,)),
        "tie_word_embeddings": (hf.tie_word_embeddings, (True,)),
    }
    unsupported = [f"{k}={v!r} (supported: {ok})" for k, (v, ok) in differences.items() if v not in ok]
    if unsupported:
        raise ValueError("from_hf: unsupported Llama settings: " + "; ".join(unsupported))
    return dict(block_size=hf.max_position_embeddings, vocab_size=hf.vocab_size, n_layer=hf.num_hidden_layers,
                n_head=heads, n_kv_head=hf.num_key_value_heads, n_embd=c, dropout=float(hf.attention_dropout),
                bias=bool(hf.attention_bias), mlp="swiglu", norm="rmsnorm", positions="rope",
                rope_theta=float(rope["rope_theta"]), norm_eps=float(hf.rms_norm_eps))


def gpt_state_dict(state: Mapping[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """A Llama state dict in our keys: Q, K and V fused into ``c_attn``, the LM head the embedding."""
    out = {"transformer.wte.weight": state["model.embed_tokens.weight"],
           "lm_head.weight": state["model.embed_tokens.weight"],
           "transformer.ln_f.weight": state["model.norm.weight"]}
    for i in range(n_layer):
        ours, theirs = f"transformer.h.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            if f"{theirs}self_attn.q_proj.{kind}" in state:
                out[f"{ours}attn.c_attn.{kind}"] = torch.cat([state[f"{theirs}self_attn.{p}_proj.{kind}"]
                                                              for p in "qkv"])
            for key, name in _BLOCK_KEYS:
                if f"{theirs}{name}.{kind}" in state:
                    out[f"{ours}{key}.{kind}"] = state[f"{theirs}{name}.{kind}"]
    return out
