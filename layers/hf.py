"""Hugging Face GPT-2 in our GPT's terms, both ways (reading needs the optional extra ``hf``), and the
export to Hugging Face directories: GPT-2's, or Llama's (:mod:`layers.hf_llama` maps Llama's keys).

Reading: this module maps configs and keys; :meth:`layers.gpt.GPT.from_hf` builds
the model from them. Writing: :func:`export_gpt2` saves a GPT as a GPT-2 directory
(``config.json`` and ``model.safetensors``) that ``GPT2LMHeadModel.from_pretrained``
loads; :func:`export_llama` a GPT with Llama's options as a ``LlamaForCausalLM`` directory;
:func:`export_hf` picks the one the GPT's options make it. ``transformers`` is never imported
here: a model is read through its config and state dict, and written as plain files.
``model.safetensors`` is written by the ``safetensors`` package (the extra ``hf``) and renamed
into place when whole. GPT-2 stores its projections as ``Conv1D`` with weights of shape
``(in, out)`` (transposed against ``nn.Linear``): the weights are transposed on the way in and
out, and nothing else changes (Q, K and V are one ``c_attn`` in both, columns ``[Q | K | V]``
there, rows here).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tensorpar.world import collective_device

from . import hf_llama

_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _check_supported(hf: Any) -> None:
    """Raise for GPT-2 variants whose computation differs from our Block."""
    if getattr(hf, "model_type", None) != "gpt2":
        raise TypeError(f"from_hf expects a GPT-2 model (GPT2LMHeadModel), got model_type "
                        f"{getattr(hf, 'model_type', None)!r}")
    differences = {
        "activation_function": (hf.activation_function, ("gelu_new", "gelu_pytorch_tanh")),
        "n_inner": (hf.n_inner, (None, 4 * hf.n_embd)),
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
                n_embd=hf.n_embd, dropout=hf.resid_pdrop, bias=True, norm_eps=float(hf.layer_norm_epsilon))


def gpt_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A GPT-2 state dict in our key layout: Conv1D weights transposed."""
    out = {}
    for key, value in state.items():
        if not key.startswith(("transformer.", "lm_head.")) or key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers of older transformers versions
        out[key] = value.t() if key.endswith(_TRANSPOSED) else value
    out.setdefault("lm_head.weight", out["transformer.wte.weight"])
    return out


# ---------------------------------------------------------------- export: our GPT -> GPT-2

#: GPTConfig fields that change how the model is run, not what it computes
_RUNTIME_ONLY = ("activation_checkpointing", "sequence_parallel")
#: GPT-2's parameters without a bias (the tables); every other weight has one
_NO_BIAS = ("transformer.wte.weight", "transformer.wpe.weight")
#: the dtypes a GPT's weights may have in an export
_EXPORTED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def check_exportable(config: Any) -> None:
    """Raise ``ValueError`` naming each ``GPTConfig`` field that GPT-2 cannot express.

    GPT-2 has a GELU (tanh) MLP of width ``4 * n_embd``, as many key/value heads as
    query heads, learned positions and an LM head tied to the token embedding. It has
    biases everywhere; a GPT without them (``bias=False``, nanoGPT's and the training
    script's default: no bias in the linears or LayerNorms) is GPT-2 with zero biases.
    Fields this module does not know must keep their default.
    """
    required = {"mlp": ("gelu",), "n_kv_head": (None, config.n_head)}
    known = {"block_size", "vocab_size", "n_layer", "n_head", "n_embd", "dropout", "bias", "norm_eps", *required,
             *_RUNTIME_ONLY}
    wrong = [f"{name}={getattr(config, name)!r} (GPT-2 needs {' or '.join(map(repr, ok))})"
             for name, ok in required.items() if getattr(config, name) not in ok]
    wrong += [f"{f.name}={getattr(config, f.name)!r} (GPT-2 has no such setting; keep {f.default!r})"
              for f in fields(config) if f.name not in known and f.default is not MISSING
              and getattr(config, f.name) != f.default]
    if wrong:
        raise ValueError("export_gpt2: GPTConfig fields GPT-2 cannot express: " + "; ".join(wrong))


def gpt2_config(config: Any, dtype: torch.dtype, *, eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of a ``GPT2LMHeadModel`` computing what a GPT of ``config`` computes."""
    check_exportable(config)
    name = str(dtype).removeprefix("torch.")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
            "n_positions": config.block_size, "n_embd": config.n_embd, "n_layer": config.n_layer,
            "n_head": config.n_head, "n_inner": None, "activation_function": "gelu_new",
            "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
            "layer_norm_epsilon": config.norm_eps, "initializer_range": 0.02, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": True, "bos_token_id": eos_token_id, "eos_token_id": eos_token_id,
            "dtype": name, "torch_dtype": name}  # the second for transformers 4.x


def gpt2_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full state dict in GPT-2's keys: projections transposed to ``Conv1D``'s ``(in, out)``, zeros for
    the biases of a GPT without them; the tied ``lm_head.weight`` is left out, as GPT-2 saves it."""
    out = {key: value.t() if key.endswith(_TRANSPOSED) else value
           for key, value in state.items() if key != "lm_head.weight"}
    return {k: v.contiguous() for k, v in with_zero_biases(out).items()}


def with_zero_biases(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A GPT-2 state dict with a zero bias after every weight that lacks one (LayerNorms: ``(C,)``;
    ``Conv1D`` weights ``(in, out)``: ``(out,)``), which computes what the bias-free layers do."""
    out = {}
    for key, value in state.items():
        out[key] = value
        bias = key.removesuffix("weight") + "bias"
        if key.endswith(".weight") and key not in _NO_BIAS and bias not in state:
            out[bias] = value.new_zeros(value.shape[-1])
    return out


def export_gpt2(model: nn.Module, directory: str | os.PathLike[str], *,
                eos_token_id: int | None = None) -> Path:
    """Save a sharded :class:`~layers.GPT` as a Hugging Face GPT-2 directory (``config.json`` and
    ``model.safetensors``) that ``GPT2LMHeadModel.from_pretrained(directory)`` loads with the same
    logits. A collective: every rank of the job calls it; each tp group gathers its full weights
    (:func:`tensorpar.full_state_dict`) and global rank 0 writes them; every rank returns the
    directory once it is written (or raises if it could not be). ``transformers`` is not needed.

    Only configurations GPT-2 can express export (see :func:`check_exportable`); others raise
    ``ValueError`` naming the field, on every rank and before any collective. ``eos_token_id``
    (and ``bos_token_id``) go into ``config.json``: 50256 for GPT-2's own tokenizer.

    Example::

        gpt = GPT(GPTConfig(vocab_size=50257, n_layer=12, n_head=12, n_embd=768, block_size=1024))
        export_gpt2(gpt, "out/gpt2")        # then GPT2LMHeadModel.from_pretrained("out/gpt2")
    """
    return _export("export_gpt2", model, directory, eos_token_id,
                   lambda config, dtype: gpt2_config(config, dtype, eos_token_id=eos_token_id),
                   lambda state, config: gpt2_state_dict(state))


def export_llama(model: nn.Module, directory: str | os.PathLike[str], *,
                 eos_token_id: int | None = None) -> Path:
    """Save a sharded :class:`~layers.GPT` built with Llama's options (``norm="rmsnorm",
    positions="rope", mlp="swiglu"``, any ``n_kv_head``) as a Hugging Face Llama directory that
    ``LlamaForCausalLM.from_pretrained(directory)`` loads with the same logits (:mod:`layers.hf_llama`
    maps the keys). A collective, written by global rank 0, as :func:`export_gpt2`; a configuration
    Llama cannot express raises ``ValueError`` naming the field, on every rank, before any collective.

    Example::

        gpt = GPT(GPTConfig(n_kv_head=4, mlp="swiglu", norm="rmsnorm", positions="rope", bias=False))
        export_llama(gpt, "out/llama")      # then LlamaForCausalLM.from_pretrained("out/llama")
    """
    return _export("export_llama", model, directory, eos_token_id,
                   lambda config, dtype: hf_llama.llama_config(config, dtype, eos_token_id=eos_token_id),
                   hf_llama.llama_state_dict)


def export_hf(model: nn.Module, directory: str | os.PathLike[str], *, eos_token_id: int | None = None) -> Path:
    """Save a sharded :class:`~layers.GPT` as the Hugging Face model its options make it: GPT-2
    (LayerNorm and learned positions: :func:`export_gpt2`) or else Llama (:func:`export_llama`)."""
    config = getattr(model, "config", None)
    gpt2 = getattr(config, "norm", None) == "layernorm" and getattr(config, "positions", None) == "learned"
    return (export_gpt2 if gpt2 else export_llama)(model, directory, eos_token_id=eos_token_id)


def _export(name: str, model: nn.Module, directory: str | os.PathLike[str], eos_token_id: int | None,
            config_json: Callable[[Any, torch.dtype], dict[str, Any]],
            tensors: Callable[[Mapping[str, torch.Tensor], Any], dict[str, torch.Tensor]]) -> Path:
    """Check ``model`` (on every rank, before any collective), gather its full state dict and, on
    global rank 0, write ``config_json(config, dtype)`` and ``tensors(state, config)``."""
    config = getattr(model, "config", None)
    if not callable(getattr(model, "full_state_dict", None)) or not hasattr(config, "n_kv_head"):
        raise TypeError(f"{name} expects a layers.GPT, got {type(model).__name__}")
    if eos_token_id is not None and not (isinstance(eos_token_id, int) and 0 <= eos_token_id < config.vocab_size):
        raise ValueError(f"eos_token_id must be a token id in [0, {config.vocab_size}), got {eos_token_id!r}")
    dtype = model.transformer.wte.weight.dtype
    if dtype not in _EXPORTED_DTYPES:
        raise TypeError(f"{name} writes {', '.join(map(str, _EXPORTED_DTYPES))} weights, not {dtype}")
    files = config_json(config, dtype)  # raises before any collective
    if importlib.util.find_spec("safetensors") is None:  # alike on every rank
        raise ImportError(f"{name} writes model.safetensors with the safetensors package: "
                          "pip install 'tensorpar[hf]'")
    state = model.full_state_dict()  # a collective over each tp group
    path = Path(directory)
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            from safetensors.torch import save_file

            path.mkdir(parents=True, exist_ok=True)
            written = {k: v.contiguous() for k, v in tensors(state, config).items()}
            save_file(written, str(path / "model.safetensors.partial"), metadata={"format": "pt"})
            os.replace(path / "model.safetensors.partial", path / "model.safetensors")
            partial = path / "config.json.partial"
            partial.write_text(json.dumps(files, indent=2) + "\n")
            os.replace(partial, path / "config.json")
        except Exception as e:  # noqa: BLE001 - re-raised below, after the peers have been told
            failure = e
    del state
    ok = torch.tensor([failure is None], dtype=torch.int32, device=collective_device())
    dist.broadcast(ok, src=0)  # every rank learns whether rank 0 wrote the files
    if failure is not None:
        raise failure
    if not ok.item():
        raise RuntimeError(f"{name}: rank 0 could not write {path}")
    return path
