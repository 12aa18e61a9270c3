"""Hypothesis strategies for GPT configurations, and building a sharded GPT next to
its plain twin with the same weights."""

import torch
from hypothesis import strategies as st

from layers import GPT, GPTConfig
from reference_gpt import RefConfig, RefGPT

# Worst relative error seen per dtype by the GPT equivalence tests (printed at the end of the run).
WORST: dict[str, float] = {}
EXAMPLES = {"gpt": 0}


def note_errors(dtype, errors):
    name = str(dtype).removeprefix("torch.")
    WORST[name] = max(WORST.get(name, 0.0), *errors)
    EXAMPLES["gpt"] += 1


@st.composite
def gpt_configs(draw, tp, *, max_layer=3):
    """Configs valid at ``tp``: head counts that do not divide by it, KV heads fewer than it,
    odd vocabulary sizes, either MLP, either norm, learned or rotary positions."""
    n_head = draw(st.integers(tp, 6))
    n_kv_head = draw(st.sampled_from([d for d in range(1, n_head + 1) if n_head % d == 0]))
    # n_embd >= 3: LayerNorm over 2 features outputs (±1, ∓1) whatever its input, so every gradient
    # beneath it is zero in exact arithmetic and round-off alone in practice.
    # Rotary positions turn pairs of features: an even head_dim.
    positions = draw(st.sampled_from(["learned", "rope"]))
    dims = range(-(-3 // n_head), 5)
    head_dim = draw(st.sampled_from([d for d in dims if d % 2 == 0] if positions == "rope" else list(dims)))
    return dict(
        n_layer=draw(st.integers(1, max_layer)), n_head=n_head, n_kv_head=n_kv_head, n_embd=n_head * head_dim,
        vocab_size=draw(st.integers(tp, 67)), block_size=draw(st.integers(max(tp, 2), 12)),
        bias=draw(st.booleans()), mlp=draw(st.sampled_from(["gelu", "swiglu"])),
        norm=draw(st.sampled_from(["layernorm", "rmsnorm"])), positions=positions,
    )


def twins(cfg, dtype, seed, *, sequence_parallel=False, **overrides):
    """A plain ``RefGPT`` initialised from ``seed``, and a sharded ``GPT`` loaded with its weights."""
    cfg = dict(cfg, **overrides)
    torch.manual_seed(seed)
    ref = RefGPT(RefConfig(**cfg)).to(dtype)
    model = GPT(GPTConfig(**cfg, sequence_parallel=sequence_parallel), device="meta", dtype=dtype)
    model.to_empty(device="cpu")
    model.load_full_state_dict(ref.state_dict())
    return ref, model


def batch(cfg, b, t, seed, ignore=True):
    """Token ids and next-token targets (some ignored with -1) of shape (b, t)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg["vocab_size"], (b, t + 1), generator=g)
    targets = idx[:, 1:].clone()
    if ignore:
        ignored = torch.rand(b, t, generator=g) < 0.2
        ignored[0, 0] = False  # at least one counted target, or the mean loss is 0/0
        targets[ignored] = -1
    return idx[:, :-1], targets


def key_bias_drift(full, ref_state, cfg, t=None):
    """Take the key rows out of every ``attn.c_attn.bias`` of both state dicts (in place) and return how far
    they moved apart, by key. A key bias adds the same amount to every score of a softmax row, so its
    gradient is identically zero and holds round-off only, which AdamW turns into steps of up to lr.
    With sequences of one token (``t == 1``) each softmax row has one score, whose probability is 1
    whatever it is: every query and key row of ``c_attn``, weight and bias, has a zero gradient then."""
    c, kv = cfg["n_embd"], (cfg.get("n_kv_head") or cfg["n_head"]) * (cfg["n_embd"] // cfg["n_head"])
    drift = {}
    suffixes = ("attn.c_attn.bias", "attn.c_attn.weight") if t == 1 else ("attn.c_attn.bias",)
    for k in [k for k in ref_state if k.endswith(suffixes) and k in full]:  # a pipeline stage: its own
        (q, key, v), (ref_q, ref_key, ref_v) = (s[k].split([c, kv, kv]) for s in (full, ref_state))
        drift[k] = (key - ref_key).abs().max().item()
        if t == 1:
            drift[k] = max(drift[k], (q - ref_q).abs().max().item())
            full[k], ref_state[k] = v, ref_v
        else:
            full[k], ref_state[k] = torch.cat([q, v]), torch.cat([ref_q, ref_v])
    return drift
