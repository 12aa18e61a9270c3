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
        config = transformers.GPT2Config(**{"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **spec},
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
    """Token ids ``(b, t)`` and labels with some ignored (-100); ``3 <= t <= vocab_size``.

    The tokens of a row are distinct, and position 1 predicts a counted label: with rotary
    embeddings, a query that attends only to copies of one token (repeated tokens, or position 0
    alone) gets a gradient that is zero in exact arithmetic, round-off alone in practice, which
    AdamW's scale-free steps would turn into steps that differ between any two computations.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(spec["vocab_size"], generator=g)[:t] for _ in range(b)])
    pad = spec.get("pad_token_id")
    if pad is not None:  # the padding row is looked up (moved to the front if drawn)
        row = ids[0]
        row[(row == pad).nonzero().flatten()] = row[0].item()
        row[0] = pad
    labels = ids.clone()
    labels[torch.rand(b, t, generator=g) < 0.2] = -100
    labels[0, 2] = ids[0, 2]  # the model shifts labels: position 1 predicts this one
    return ids, labels
