"""Tiny random ``transformers`` causal LMs for the parallelize_hf tests, and batches for them."""

import torch


def build(arch, spec, dtype, seed):
    """The dense ``transformers`` model of ``spec`` from ``seed``: every weight perturbed, so that
    biases and norm scales (zeros and ones at init) are not the same everywhere."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    spec = dict(spec)
    attn = spec.pop("attn")
    if arch == "gpt2":
        config = transformers.GPT2Config(**spec, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=0, eos_token_id=0)
        cls = transformers.GPT2LMHeadModel
    else:
        name = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[arch]
        config = getattr(transformers, f"{name}Config")(**spec, max_position_embeddings=32, bos_token_id=0,
                                                        eos_token_id=0)
        cls = getattr(transformers, f"{name}ForCausalLM")
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(config).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def batch(spec, b, t, seed):
    """Token ids ``(b, t)``, ``t >= 2``, and labels with some ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec["vocab_size"], (b, t), generator=g)
    if spec.get("pad_token_id") is not None:
        ids[0, 0] = spec["pad_token_id"]  # the padding row is looked up
    labels = ids.clone()
    labels[torch.rand(b, t, generator=g) < 0.2] = -100
    labels[0, 1] = ids[0, 1]  # at least one counted target (the model shifts labels: position 0 has none)
    return ids, labels
