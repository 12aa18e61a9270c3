"""Collective accounting of the GPT against Megatron's formula.

Per block forward+backward: 2 all-reduces of B·T·C forward (after attention and
after the MLP: ``g``) and 2 backward (before them: ``f``). The embedding adds 1
forward, the tied LM head 1 backward, and vocab-parallel cross-entropy 3 of B·T
forward (max, target logit, sum of exponentials). Nothing else, at any tp > 1;
at tp = 1, nothing at all. With fewer KV heads than ranks the replicated K/V
weights add one all-reduce of their gradients (weights and biases) per block.
"""

from collections import Counter

import torch
from gpt_cases import batch, gpt_configs
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from layers import GPT, GPTConfig
from tensorpar.testing.strategies import tp_sizes


def count_gpt(cfg, b, t):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    idx, targets = batch(cfg, b, t, 0)
    x = torch.randn(b, t, cfg["n_embd"], requires_grad=True)
    with tensorpar.count_collectives() as block:
        model.transformer.h[0](x).sum().backward()
    with tensorpar.count_collectives() as whole:
        model(idx, targets).backward()
    return block.summary(), whole.summary()


def expected_counts(cfg, b, t, tp):
    if tp == 1:
        return Counter(), Counter()
    f32, act, tokens = torch.float32, b * t * cfg["n_embd"], b * t
    block = Counter({("forward", "all_reduce", f32, act): 2, ("backward", "all_reduce", f32, act): 2})
    if cfg["n_kv_head"] < tp:  # replicated K/V: one all-reduce each sums its weight and bias gradients
        kv = cfg["n_kv_head"] * (cfg["n_embd"] // cfg["n_head"])  # rows of K (and of V)
        block[("backward", "all_reduce", f32, kv * (cfg["n_embd"] + cfg["bias"]))] += 2
    whole = Counter({k: v * cfg["n_layer"] for k, v in block.items()})
    whole[("forward", "all_reduce", f32, act)] += 1  # token + position embedding
    whole[("backward", "all_reduce", f32, act)] += 1  # LM head (f)
    whole[("forward", "all_reduce", f32, tokens)] += 3  # cross-entropy
    return block, whole


@settings(max_examples=25)
@given(tp=tp_sizes(), data=st.data())
def test_gpt_collectives_match_megatron(worlds, tp, data):
    cfg = data.draw(gpt_configs(tp))
    b, t = data.draw(st.integers(1, 3)), data.draw(st.integers(1, cfg["block_size"]))
    block, whole = expected_counts(cfg, b, t, tp)
    for rank, (got_block, got_whole) in enumerate(worlds[tp].run(count_gpt, cfg, b, t)):
        assert got_block == block, f"rank {rank}: one block issued {dict(got_block)}, expected {dict(block)}"
        assert got_whole == whole, f"rank {rank}: the model issued {dict(got_whole)}, expected {dict(whole)}"

