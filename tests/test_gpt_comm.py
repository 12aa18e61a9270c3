"""Collective accounting of the GPT against Megatron's formula.

Per block forward+backward: 2 all-reduces of B·T·C forward (after attention and
after the MLP: ``g``) and 2 backward (before them: ``f``). The embedding adds 1
forward, the tied LM head 1 backward, and vocab-parallel cross-entropy 3 of B·T
forward (max, target logit, sum of exponentials). Nothing else, at any tp > 1;
at tp = 1, nothing at all. With fewer KV heads than ranks the replicated K/V
weights add one all-reduce of their gradients (weights and biases) per block.

With sequence parallelism each of those all-reduces becomes a reduce-scatter
and an all-gather of the same B·T·C (Megatron's ``ḡ``/``f̄``; together they
send what one all-reduce sends; where T does not divide by tp, the shards travel
padded to the largest, B·tp·ceil(T/tp)·C); each column region's input is gathered once
more in backward, where it was kept as this rank's tokens; and each LayerNorm
sums its weight and bias gradients in one all-reduce of C (or 2C) elements.
"""

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorpar
from gpt_cases import batch, gpt_configs
from layers import GPT, GPTConfig
from tensorpar.testing import count_collectives
from tensorpar.testing.strategies import tp_sizes


def count_gpt(cfg, b, t, sequence_parallel=False):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg, sequence_parallel=sequence_parallel))
    idx, targets = batch(cfg, b, t, 0)
    mesh = tensorpar.current_mesh()
    local = tensorpar.sequence_sizes(t, mesh.tp)[mesh.tp_rank] if sequence_parallel else t
    x = torch.randn(b, local, cfg["n_embd"], requires_grad=True)
    with count_collectives() as block:
        model.transformer.h[0](x, t).sum().backward()
    with count_collectives() as whole:
        model(idx, targets).backward()
    return block.summary(), whole.summary()


def expected_counts(cfg, b, t, tp, sequence_parallel=False):
    if tp == 1:
        return Counter(), Counter()
    f32, act, tokens = torch.float32, b * t * cfg["n_embd"], b * t
    padded = b * tp * max(tensorpar.sequence_sizes(t, tp)) * cfg["n_embd"]  # an activation's shards as they travel
    biased = cfg["bias"] and cfg["norm"] == "layernorm"  # an RMSNorm has a weight only
    norm = ("backward", "all_reduce", f32, cfg["n_embd"] * (1 + biased))  # a norm's weight (and bias)
    if sequence_parallel:
        block = Counter({("forward", "all_gather", f32, padded): 2, ("forward", "reduce_scatter", f32, padded): 2,
                         ("backward", "reduce_scatter", f32, padded): 2, ("backward", "all_gather", f32, padded): 4,
                         norm: 2})
    else:
        block = Counter({("forward", "all_reduce", f32, act): 2, ("backward", "all_reduce", f32, act): 2})
    if cfg["n_kv_head"] < tp:  # replicated K/V: one all-reduce sums their rows of c_attn's weight and bias gradients
        kv = 2 * cfg["n_kv_head"] * (cfg["n_embd"] // cfg["n_head"])  # rows of K and of V
        block[("backward", "all_reduce", f32, kv * (cfg["n_embd"] + cfg["bias"]))] += 1
    whole = Counter({k: v * cfg["n_layer"] for k, v in block.items()})
    if sequence_parallel:
        whole[("forward", "reduce_scatter", f32, padded)] += 1  # token (+ position) embedding
        whole[("backward", "all_gather", f32, padded)] += 2  # its gradient; the LM head's input, again
        whole[("forward", "all_gather", f32, padded)] += 1  # LM head (f̄)
        whole[("backward", "reduce_scatter", f32, padded)] += 1
        whole[norm] += 1  # ln_f
    else:
        whole[("forward", "all_reduce", f32, act)] += 1  # token + position embedding
        whole[("backward", "all_reduce", f32, act)] += 1  # LM head (f)
    whole[("forward", "all_reduce", f32, tokens)] += 3  # cross-entropy
    return block, whole


@settings(max_examples=25)
@given(tp=tp_sizes(), data=st.data())
def test_gpt_collectives_match_megatron(worlds, tp, data):
    cfg = data.draw(gpt_configs(tp))
    b, t = data.draw(st.integers(1, 3)), data.draw(st.integers(1, cfg["block_size"]))
    sp = data.draw(st.booleans(), label="sequence_parallel")
    block, whole = expected_counts(cfg, b, t, tp, sp)
    for rank, (got_block, got_whole) in enumerate(worlds[tp].run(count_gpt, cfg, b, t, sp)):
        assert got_block == block, f"rank {rank}: one block issued {dict(got_block)}, expected {dict(block)}"
        assert got_whole == whole, f"rank {rank}: the model issued {dict(got_whole)}, expected {dict(whole)}"

